"""Whole-script runs: every launch style trains the same model to the same bits."""
import sys

import pytest
import torch
from conftest import ARGV
from launch import check, epoch_losses, python, run, torchrun
from reference import train_reference
from test_train import parse

from data import LOSS_FLOOR

LAUNCH = [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc-per-node", "2"]
LAUNCHES = {
    "singlenode_cpu.py under torchrun": lambda ckpt: torchrun(2, "singlenode_cpu.py", *ARGV, "--checkpoint", ckpt),
    "mp_spawn.py": lambda ckpt: python("mp_spawn.py", "--nprocs", "2", *ARGV, "--checkpoint", ckpt),
    "start_with_torchrun.py under torchrun":
        lambda ckpt: torchrun(2, "start_with_torchrun.py", *ARGV, "--checkpoint", ckpt),
    "start_with_torchrun.py under launch --use-env":
        lambda ckpt: run([*LAUNCH, "--use-env", "start_with_torchrun.py", *ARGV, "--checkpoint", ckpt]),
    "start_with_torchrun.py under launch, --local-rank passed":
        lambda ckpt: run([*LAUNCH, "start_with_torchrun.py", *ARGV, "--checkpoint", ckpt]),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """{launch: (final weights from its checkpoint, stdout)}."""
    results = {}
    for name, launch in LAUNCHES.items():
        checkpoint = str(tmp_path_factory.mktemp("ckpt") / "ckpt.pt")
        stdout = check(launch(checkpoint))
        results[name] = (torch.load(checkpoint, weights_only=True)["model"], stdout)
    return results


def test_every_launcher_gives_bitwise_identical_weights(launched):
    (first_name, (first, _)), *others = launched.items()
    for name, (weights, _) in others:
        for key, tensor in first.items():
            assert torch.equal(weights[key], tensor), f"{name} differs from {first_name} in {key}"


@pytest.mark.parametrize("name", LAUNCHES)
def test_every_launcher_prints_the_reference_losses(launched, name):
    _, expected = train_reference(parse(ARGV), world_size=2)
    printed = epoch_losses(launched[name][1])
    assert sorted(printed) == [0, 1, 2]
    for epoch, losses in enumerate(expected):
        assert printed[epoch] == pytest.approx(losses, abs=2e-6)
    assert "[rank 0/2] device cpu" in launched[name][1] and "[rank 1/2] device cpu" in launched[name][1]


def test_start_with_torchrun_without_a_launcher_trains_as_one_process():
    stdout = check(python("start_with_torchrun.py", *ARGV))
    assert "no launcher: training as a single process" in stdout
    _, expected = train_reference(parse(ARGV), world_size=1)
    printed = epoch_losses(stdout)
    assert [printed[epoch] for epoch in range(3)] == [pytest.approx(losses, abs=2e-6) for losses in expected]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_singlenode_gpu_trains_on_one_gpu(precision):
    stdout = check(torchrun(1, "singlenode_gpu.py", "--max_epochs", "5", "--precision", precision))
    losses = list(epoch_losses(stdout).values())
    # One rank takes 128 steps an epoch: the validation loss is near the floor after the first.
    assert len(losses) == 5 and losses[-1][0] < losses[0][0] and losses[-1][1] < 1.1 * LOSS_FLOOR
    assert "device cuda:0" in stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_singlenode_gpu_resumes_as_if_never_stopped(tmp_path, precision):
    """On a GPU too, 2 epochs and a resume to 4 end where 4 straight epochs end. In fp16 the checkpoint
    also carries the GradScaler's scale, without which the resumed steps would differ."""
    straight, resumed = tmp_path / "straight.pt", tmp_path / "resumed.pt"
    precision_args = ["--precision", precision]
    full = epoch_losses(check(torchrun(1, "singlenode_gpu.py", *precision_args, "--max_epochs", "4",
                                       "--checkpoint", str(straight))))
    check(torchrun(1, "singlenode_gpu.py", *precision_args, "--max_epochs", "2", "--checkpoint", str(resumed)))
    rest = epoch_losses(check(torchrun(1, "singlenode_gpu.py", *precision_args, "--max_epochs", "4",
                                       "--checkpoint", str(resumed))))
    assert sorted(rest) == [2, 3] and all(rest[epoch] == full[epoch] for epoch in (2, 3))
    a, b = (torch.load(path, weights_only=True, map_location="cpu") for path in (straight, resumed))
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
    assert ("scaler" in a) == (precision == "fp16")
