"""fsdp2.py: fully_shard trains what one process trains, each rank holds its shard of the parameters,
gradients and Adam state, and the checkpoint, the whole state gathered on rank 0, resumes bit for bit,
is read back exactly by another number of ranks, and loads into a plain model."""
import argparse
import math
import os
import re
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from launch import epoch_losses
from reference import train_reference
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdp2
from model import build_model

# 96 samples: 6 steps of 8 per epoch at 2 ranks, 4 at 3. 25 validation samples: 9, 8 and 8 at 3 ranks,
# which in batches of 8 would be 2, 1 and 1 forwards, and a hang: fsdp2.py validates in one batch a rank.
# lr 0.0005, as tests/test_zero_optimizer.py: at 0.001 rounding flips a few ReLUs of the wide model.
SIZES = ["--train_size", "96", "--val_size", "25", "--batch_size", "8", "--lr", "0.0005"]
ARGV = [*SIZES, "--max_epochs", "2"]
BYTES_LINE = re.compile(r"^\[rank (\d)/(\d)\] bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                        r"optimizer state ([\d,]+)$", re.MULTILINE)
# FSDP2 reduce-scatters the average of N ranks' gradients (ReduceOp.AVG); one process takes one mean over
# the global batch: the same to within rounding, which Adam turns into a few percent of lr where a gradient's
# terms nearly cancel (tests/test_zero_optimizer.py). Measured after these 8 steps: 7.4e-6 at 3 ranks.
TOLERANCE = 5e-5


def parse(argv: list[str]) -> argparse.Namespace:
    sys.argv = ["fsdp2.py", *argv]
    return fsdp2.parse_args()


def train(rank: int, world_size: int, argv: list[str]) -> dict:
    """fsdp2.train(), then the whole weights gathered from every rank's shards (a collective)."""
    model = fsdp2.train(parse(argv), rank, world_size)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def fsdp_runs(rank: int, world_size: int, folder: str, written_by_3: str) -> dict:
    """Every run in one process group, in turn: FSDP2 for 2 epochs, then for 1 with a checkpoint, then
    resumed from it for the second. At 3 ranks the checkpoint is copied for the 2-rank runs, which read
    it back (train() with no epoch left to run returns the model as loaded) and train on from it."""
    checkpoint = f"{folder}/ckpt.pt"
    results = {"fsdp2": train(rank, world_size, ARGV)}
    train(rank, world_size, [*SIZES, "--max_epochs", "1", "--checkpoint", checkpoint])
    dist.barrier()  # test plumbing: rank 0 has written the file before any rank looks for it
    results["resumed"] = train(rank, world_size, [*ARGV, "--checkpoint", checkpoint])
    if world_size == 3 and rank == 0:
        shutil.copy(checkpoint, written_by_3)
    if world_size == 2:
        results["read back"] = train(rank, world_size, [*ARGV, "--checkpoint", written_by_3])
        train(rank, world_size, [*SIZES, "--max_epochs", "3", "--checkpoint", written_by_3])
    if rank == 0:  # in one process, without torch.distributed (here, where a worker has one thread: fast)
        results["one process"] = train_reference(parse(ARGV), world_size)
    return results


@pytest.fixture(scope="module")
def written_by_3(tmp_path_factory):
    return tmp_path_factory.mktemp("resharding") / "ckpt.pt"


@pytest.fixture(scope="module")
def three(tmp_path_factory, written_by_3):
    folder = tmp_path_factory.mktemp("three")
    return (*spawn(fsdp_runs, 3, str(folder), str(written_by_3), timeout=180), folder)


@pytest.fixture(scope="module")
def two(tmp_path_factory, three, written_by_3):  # after three, which writes the checkpoint that two reads
    folder = tmp_path_factory.mktemp("two")
    return (*spawn(fsdp_runs, 2, str(folder), str(written_by_3), timeout=180), folder)


@pytest.fixture(params=[2, 3])
def run(request, two, three):
    return {2: two, 3: three}[request.param]


def test_fsdp2_trains_what_one_process_trains(run):
    results, stdouts, _ = run
    expected, losses = results[0]["one process"]
    for name, tensor in expected.items():
        torch.testing.assert_close(results[0]["fsdp2"][name], tensor, rtol=0, atol=TOLERANCE, msg=name)
    printed = epoch_losses(stdouts[0].split("done |")[0])
    assert sorted(printed) == [0, 1]
    for epoch, (train_loss, val_loss) in enumerate(losses):
        assert printed[epoch] == pytest.approx((train_loss, val_loss), abs=2e-6)
    assert all(epoch_losses(stdout) == {} for stdout in stdouts[1:])  # rank 0 alone prints them


def expected_bytes(rank: int, world_size: int) -> int:
    """The bytes of rank `rank`'s shard of the wide model's parameters, worked out here: FSDP2 gives
    rank r the r-th of torch.chunk(param, world_size, dim=0), ceil(rows / world_size) rows each but
    the last (1024 rows at 3 ranks: 342, 342 and 340), and none where the rows run out (the output
    layer's single row is rank 0's alone)."""
    total = 0
    for tensor in build_model("wide").state_dict().values():
        rows = tensor.shape[0]
        per_rank = math.ceil(rows / world_size)
        total += max(0, min(per_rank, rows - rank * per_rank)) * tensor[0].numel() * 4  # fp32
    return total


def test_each_rank_holds_its_shard_of_parameters_gradients_and_adam_state(run):
    _, stdouts, _ = run
    world_size = len(stdouts)
    for rank, stdout in enumerate(stdouts):
        lines = BYTES_LINE.findall(stdout)
        assert len(lines) == (4 if world_size == 2 else 3)  # one per run that trains
        params = expected_bytes(rank, world_size)
        # Adam: exp_avg and exp_avg_sq, each the size of the shard, and a 4-byte step count per parameter.
        expected = (str(rank), str(world_size), f"{params:,}", f"{params:,}", f"{2 * params + 8 * 4:,}")
        assert set(lines) == {expected}
    assert sum(expected_bytes(rank, world_size) for rank in range(world_size)) == 4 * 2_121_729
    if world_size == 3:  # uneven: 342 rows, 342 and the output row, 340
        assert [expected_bytes(rank, 3) for rank in range(3)] == [2_837_228, 2_833_128, 2_816_560]


def test_a_resumed_run_ends_bit_for_bit_as_an_uninterrupted_one(run):
    """Bit for bit, at 3 ranks too: FSDP2 has no buckets to lay out anew, and the whole state that the
    file holds is the state, each rank taking back its pieces of it."""
    results, stdouts, folder = run
    for rank in range(len(stdouts)):
        for name, tensor in results[rank]["fsdp2"].items():
            assert torch.equal(results[rank]["resumed"][name], tensor), (rank, name)
    whole, first, resumed, *_ = stdouts[0].split("done |")
    assert epoch_losses(first) == {0: epoch_losses(whole)[0]}
    assert epoch_losses(resumed) == {1: epoch_losses(whole)[1]}
    assert "resuming from" in resumed and "1 of 2 epochs done" in resumed
    assert sorted(os.listdir(folder)) == ["ckpt.pt"]  # no .tmp left


def test_the_checkpoint_holds_whole_tensors_that_a_plain_model_loads(run):
    results, _, folder = run
    saved = torch.load(folder / "ckpt.pt", weights_only=True)
    model = build_model("wide")
    model.load_state_dict(saved["model"])  # strict: every key, every shape
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, results[0]["resumed"][name]), name
    assert saved["epoch"] == 2
    assert saved["optimizer"]["state"]["net.2.weight"]["exp_avg"].shape == (1024, 1024)  # whole, not a shard


def test_a_checkpoint_of_3_ranks_resumes_on_2(two, three, written_by_3):
    """2 ranks read back the weights that 3 ranks saved, bit for bit, and train on from there."""
    (written, *_), _, _ = three
    (read, *_), stdouts, _ = two
    for name, tensor in written["resumed"].items():
        assert torch.equal(read["read back"][name], tensor), name
    *_, read_back, trained_on = stdouts[0].split("[rank 0/2] 6 steps per epoch")
    assert f"resuming from {written_by_3}: 2 of 2 epochs done" in read_back and not epoch_losses(read_back)
    assert f"resuming from {written_by_3}: 2 of 3 epochs done" in trained_on
    assert sorted(epoch_losses(trained_on)) == [2] and all(math.isfinite(v) for v in epoch_losses(trained_on)[2])
    assert torch.load(written_by_3, weights_only=True)["epoch"] == 3


def run_main(monkeypatch, capsys, argv: list[str], world_size: int | None) -> str:
    """fsdp2.main() in this process, stopped before the rendezvous: the line it stops with."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if world_size:  # as torchrun would start it
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(sys, "argv", ["fsdp2.py", *argv])
    with pytest.raises(SystemExit) as stopped:
        fsdp2.main()
    stderr = capsys.readouterr().err
    if isinstance(stopped.value.code, str):  # raise SystemExit("error: ..."): Python prints it, exits 1
        assert stderr == ""
        return stopped.value.code
    assert stopped.value.code == 2 and "Traceback" not in stderr  # parser.error: the usage, then the line
    return stderr.splitlines()[-1]


@pytest.mark.parametrize("argv, world_size, line", [
    ([], None, "error: start this script with torchrun --standalone --nproc-per-node 2 fsdp2.py"),
    (["--train_size", "2"], 3, "error: 3 ranks: --train_size and --val_size must be at least that"),
    # every forward is a collective: each rank needs a validation sample too
    (["--val_size", "2"], 3, "error: 3 ranks: --train_size and --val_size must be at least that"),
    (["--batch_size", "0"], 2, "fsdp2.py: error: --batch_size must be above 0 and below 1e7, got 0"),
    (["--model", "huge"], 2, "fsdp2.py: error: argument --model: invalid choice: 'huge' (choose from 'mlp', "
                             "'linear', 'wide')"),
], ids=["started with python", "more ranks than training samples", "more ranks than validation samples",
        "batch size 0", "an unknown model"])
def test_a_learners_mistake_is_one_line(monkeypatch, capsys, argv, world_size, line):
    assert run_main(monkeypatch, capsys, argv, world_size) == line
