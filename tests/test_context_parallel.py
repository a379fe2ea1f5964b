"""context_parallel.py at 2, 3 and 4 ranks, contiguous and zig-zag: ring attention's output and the gradients of
q, k and v equal causal attention over the whole sequence in one process, lengths that need padding included;
zig-zag balances the work; a ring that passes nothing is caught; a sequence too short is refused in one line."""
import sys
from unittest import mock

import pytest
import torch
from harness import spawn
from test_errors import assert_one_line, run_main
from workers import failure

import context_parallel

LENGTHS = [32, 29]  # 29: padded to whole chunks at every rank count here


def every_layout(rank: int, world_size: int) -> dict:
    results = {}
    for zigzag in (False, True):
        for seq_len in LENGTHS:
            sys.argv = ["context_parallel.py", "--seq_len", str(seq_len), *["--zigzag"] * zigzag]
            results[zigzag, seq_len] = context_parallel.check(context_parallel.parse_args(), rank, world_size)
    original, sent = context_parallel.ring_pass, []

    def counted(tensors):
        sent.append(sum(t.nbytes for t in tensors))
        return original(tensors)
    sys.argv = ["context_parallel.py"]
    args = context_parallel.parse_args()
    starts = [context_parallel.chunk_starts(r, world_size, 4 * world_size, False) for r in range(world_size)]
    with mock.patch.object(context_parallel, "ring_pass", counted):
        context_parallel.check(args, rank, world_size)
    results["sent"] = sent
    q, k, v = (torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(i)) for i in range(3))  # 4 tokens
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # gpt/model.py's layout
    results["strided"] = torch.equal(context_parallel.RingAttention.apply(*strided, starts),
                                     context_parallel.RingAttention.apply(q, k, v, starts))
    results["broken"] = failure(lambda: context_parallel.check(args, rank, world_size), context_parallel, "ring_pass",
                                lambda tensors: ([], list(tensors)))  # every rank sees only its own keys
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {n: spawn(every_layout, n, timeout=120)[0] for n in (2, 3, 4)}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("zigzag", [False, True], ids=["contiguous", "zigzag"])
@pytest.mark.parametrize("seq_len", LENGTHS)
def test_output_and_gradients_are_one_process_s(runs, world_size, zigzag, seq_len):
    """fp32, to 1e-5 (measured up to 1.2e-6): the softmax's sums are taken block by block and merged by the
    log-sum-exp rule, in another order than one process's."""
    for result in runs[world_size]:
        assert result[zigzag, seq_len] <= context_parallel.TOLERANCE


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_rank_sends_what_the_formula_says(runs, world_size):
    """Forward: the keys and values held, N - 1 times; backward: keys, values and their gradients, N times.
    Per rank and layer, with L = S/N local tokens: 2(N-1)·b·h·L·d forward, 4N·b·h·L·d backward, in fp32."""
    block = 2 * 2 * -(-32 // world_size) * 8 * 4  # b · h · L · d floats of 4 bytes: defaults, 32 tokens padded
    for result in runs[world_size]:
        assert result["sent"] == [2 * block] * (world_size - 1) + [4 * block] * world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_queries_keys_and_values_need_not_be_contiguous(runs, world_size):
    """As gpt/model.py's attention makes them (a view, transposed): the same output as contiguous ones."""
    assert all(result["strided"] for result in runs[world_size])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_ring_that_passes_nothing_is_caught(runs, world_size):
    """Rank 0 holds the first chunk, which needs no other rank's keys: the others must fail."""
    assert all("differs from one process" in result["broken"] for result in runs[world_size][1:])


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_zigzag_gives_every_rank_the_same_work_and_contiguous_chunks_do_not(world_size):
    """Contiguous: rank r attends to r + 1 chunks of (S/N)² scores. Zig-zag: 2N + 1 pairs of (S/2N)² each."""
    seq_len = 16 * world_size
    contiguous = [context_parallel.work(r, world_size, seq_len, False) for r in range(world_size)]
    zigzag = [context_parallel.work(r, world_size, seq_len, True) for r in range(world_size)]
    assert contiguous == [(r + 1) * (seq_len // world_size) ** 2 for r in range(world_size)]
    assert zigzag == [(2 * world_size + 1) * (seq_len // (2 * world_size)) ** 2] * world_size


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "start this script with torchrun"),
    (["--seq_len", "3", "--zigzag"], {"RANK": "0", "WORLD_SIZE": "4"}, "--seq_len 3 is too short for the 8 chunks"),
    (["--seq_len", "9"], {"RANK": "0", "WORLD_SIZE": "4"}, "a rank would hold padding only"),  # 3 chunks of 3 hold all
    (["--head_dim", "0"], {}, "--head_dim must be above 0"),
])
def test_bad_input_is_one_line(argv, env, message):
    assert_one_line(*run_main("context_parallel.py", *argv, env=env)[::2], message)
