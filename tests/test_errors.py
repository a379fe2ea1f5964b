"""Bad input: one clear line on stderr, a non-zero exit, within seconds, and nothing lost."""
import pytest
import torch
from launch import python, torchrun

CHECKPOINT = "{tmp}/ckpt.pt"  # holds garbage in every case; it must survive every one unchanged

CASES = {
    # name: (launcher, arguments, exit code, text of the one error line)
    "torchrun-only script started with python": (
        "python", ["singlenode_cpu.py"], 2,
        "error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 8 singlenode_cpu.py"),
    "GPU script started with python": (
        "python", ["singlenode_gpu.py"], 2, "error: start this script with torchrun"),
    "zero batch size": (
        "python", ["start_with_torchrun.py", "--batch_size", "0"], 2,
        "error: argument --batch_size: must be a positive integer, got 0"),
    "negative epochs": (
        "python", ["mp_spawn.py", "--max_epochs", "-3"], 2,
        "error: argument --max_epochs: must be a positive integer, got -3"),
    "learning rate not a number": (
        "python", ["singlenode_cpu.py", "--lr", "fast"], 2, "error: argument --lr: 'fast' is not a number"),
    "more ranks than training samples": (
        "python", ["mp_spawn.py", "--nprocs", "3", "--train_size", "2"], 2,
        "error: 3 ranks but only 2 training samples: every rank needs at least one"),
    "checkpoint that is not a checkpoint": (
        "python", ["start_with_torchrun.py", "--checkpoint", CHECKPOINT], 2,
        f"error: cannot read checkpoint {CHECKPOINT}:"),
    "GPU script without CUDA": (
        "torchrun", ["singlenode_gpu.py"], 1,
        "error: no CUDA GPU is visible (this torch is"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input_fails_with_one_clear_line(name, tmp_path):
    launcher, args, code, message = CASES[name]
    if name == "GPU script without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(b"not a checkpoint")
    args = [arg.format(tmp=tmp_path) for arg in args]
    result = torchrun(2, *args, timeout=60) if launcher == "torchrun" else python(*args, timeout=30)
    assert result.returncode == code, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    assert message.format(tmp=tmp_path) in error_lines[0]
    if launcher == "python":  # torchrun adds its own report of the failed worker
        assert "Traceback" not in result.stderr
    assert checkpoint.read_bytes() == b"not a checkpoint"
    assert list(tmp_path.iterdir()) == [checkpoint]  # nothing half-written beside it
