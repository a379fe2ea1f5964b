"""ring_all_reduce (comm_collectives.py) against dist.all_reduce: bitwise the same result at world sizes 1 to
5, for awkward sizes and every dtype class, and exactly the bandwidth-optimal number of elements sent."""
import pytest
import torch
import torch.distributed as dist
from harness import spawn

import comm_collectives

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)  # what gloo's all_reduce takes
LARGE_ODD = 1_000_003  # about 4 MB of float32: chunks of unequal size at every world size above 1
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "gather", "scatter", "barrier")


def chunk_sizes(numel: int, world_size: int) -> list[int]:
    """What tensor_split gives, written out: the first numel % n chunks hold one element more."""
    return [numel // world_size + (i < numel % world_size) for i in range(world_size)]


def optimal_counts(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """(sent, received) elements for rank `rank` of a bandwidth-optimal ring: it sends every chunk but one in
    each phase, (r+1) mod n in the reduce-scatter and (r+2) mod n in the all-gather, and receives every chunk
    but r and r+1. With n dividing numel, 2(n-1)/n of the tensor each way."""
    c = chunk_sizes(numel, world_size)
    n = world_size
    return 2 * numel - c[(rank + 1) % n] - c[(rank + 2) % n], 2 * numel - c[rank] - c[(rank + 1) % n]


def integer_valued(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (sums stay below 127, exact in every dtype), different on every rank and element."""
    values = torch.arange(numel) % 11 + 3 * rank
    if dtype == torch.bool:
        return values % 2 == 0
    if dtype.is_complex:
        return torch.complex(values.float(), -values.float()).to(dtype)
    return values.to(dtype)


class Counter:
    """Counts the elements that ring_all_reduce passes to batch_isend_irecv, and fails any collective call:
    the ring must be built from point-to-point messages only."""

    def __init__(self, monkeypatch: dict):
        self.sent = self.received = 0
        self.patched = monkeypatch

    def __enter__(self):
        original = dist.batch_isend_irecv

        def counting(ops):
            for op in ops:
                if op.op is dist.isend:
                    self.sent += op.tensor.numel()
                elif op.op is dist.irecv:
                    self.received += op.tensor.numel()
            return original(ops)

        def forbidden(*args, **kwargs):
            raise AssertionError("ring_all_reduce called a collective")

        self.patched["batch_isend_irecv"] = original
        dist.batch_isend_irecv = counting
        for name in COLLECTIVES:
            self.patched[name] = getattr(dist, name)
            setattr(dist, name, forbidden)
        return self

    def __exit__(self, *exc):
        for name, function in self.patched.items():
            setattr(dist, name, function)


def ring_cases(group: dist.ProcessGroup | None) -> list[tuple]:
    """Run on every rank of `group`: one row (label, numel, equal, sent, optimal sent, received, optimal
    received) per case."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    cases = [(numel, dtype) for numel in sorted({0, 1, max(n - 1, 0), n, n + 1, 2 * n + 3, 1001})
             for dtype in (torch.float32, torch.int64)]
    cases += [(1001, dtype) for dtype in DTYPES]
    cases += [(LARGE_ODD, torch.float32), (LARGE_ODD, torch.int32)]
    default_segment = comm_collectives.SEGMENT_BYTES
    rows = []

    def run(label: str, tensor: torch.Tensor, segment_bytes: int = default_segment) -> None:
        expected = tensor.clone()
        dist.all_reduce(expected, group=group)
        comm_collectives.SEGMENT_BYTES = segment_bytes
        try:
            with Counter({}) as counter:
                comm_collectives.ring_all_reduce(tensor, group=group)
        finally:
            comm_collectives.SEGMENT_BYTES = default_segment
        equal = tensor.dtype == expected.dtype and tensor.shape == expected.shape and torch.equal(tensor, expected)
        sent, received = optimal_counts(tensor.numel(), n, rank)
        rows.append((label, tensor.numel(), equal, counter.sent, sent, counter.received, received))

    for numel, dtype in cases:
        run(f"{numel} x {dtype}", integer_valued(numel, rank, dtype))
    # Tiny segments, so that each chunk travels in many pieces, two in flight.
    for numel, dtype in ((1001, torch.float32), (2 * n + 3, torch.int64), (1001, torch.bool)):
        run(f"{numel} x {dtype} in 64-byte segments", integer_valued(numel, rank, dtype), segment_bytes=64)
    # A matrix keeps its shape, and a transposed (non-contiguous) one is also reduced in place.
    run("(7, 13) float32", integer_valued(91, rank, torch.float32).reshape(7, 13))
    run("(13, 7) transposed", integer_valued(91, rank, torch.float32).reshape(7, 13).t())
    return rows


def every_world_size(rank: int, world_size: int) -> dict[int, list[tuple]]:
    """The cases for world sizes 1 to world_size in one job (starting five processes costs more than all the
    cases): the default group, and groups of the last 1, 2, ... ranks, whose group ranks differ from their
    global ones."""
    results = {}
    for size in range(1, world_size + 1):
        members = list(range(world_size - size, world_size))
        group = None if size == world_size else dist.new_group(members)  # every rank calls new_group
        if rank in members:
            results[size] = ring_cases(group)
    dist.barrier()  # nobody tears down its connections while another rank still uses them
    return results


@pytest.fixture(scope="module")
def results_by_rank() -> list[dict[int, list[tuple]]]:
    results, _ = spawn(every_world_size, 5, timeout=120)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ring_all_reduce_equals_all_reduce_and_sends_the_optimal_amount(results_by_rank, world_size):
    members = [results[world_size] for results in results_by_rank if world_size in results]
    assert len(members) == world_size
    for group_rank, rows in enumerate(members):
        assert len(rows) >= 25
        for label, _, equal, sent, optimal_sent, received, optimal_received in rows:
            assert equal, f"rank {group_rank}: {label}: ring_all_reduce differs from dist.all_reduce"
            assert sent == optimal_sent, f"rank {group_rank}: {label}: sent {sent} elements, optimal {optimal_sent}"
            assert received == optimal_received, f"rank {group_rank}: {label}: received {received}"
    # Over all ranks: exactly 2(n-1) × numel elements each way, the lower bound (Patarasuk and Yuan 2009).
    for case, (label, numel, *_) in enumerate(members[0]):
        assert sum(rows[case][3] for rows in members) == 2 * (world_size - 1) * numel, label


def test_optimal_counts_are_two_n_minus_one_over_n_when_divisible():
    for world_size in range(1, 9):
        numel = 840  # divisible by 1..8
        for rank in range(world_size):
            assert optimal_counts(numel, world_size, rank) == (2 * (world_size - 1) * numel // world_size,) * 2
    assert chunk_sizes(7, 3) == [len(part) for part in torch.arange(7).tensor_split(3)]
    assert chunk_sizes(2, 5) == [len(part) for part in torch.arange(2).tensor_split(5)]
