"""uneven_inputs.py: with Join, ranks that hold different numbers of batches all finish, every one with the
weights of a single process that computes what Join does; without Join they cannot finish."""
import argparse
import ast
import contextlib
import functools
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import run_ranks, spawn
from launch import REPO, epoch_losses
from reference import sampler_order

import uneven_inputs
from data import make_datasets
from model import build_model

# 301 samples in files of 1 and 2 parts (2 ranks: 100 and 201 samples, 15 and 29 batches of 7) or of 1, 2 and
# 3 parts (3 ranks: 50, 100 and 151 samples, 8, 15 and 22 batches); every file ends in a short batch. Two
# epochs: the second starts from the state that the first left on every rank.
SIZES = ["--max_epochs", "2", "--train_size", "301", "--val_size", "50", "--batch_size", "7", "--lr", "0.01"]
BATCHES = {2: [15, 29], 3: [8, 15, 22]}


def parse(argv: list[str]) -> argparse.Namespace:
    saved, sys.argv = sys.argv, ["uneven_inputs.py", *argv]
    try:
        return uneven_inputs.parse_args()
    finally:
        sys.argv = saved


def files(train_size: int, world_size: int) -> list[range]:
    """Each rank's file, from the rule the script documents: r + 1 contiguous parts of 1 + 2 + ... + N."""
    parts = world_size * (world_size + 1) // 2
    ends = [train_size * (r * (r + 1) // 2) // parts for r in range(world_size + 1)]
    return [range(ends[r], ends[r + 1]) for r in range(world_size)]


@functools.cache
def join_reference(world_size: int, divide_by_active: bool) -> tuple[dict, list[tuple[float, float]]]:
    """What DDP under Join computes with SIZES, in one process without torch.distributed; return the final
    weights and each epoch's (train_loss, val_loss).

    Every rank's batches of the epoch are rebuilt (its file, shuffled with seed + epoch). Step t takes the
    batch t of every rank that still has one: DDP divides each rank's gradient by the world size and sums
    them, and a rank that ran out adds the zeros that Join all-reduces in its place; with divide_by_active,
    the divisor is the number of ranks with a batch. One model and one optimizer take every step: the
    weights and optimizer state of the last rank, which holds the most batches and which the script copies."""
    args = parse(SIZES)
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    x, y = train_set.tensors
    torch.manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for epoch in range(args.max_epochs):
        batches = []  # by rank
        for indices in files(args.train_size, world_size):
            order = [indices.start + i for i in sampler_order(len(indices), 1, args.seed, epoch)[0]]
            batches.append([order[i:i + args.batch_size] for i in range(0, len(order), args.batch_size)])
        loss_sum = 0.0
        for step in range(max(map(len, batches))):
            active = [by_rank[step] for by_rank in batches if step < len(by_rank)]
            optimizer.zero_grad()
            rank_losses = [F.mse_loss(model(x[batch]), y[batch]) for batch in active]
            (sum(rank_losses) / (len(active) if divide_by_active else world_size)).backward()
            optimizer.step()
            loss_sum += sum(loss.item() * len(batch) for loss, batch in zip(rank_losses, active, strict=True))
        with torch.no_grad():
            val_loss = F.mse_loss(model(val_set.tensors[0]), val_set.tensors[1]).item()
        losses.append((loss_sum / len(x), val_loss))
    return model.state_dict(), losses


def join_runs(rank: int, world_size: int) -> list[dict]:
    """On every rank, in one process group: train() with Join, with --divide_by_active, and with Join but
    without the broadcast of the last rank's optimizer state (last: it replaces it for good in this worker)."""
    weights = [uneven_inputs.train(parse(SIZES), rank, world_size).state_dict(),
               uneven_inputs.train(parse([*SIZES, "--divide_by_active"]), rank, world_size).state_dict()]
    uneven_inputs.dist.broadcast_object_list = lambda objects, src: None
    return [*weights, uneven_inputs.train(parse(SIZES), rank, world_size).state_dict()]


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[list[dict]], list[str]]]:
    """{world_size: (every rank's weights of the three runs, every rank's stdout)}."""
    return {n: spawn(join_runs, n, timeout=90) for n in (2, 3)}


def max_difference(weights: dict, expected: dict) -> float:
    return max((weights[name] - tensor).abs().max().item() for name, tensor in expected.items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_read_files_that_hold_different_numbers_of_batches(runs, world_size):
    _, stdouts = runs[world_size]
    args = parse(SIZES)
    loaders = [uneven_inputs.make_loaders(args, rank, world_size)[0] for rank in range(world_size)]
    assert [loader.dataset.indices for loader in loaders] == files(301, world_size)
    assert [len(loader) for loader in loaders] == BATCHES[world_size]
    for rank, stdout in enumerate(stdouts):  # once per run
        assert stdout.count(f"[rank {rank}/{world_size}] {BATCHES[world_size][rank]} steps per epoch\n") == 3


def test_the_last_rank_holds_the_most_batches_whatever_the_sizes():
    """The script copies the optimizer state of rank N - 1, as the rank whose weights Join copies: the
    highest of those that finish last."""
    for world_size in range(2, 9):
        for train_size in range(world_size * (world_size + 1) // 2, 400):
            sizes = [len(indices) for indices in files(train_size, world_size)]
            assert sizes == sorted(sizes) and min(sizes) > 0, (world_size, train_size)


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_ends_every_rank_with_the_weights_of_the_reference(runs, world_size):
    """Not bitwise: DDP sums the ranks' gradients divided by the world size, the reference divides their summed
    losses; 1e-5 after 58 or 44 Adam steps."""
    results, stdouts = runs[world_size]
    for run, divide_by_active in ((0, False), (1, True)):
        for rank in range(1, world_size):
            for name, tensor in results[0][run].items():
                assert torch.equal(results[rank][run][name], tensor), (run, rank, name)
        expected, losses = join_reference(world_size, divide_by_active)
        for name, tensor in expected.items():
            torch.testing.assert_close(results[0][run][name], tensor, rtol=0, atol=1e-5, msg=(run, name))
        other, _ = join_reference(world_size, not divide_by_active)  # the test tells the two divisors apart
        assert max_difference(results[0][run], other) > 1e-3
        printed = epoch_losses(stdouts[0].split("done |")[run])
        assert sorted(printed) == [0, 1]
        for epoch, (train_loss, val_loss) in enumerate(losses):
            assert printed[epoch] == pytest.approx((train_loss, val_loss), abs=2e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_the_optimizer_state_of_the_last_rank_the_replicas_drift(runs, world_size):
    """Join copies the weights at its exit, so every rank still ends with the same weights; but the ranks that
    ran out start the next epoch with Adam state that lags, and the run goes astray."""
    results, _ = runs[world_size]
    for rank in range(1, world_size):
        for name, tensor in results[0][2].items():
            assert torch.equal(results[rank][2][name], tensor), name
    expected, _ = join_reference(world_size, False)
    assert max_difference(results[0][2], expected) > 1e-3


def without_join(rank: int, world_size: int) -> None:
    """train() with a Join that does nothing, in a group whose collectives give up after 3 s."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=3))  # not the harness's 60 s
    uneven_inputs.Join = lambda joinables, **options: contextlib.nullcontext()
    uneven_inputs.train(parse(SIZES), rank, world_size)


def test_without_join_the_ranks_with_batches_left_wait_in_vain():
    """Rank 0 runs out after 15 steps and goes on to the broadcast after the epoch; rank 1 waits in the
    all-reduce of its 16th step. Neither call is ever answered: the first rank to wait gives up at the
    timeout, and the other at its own timeout or, if the first has closed its connections by then (a
    machine under load can start the two waits far apart), when its peer goes."""
    codes, _, stdouts, stderrs = run_ranks(without_join, 2, timeout=60)
    assert codes == [1, 1], stderrs
    for stderr, waiting_in in zip(stderrs, ("broadcast_object_list", "backward"), strict=True):
        assert waiting_in in stderr and ("Timed out waiting 3000ms" in stderr or "Connection closed by peer" in stderr)
    assert any("Timed out waiting 3000ms" in stderr for stderr in stderrs), stderrs
    assert all(epoch_losses(stdout) == {} for stdout in stdouts)


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's code, without comments (ast drops them)."""
    return {node.name: ast.dump(node) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)}


def test_what_join_does_not_change_is_singlenode_cpus_code():
    lesson, reference = _functions(REPO / "uneven_inputs.py"), _functions(REPO / "singlenode_cpu.py")
    assert list(lesson) == list(reference)  # the same functions, in the same order
    for name in ("train_one_epoch", "evaluate", "epoch_means"):
        assert lesson[name] == reference[name], name
