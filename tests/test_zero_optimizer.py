"""zero_optimizer.py: ZeRO stage 1 trains what DDP with Adam trains, each rank holds the optimizer
state of the parameters assigned to it and no more, and its checkpoint resumes exactly."""
import contextlib
import functools
import hashlib
import io
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from launch import epoch_losses
from workers import train_script

import zero_optimizer
from model import build_model

PARAMETERS = 2_121_729  # the wide model: 20 × 1024 + 1024 + 2 × (1024 × 1024 + 1024) + 1024 + 1
SIZES = ["--train_size", "96", "--val_size", "32", "--batch_size", "8", "--lr", "0.001", "--max_epochs", "2"]
# The checkpoints hold the small default model: gathering the wide model's state on rank 0 takes
# about 0.7 s per checkpoint (docs/sharding.md), and the code that saves and loads is the same.
SMALL = [*SIZES, "--model", "mlp"]
ONE_EPOCH = [*SIZES[:-1], "1", "--model", "mlp"]
BYTES_LINE = re.compile(r"^\[rank (\d+)/(\d+)\] bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                        r"optimizer state ([\d,]+)$", re.MULTILINE)
UPDATES_LINE = re.compile(r"^\[rank (\d+)/(\d+)\] updates (.*)$", re.MULTILINE)
STEP_LINE = re.compile(r"^step time: (\d+\.\d\d) ms \(median of (\d+) steps, rank 0\)$", re.MULTILINE)


def refused(rank: int, world_size: int, argv: list[str]) -> tuple[int | None, str]:
    """(exit code, stderr) of a run that should stop before it trains."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            train_script(rank, world_size, "zero_optimizer", argv)
    except SystemExit as stop:
        return stop.code, stderr.getvalue()
    return None, stderr.getvalue()


def flip_a_bit(source: str, target: str) -> None:
    """A copy of the checkpoint with one bit flipped inside a weight's bytes."""
    data = bytearray(Path(source).read_bytes())
    weight = torch.load(source, weights_only=True)["model"]["net.0.weight"]
    data[bytes(data).index(weight.numpy().tobytes()) + 5] ^= 0x10
    Path(target).write_bytes(bytes(data))


def digests(folder) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(Path(folder).iterdir())}


def zero_runs(rank: int, world_size: int, folder: str) -> dict:
    """On every rank, in one process group: the wide model under singlenode_cpu.py's DDP with plain
    Adam, and under ZeRO; the small model under ZeRO, uninterrupted, then stopped after one epoch and
    resumed, by ZeRO and (from a copy) by --no_zero; then two checkpoints that must be refused."""
    checkpoint, copy = f"{folder}/ckpt.pt", f"{folder}/copy.pt"
    weights = {"ddp": train_script(rank, world_size, "singlenode_cpu", [*SIZES, "--model", "wide"]),
               "zero": train_script(rank, world_size, "zero_optimizer", SIZES),
               "small": train_script(rank, world_size, "zero_optimizer", SMALL)}
    train_script(rank, world_size, "zero_optimizer", [*ONE_EPOCH, "--checkpoint", checkpoint])
    if rank == 0:
        shutil.copy(checkpoint, copy)
    # Test plumbing: rank 0 has written the file (train() waits for it), and copied it, before any
    # rank reads either. Separate launches, as a real resume is, need no barrier.
    dist.barrier()
    weights["resumed"] = train_script(rank, world_size, "zero_optimizer", [*SMALL, "--checkpoint", checkpoint])
    weights["resumed_without_zero"] = train_script(rank, world_size, "zero_optimizer",
                                                   [*SMALL, "--no_zero", "--checkpoint", copy])
    damaged = f"{folder}/damaged.pt"
    if rank == 0:
        flip_a_bit(checkpoint, damaged)
    dist.barrier()  # as above
    before = digests(folder) if rank == 0 else None
    # Rank 0 finds the 2-epoch checkpoint, the other ranks find no file at their path.
    missing = checkpoint if rank == 0 else f"{folder}/absent.pt"
    refusals = {"damaged": refused(rank, world_size, [*SMALL, "--checkpoint", damaged]),
                "missing": refused(rank, world_size, [*SMALL, "--checkpoint", missing])}
    return {"weights": weights, "refusals": refusals, "files_before": before}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[list[dict], list[str], Path]]:
    """{world_size: (every rank's results, every rank's stdout, the folder of the checkpoints)}."""
    results = {}
    for world_size in (2, 3):
        folder = tmp_path_factory.mktemp(f"zero{world_size}")
        results[world_size] = (*spawn(zero_runs, world_size, str(folder), timeout=120), folder)
    return results


def zero_assignment(sizes: list[int], world_size: int) -> list[list[int]]:
    """The parameter indices that each rank updates, by ZeroRedundancyOptimizer's rule in torch 2.13
    (_partition_parameters): the parameters by size, largest first (equal sizes in model order),
    each to the rank that holds the fewest elements so far (the lowest rank among equals)."""
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    held = [0] * world_size
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        rank = held.index(min(held))
        ranks[rank].append(index)
        held[rank] += sizes[index]
    return ranks


@functools.cache
def adam_state_bytes(model_name: str) -> tuple[list[str], list[int], list[int]]:
    """(names, sizes, bytes of Adam's state) of each parameter of the model after one step of plain
    Adam in this process, without torch.distributed."""
    model = build_model(model_name)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 20)).sum().backward()
    optimizer.step()
    names, params = zip(*model.named_parameters(), strict=True)
    state = [sum(t.numel() * t.element_size() for t in optimizer.state[p].values()) for p in params]
    return list(names), [p.numel() for p in params], state


@pytest.mark.parametrize("world_size", [2, 3])
def test_zero_ends_with_the_weights_of_ddp_with_adam(runs, world_size):
    """Bit for bit: each rank runs the same Adam arithmetic on its own parameters as plain Adam runs
    on all of them, from the same all-reduced gradients, and the broadcasts copy the results. The
    reference is singlenode_cpu.py's DDP (which tests/test_train.py holds to a single process)."""
    results, stdouts, _ = runs[world_size]
    ddp = results[0]["weights"]["ddp"]
    for rank in range(world_size):
        for name, tensor in ddp.items():
            assert torch.equal(results[rank]["weights"]["zero"][name], tensor), (rank, name)
    ddp_output, zero_output, *_ = stdouts[0].split("done |")
    assert epoch_losses(zero_output) == epoch_losses(ddp_output)


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_holds_the_state_of_the_parameters_assigned_to_it(runs, world_size):
    _, stdouts, _ = runs[world_size]
    plan = {}  # model: what each rank updates, and the bytes it holds, by rank; then the bytes without ZeRO
    for model in ("wide", "mlp"):
        names, sizes, state = adam_state_bytes(model)
        assignment = zero_assignment(sizes, world_size)
        assert sorted(i for indices in assignment for i in indices) == list(range(len(sizes)))  # each once
        shares = [sum(state[i] for i in indices) for indices in assignment]
        assert sum(shares) == sum(state)
        weights = 4 * sum(sizes)  # fp32 parameters, and as many bytes of gradients: whole on every rank
        plan[model] = ([", ".join(names[i] for i in sorted(indices)) for indices in assignment],
                       [(weights, weights, share) for share in shares], (weights, weights, sum(state)))
        if model == "wide":
            assert sum(sizes) == PARAMETERS
            assert sum(state) == 2 * 4 * PARAMETERS + 4 * 8  # two fp32 moments per parameter, a 4-byte step per tensor
            # Whole parameters: the rank of a 1024 × 1024 weight holds its state, 49% of the whole,
            # so at 3 ranks the largest share is nowhere near a third.
            assert max(shares) > 0.49 * sum(state)
    for rank, stdout in enumerate(stdouts):
        # Printed as each ZeRO optimizer is made: the wide model's, then the small one's (three runs
        # that train, two refused).
        assert UPDATES_LINE.findall(stdout) == [(str(rank), str(world_size), plan[model][0][rank])
                                                for model in ["wide"] + ["mlp"] * 5], stdout
        lines = BYTES_LINE.findall(stdout)
        assert [line[:2] for line in lines] == [(str(rank), str(world_size))] * 5
        # In run order: wide under ZeRO; small under ZeRO, for one epoch, resumed; --no_zero resumed.
        assert [tuple(int(n.replace(",", "")) for n in line[2:]) for line in lines] == [
            plan["wide"][1][rank], *[plan["mlp"][1][rank]] * 3, plan["mlp"][2]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_resumed_run_ends_bit_for_bit_as_an_uninterrupted_one(runs, world_size):
    """Also when plain Adam (--no_zero) resumes from ZeRO's checkpoint: the file holds the whole state."""
    results, stdouts, folder = runs[world_size]
    uninterrupted = results[0]["weights"]["small"]
    for rank in range(world_size):
        for name, tensor in uninterrupted.items():
            assert torch.equal(results[rank]["weights"]["resumed"][name], tensor), (rank, name)
            assert torch.equal(results[rank]["weights"]["resumed_without_zero"][name], tensor), (rank, name)
    _, _, whole, first, resumed, without_zero, *_ = stdouts[0].split("done |")
    assert epoch_losses(first) == {0: epoch_losses(whole)[0]}
    assert epoch_losses(resumed) == epoch_losses(without_zero) == {1: epoch_losses(whole)[1]}
    steps = 96 // world_size // 8  # per epoch and rank; the first of a run is not timed
    assert [int(n) for _, n in STEP_LINE.findall(stdouts[0])] == [2 * steps - 1, 2 * steps - 1, steps - 1,
                                                                  steps - 1, steps - 1]
    saved = torch.load(folder / "ckpt.pt", weights_only=True)
    assert saved["epoch"] == 2 and sorted(saved["optimizer"]["state"]) == list(range(4))


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_damaged_or_missing_checkpoint_is_refused_on_every_rank_before_training(runs, world_size):
    results, stdouts, folder = runs[world_size]
    damaged = folder / "damaged.pt"
    for rank in range(world_size):
        code, stderr = results[rank]["refusals"]["damaged"]
        assert code == 2 and stderr == (f"error: cannot read checkpoint {damaged}: its bytes were damaged after it "
                                        "was written (archive/data/0 fails its CRC check)\n")
        # The file missing on some ranks, as on nodes without shared storage (here: another path).
        code, stderr = results[rank]["refusals"]["missing"]
        path = re.escape(str(folder / ("ckpt.pt" if rank == 0 else "absent.pt")))
        assert code == 2 and re.fullmatch(rf"error: rank 1 finds no checkpoint: a fresh start at {path}, rank 0 "
                                          r"finds epoch 2, sha256 \w{16}: every rank must see the same file .*\n",
                                          stderr), stderr
        assert stdouts[rank].count("bytes held") == 5  # the refused runs took no step
    # Nothing written, nothing removed: no lock, no temporary file, no absent.pt.
    assert digests(folder) == results[0]["files_before"]
    assert sorted(results[0]["files_before"]) == ["ckpt.pt", "copy.pt", "damaged.pt"]


def test_started_without_torchrun_it_says_how_to_launch(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["zero_optimizer.py"])
    with pytest.raises(SystemExit) as stopped:
        zero_optimizer.main()
    assert stopped.value.code == 2
    assert capsys.readouterr().err == ("error: start this script with torchrun, e.g. torchrun --standalone "
                                       "--nproc-per-node 2 zero_optimizer.py\n")
