"""uneven_inputs.py: with Join, ranks that hold different numbers of batches all finish, every one
with the weights of a single process that computes what Join does; without it, the run stops at
--timeout with one line that says why."""
import functools
import re
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from harness import spawn, torchrun_in_process
from launch import epoch_losses
from reference import sampler_order
from workers import train_script

import uneven_inputs
from data import make_datasets
from model import build_model

# 301 samples in files of 1 and 2 parts (2 ranks: 100 and 201 samples, 15 and 29 batches of 7) or
# of 1, 2 and 3 parts (3 ranks: 50, 100 and 151 samples, 8, 15 and 22 batches); every file ends in
# a short batch. Two epochs: the second starts from the state that the first left on every rank.
SIZES = ["--max_epochs", "2", "--train_size", "301", "--val_size", "50", "--batch_size", "7", "--lr", "0.01"]
FILE_LINE = re.compile(r"^\[rank (\d+)/(\d+)\] samples (\d+) to (\d+): (\d+) batches$", re.MULTILINE)


def parse(argv: list[str]):
    saved, sys.argv = sys.argv, ["uneven_inputs.py", *argv]
    try:
        return uneven_inputs.parse_args()
    finally:
        sys.argv = saved


def files(train_size: int, world_size: int) -> list[range]:
    """Each rank's file, from the rule the script documents: r + 1 parts of world_size × (world_size + 1) / 2."""
    parts = world_size * (world_size + 1) // 2
    ends = [train_size * (r * (r + 1) // 2) // parts for r in range(world_size + 1)]
    return [range(ends[r], ends[r + 1]) for r in range(world_size)]


@functools.cache
def join_reference(world_size: int, divide_by_active: bool) -> tuple[dict, list[tuple[float, float]]]:
    """What DDP under Join computes with SIZES, in one process without torch.distributed; return the
    final weights and each epoch's (train_loss, val_loss).

    Every rank's batches of the epoch are rebuilt (its file, shuffled with seed + epoch). Step t
    takes the batch t of every rank that still has one: DDP divides each rank's gradient by the
    world size and sums them, and a rank that ran out adds the zeros that Join all-reduces in its
    place (divide_by_initial_world_size=True); with divide_by_active, the divisor is the number of
    ranks with a batch. One model and one optimizer take every step: the weights and optimizer
    state of the ranks that hold the most batches, which the script gives every rank."""
    args = parse(SIZES)
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    x, y = train_set.tensors
    torch.manual_seed(args.seed)
    model = build_model(args.model)
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
    """On every rank, in one process group: train() with Join, with --divide_by_active, and with
    Join but without the copy of the optimizer state (last: it replaces the function for good in
    this worker)."""
    weights = [train_script(rank, world_size, "uneven_inputs", SIZES),
               train_script(rank, world_size, "uneven_inputs", [*SIZES, "--divide_by_active"])]
    uneven_inputs.copy_optimizer_state = lambda optimizer, src: None
    weights.append(train_script(rank, world_size, "uneven_inputs", SIZES))
    return weights


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[list[dict]], list[str]]]:
    """{world_size: (every rank's weights of the three runs, every rank's stdout)}."""
    return {n: spawn(join_runs, n, timeout=90) for n in (2, 3)}


def max_difference(weights: dict, expected: dict) -> float:
    return max((weights[name] - tensor).abs().max().item() for name, tensor in expected.items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_read_files_that_hold_different_numbers_of_batches(runs, world_size):
    _, stdouts = runs[world_size]
    expected = files(301, world_size)
    assert [i for indices in expected for i in indices] == list(range(301))  # every sample, once
    counts = []
    for rank, stdout in enumerate(stdouts):
        lines = FILE_LINE.findall(stdout)
        assert len(lines) == 3 and len(set(lines)) == 1, stdout  # one line per run, the same each time
        r, w, first, last, batches = map(int, lines[0])
        assert (r, w, range(first, last + 1)) == (rank, world_size, expected[rank])
        assert batches == -(-len(expected[rank]) // 7)
        counts.append(batches)
    assert len(set(counts)) == world_size, counts  # no two ranks take the same number of steps
    assert f"{max(counts)} steps per epoch: Join stands in for each rank" in stdouts[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_join_ends_every_rank_with_the_weights_of_the_reference(runs, world_size):
    results, stdouts = runs[world_size]
    for run, divide_by_active in ((0, False), (1, True)):
        for rank in range(1, world_size):
            for name, tensor in results[0][run].items():
                assert torch.equal(results[rank][run][name], tensor), (run, rank, name)
        expected, losses = join_reference(world_size, divide_by_active)
        for name, tensor in expected.items():
            torch.testing.assert_close(results[0][run][name], tensor, rtol=0, atol=1e-5, msg=(run, name))
        # The other divisor ends elsewhere: the test tells the two apart.
        other, _ = join_reference(world_size, not divide_by_active)
        assert max_difference(results[0][run], other) > 1e-3
        printed = epoch_losses(stdouts[0].split("done |")[run])
        assert sorted(printed) == [0, 1]
        for epoch, (train_loss, val_loss) in enumerate(losses):
            assert printed[epoch] == pytest.approx((train_loss, val_loss), abs=2e-6)


def test_without_the_optimizer_state_of_the_last_rank_the_replicas_drift(runs):
    """Join copies the weights at its exit, so every rank still ends with the same weights; but the
    rank that ran out starts the next epoch with Adam state that lags, and the run goes astray."""
    results, _ = runs[2]
    for name, tensor in results[0][2].items():
        assert torch.equal(results[1][2][name], tensor), name
    expected, _ = join_reference(2, False)
    assert max_difference(results[0][2], expected) > 1e-3


def test_without_join_the_run_stops_at_the_timeout_with_one_line():
    """The rank with 29 batches waits in its gradient all-reduce of step 16 for the rank with 15,
    which waits in the next collective; at --timeout both give up and one line says why."""
    started = time.monotonic()
    result = torchrun_in_process(2, "uneven_inputs.py", *SIZES, "--no_join", "--timeout", "3", timeout=60)
    assert result.codes == [1, 1]
    assert 3 < time.monotonic() - started < 45  # it waited for --timeout, not for gloo's default of 30 minutes
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert error_lines == [
        "error: the ranks hold 15, 29 batches: after step 15 rank 0 had none left, and the gradient all-reduce of "
        "rank 1 waited for it until --timeout (3 s); wrap the training loop in Join, or give every rank the same "
        "number of batches"], result.stderr
    assert "Traceback" not in result.stderr  # no worker's traceback
    assert sorted(FILE_LINE.findall(result.stdout)) == [("0", "2", "0", "99", "15"), ("1", "2", "100", "300", "29")]
    assert epoch_losses(result.stdout) == {}


@pytest.mark.parametrize("argv, environment, message", [
    ([], {}, "error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 uneven_inputs.py"),
    (["--train_size", "5"], {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
     "error: --train_size 5 leaves rank 0 no sample: with 3 ranks it needs at least 6"),
])
def test_a_wrong_start_is_one_line(argv, environment, message, monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["uneven_inputs.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        uneven_inputs.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == message + "\n"
