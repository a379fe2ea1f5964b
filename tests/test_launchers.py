"""Whole-script runs: every launch style trains the same weights, those of one process with the
global batch; singlenode_gpu.py's step, on a GPU and on a CPU."""
import sys

import pytest
import torch
from conftest import ARGV
from launch import check, epoch_losses, python, run, torchrun
from test_train import global_batch, one_process

import singlenode_cpu
import singlenode_gpu
from data import LOSS_FLOOR, make_datasets
from model import build_model

# (launch --use-env sets the variables torchrun sets: passed too, before the suite's budget)
LAUNCH = [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc-per-node", "2"]
LAUNCHES = {
    "singlenode_cpu.py under torchrun": lambda ckpt: torchrun(2, "singlenode_cpu.py", *ARGV, "--checkpoint", ckpt),
    "mp_spawn.py": lambda ckpt: python("mp_spawn.py", "--nprocs", "2", *ARGV, "--checkpoint", ckpt),
    "start_with_torchrun.py under torchrun":
        lambda ckpt: torchrun(2, "start_with_torchrun.py", *ARGV, "--checkpoint", ckpt),
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
def test_every_launcher_prints_the_losses_of_one_process_with_the_global_batch(launched, name):
    _, printed = one_process(global_batch(2))
    losses = epoch_losses(launched[name][1])
    assert sorted(losses) == [0, 1, 2]
    for epoch, pair in epoch_losses(printed).items():
        assert losses[epoch] == pytest.approx(pair, abs=2e-6)
    assert "[rank 0/2] " in launched[name][1] and "[rank 1/2] " in launched[name][1]


def test_start_with_torchrun_without_a_launcher_is_single_process_to_the_bit(tmp_path):
    """A world of one: DDP's average over one rank is the gradient itself, and DistributedSampler's
    permutation is single_process.py's."""
    stdout = check(python("start_with_torchrun.py", *ARGV, "--checkpoint", str(tmp_path / "ckpt.pt")))
    assert "no launcher: one process; for N: torchrun --standalone" in stdout
    expected, _ = one_process(ARGV)
    weights = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


CLIP = 0.05  # small enough to clip every step of this run


def test_the_gpu_step_unscales_before_it_clips():
    """singlenode_gpu.py's step, run on a CPU with a GradScaler that multiplies the loss by 1024: the
    same steps, bit for bit, as with no scaler (a power of 2 scales exactly), because the gradients are
    unscaled before their norm is clipped. Clipped while still scaled, they would be cut 1024 times
    too short, and the test goes red."""
    from torch.utils.data import DataLoader

    train_set, _ = make_datasets(301, 50)
    weights = []
    for scale in (1024.0, None):
        torch.manual_seed(0)
        model = build_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
        singlenode_gpu.train_one_epoch(model, DataLoader(train_set, batch_size=7), optimizer, torch.device("cpu"),
                                       torch.float32, scaler, CLIP)
        assert scaler.get_scale() == (scale or 1.0)  # no step skipped, the scale never changed
        weights.append(model.state_dict())
    for key, tensor in weights[1].items():
        assert torch.equal(weights[0][key], tensor), key


def test_the_gpu_lesson_trains_as_the_cpu_one_given_the_same_device():
    """Everything in singlenode_gpu.py's epoch but the device and the scaler is singlenode_cpu.py's: on a
    CPU, in fp32, with the scaler off, the same weights to the bit."""
    from torch.utils.data import DataLoader

    train_set, _ = make_datasets(301, 50)
    weights = []
    for lesson in (singlenode_gpu, singlenode_cpu):
        torch.manual_seed(0)
        model = build_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loader = DataLoader(train_set, batch_size=7)
        if lesson is singlenode_gpu:
            lesson.train_one_epoch(model, loader, optimizer, torch.device("cpu"), torch.float32,
                                   torch.amp.GradScaler("cpu", enabled=False), None)
        else:
            lesson.train_one_epoch(model, loader, optimizer)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][key], tensor) for key, tensor in weights[1].items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_singlenode_gpu_trains_on_one_gpu(precision):
    stdout = check(torchrun(1, "singlenode_gpu.py", "--max_epochs", "5", "--precision", precision))
    losses = list(epoch_losses(stdout).values())
    # One rank takes 128 steps an epoch: the validation loss is near the floor after the first.
    assert len(losses) == 5 and losses[-1][0] < losses[0][0] and losses[-1][1] < 1.1 * LOSS_FLOOR


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_singlenode_gpu_resumes_as_if_never_stopped(tmp_path, precision):
    """On a GPU too, 2 epochs and a resume to 4 end where 4 straight epochs end. In fp16 the checkpoint
    also carries the GradScaler's scale, without which the resumed steps would differ."""
    straight, resumed = tmp_path / "straight.pt", tmp_path / "resumed.pt"
    options = ["--precision", precision]
    full = epoch_losses(check(torchrun(1, "singlenode_gpu.py", *options, "--max_epochs", "4",
                                       "--checkpoint", str(straight))))
    check(torchrun(1, "singlenode_gpu.py", *options, "--max_epochs", "2", "--checkpoint", str(resumed)))
    rest = epoch_losses(check(torchrun(1, "singlenode_gpu.py", *options, "--max_epochs", "4",
                                       "--checkpoint", str(resumed))))
    assert sorted(rest) == [2, 3] and all(rest[epoch] == full[epoch] for epoch in (2, 3))
    a, b = (torch.load(path, weights_only=True, map_location="cpu") for path in (straight, resumed))
    assert all(torch.equal(a["model"][key], b["model"][key]) for key in a["model"])
