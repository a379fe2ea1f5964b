"""Bad input: one clear line on stderr, a non-zero exit, within seconds, and nothing lost."""
import contextlib
import ctypes
import errno
import importlib
import io
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import pytest
import torch
from launch import REPO, python, run, torchrun

import common
from model import build_model

SMALL = ["--max_epochs", "1", "--train_size", "64", "--val_size", "16"]
LONGER = ["--max_epochs", "2", "--train_size", "64", "--val_size", "16"]


class RunsCode:
    """Unpickling this opens (creates) a file: proof that loading it ran code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> dict:
    """A real checkpoint, written by a one-epoch single-process run."""
    path = tmp_path_factory.mktemp("good") / "ckpt.pt"
    result = python("start_with_torchrun.py", *SMALL, "--checkpoint", str(path))
    assert result.returncode == 0, result.stderr
    return torch.load(path, weights_only=True)


def run_main(script: str, *argv: str) -> tuple[int, str, str]:
    """Run script.main() in this process, as `python script.py argv` would, and return (exit code,
    stdout, stderr). Much cheaper than a new process; the cases that need one start one."""
    module = importlib.import_module(script.removesuffix(".py"))
    saved_argv, sys.argv = sys.argv, [script, *argv]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved_argv
        # main() set these for a process of its own; this one is pytest's.
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, 0)
    return code, out.getvalue(), err.getvalue()


def write(path, state) -> None:
    torch.save(state, path)


def truncated(path, good) -> None:
    write(path, good)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def damaged(path, good) -> None:
    """A good checkpoint with one bit flipped inside a tensor's bytes, as a bad disk or a bad copy
    would leave it. torch.load reads it without complaint, into a different weight."""
    write(path, good)
    data = bytearray(path.read_bytes())
    weight = good["model"]["net.0.weight"]
    at = bytes(data).index(weight.numpy().tobytes()) + 5
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    loaded = torch.load(path, weights_only=True)["model"]["net.0.weight"]
    assert not torch.equal(loaded, weight)


def edited(**config):
    def prepare(path, good):
        write(path, {**good, "config": {**good["config"], **config}})
    return prepare


CHECKPOINTS = {
    # name: (how to make ckpt.pt, extra arguments, text of the one error line)
    "not a checkpoint at all": (
        lambda path, good: path.write_bytes(b"not a checkpoint"), [],
        "error: cannot read checkpoint {path}: not a file written by torch.save (truncated, or another format)"),
    "truncated": (
        truncated, [],
        "error: cannot read checkpoint {path}: not a file written by torch.save (truncated, or another format)"),
    "another program's file": (
        lambda path, good: write(path, {"weights": torch.ones(3)}), [],
        "error: {path} is not a checkpoint of these scripts: it lacks config, epoch, model, optimizer"),
    "another model's weights": (
        lambda path, good: write(path, {**good, "model": build_model("linear").state_dict()}), [],
        "error: {path} holds weights of another model: its parameters do not match --model mlp"),
    "written with another --model": (
        edited(model="linear"), [],
        "error: {path} was written with --model linear, this run has --model mlp: use the same value, "
        "or another --checkpoint path to start afresh"),
    "written with another --batch_size": (
        lambda path, good: write(path, good), ["--batch_size", "16"],
        "error: {path} was written with --batch_size 32, this run has --batch_size 16"),
    "damaged after it was written": (
        damaged, [],
        "error: cannot read checkpoint {path}: its bytes were damaged after it was written (ckpt/data/0 fails "
        "its CRC check)"),
    "crafted to run code when unpickled": (
        lambda path, good: write(path, {**good, "epoch": RunsCode(str(path.parent / "ran-code"))}), [],
        "error: refusing to load {path}: it holds Python objects other than tensors and plain types, "
        "and unpickling them could run code"),
}


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_an_unusable_checkpoint_stops_the_run_and_is_left_as_it_was(name, good_checkpoint, tmp_path):
    prepare, extra, message = CHECKPOINTS[name]
    path = tmp_path / "ckpt.pt"
    prepare(path, good_checkpoint)
    before = path.read_bytes()
    code, _, stderr = run_main("start_with_torchrun.py", *SMALL, *extra, "--checkpoint", str(path))
    assert code == 2
    assert stderr.strip().startswith(message.format(path=path)) and len(stderr.strip().splitlines()) == 1
    assert path.read_bytes() == before  # not overwritten, not deleted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # and nothing ran or was written


@pytest.mark.parametrize("train_size, step", [
    (64, "step 2 of 2"),  # the loss of the second step overflows
    (32, "step 1 of 1"),  # the one step's loss is finite, the weights it leaves are not usable
])
def test_a_loss_or_weights_that_are_not_finite_stop_the_run_before_they_are_saved(train_size, step, tmp_path):
    """--lr 1e30: the first step's loss is finite, the weights after it are about 1e30. The run stops
    at the end of the epoch, says by which step, and saves nothing."""
    path = tmp_path / "ckpt.pt"
    code, stdout, stderr = run_main("start_with_torchrun.py", *SMALL, "--train_size", str(train_size),
                                    "--lr", "1e30", "--checkpoint", str(path))
    assert code == 1
    assert stderr == (f"error: the loss or the weights stopped being finite in epoch 0, by {step}: stopped before "
                      "saving (a learning rate too high, or weights that were not finite in the checkpoint)\n")
    assert "epoch 0 |" not in stdout
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no lock left


def test_restarts_on_several_nodes_on_torchruns_shared_store_are_refused(monkeypatch, capsys):
    """Each node's agent counts its own restarts, so on several nodes the attempts cannot be kept
    apart on the shared store: refused at start, before any rendezvous, with the fix named."""
    torchrun_env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}
    for name, value in torchrun_env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        common.torchrun_store(timedelta(seconds=5))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: torchrun --max-restarts on several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
        "environment on every node: without it a restart can fail to reconnect (pytorch/pytorch#135712)\n")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the variable is set: env:// will do
    assert common.torchrun_store(timedelta(seconds=5)) is None


@pytest.mark.parametrize("found_by_rank, message", [
    (["epoch 2, sha256 aa", "no checkpoint: a fresh start", "epoch 2, sha256 aa"],
     "error: rank 1 finds no checkpoint: a fresh start at ckpt.pt, rank 0 finds epoch 2, sha256 aa: every rank "
     "must see the same file (on several nodes, put it on storage that all of them share)\n"),
    (["epoch 2, sha256 aa", "epoch 2, sha256 aa", "error: cannot read checkpoint ckpt.pt: truncated"],
     "error: cannot read checkpoint ckpt.pt: truncated (seen by rank 2)\n"),
])
def test_ranks_that_find_different_checkpoints_stop_with_the_same_line(found_by_rank, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        common.Checkpoints("ckpt.pt", rank=1).require_agreement(found_by_rank)
    assert exit_info.value.code == 2 and capsys.readouterr().err == message


def test_a_checkpoint_from_another_world_size_resumes_with_a_warning(good_checkpoint, tmp_path):
    path = tmp_path / "ckpt.pt"
    edited(world_size=2)(path, good_checkpoint)
    code, stdout, stderr = run_main("start_with_torchrun.py", *LONGER, "--checkpoint", str(path))
    assert code == 0, stderr
    assert (f"warning: {path} was written by 2 ranks and this run has 1: the global batch changes "
            "from 64 to 32 samples") in stdout
    assert "resuming from" in stdout and "epoch 1 |" in stdout


def test_a_checkpoint_from_before_clip_grad_norm_resumes_as_one_without_clipping(good_checkpoint, tmp_path):
    path = tmp_path / "ckpt.pt"
    old = {**good_checkpoint, "config": {k: v for k, v in good_checkpoint["config"].items() if k != "clip_grad_norm"}}
    torch.save(old, path)
    code, _, stderr = run_main("start_with_torchrun.py", *LONGER, "--clip_grad_norm", "1", "--checkpoint", str(path))
    assert code == 2 and "was written with --clip_grad_norm off, this run has --clip_grad_norm 1.0" in stderr
    code, stdout, stderr = run_main("start_with_torchrun.py", *LONGER, "--checkpoint", str(path))
    assert code == 0, stderr
    assert "resuming from" in stdout and "epoch 1 |" in stdout


def test_a_leftover_temporary_file_is_removed_and_the_checkpoint_used(good_checkpoint, tmp_path):
    path = tmp_path / "ckpt.pt"
    write(path, good_checkpoint)
    (tmp_path / "ckpt.pt.tmp").write_bytes(b"half a checkpo")
    code, stdout, stderr = run_main("start_with_torchrun.py", *LONGER, "--checkpoint", str(path))
    assert code == 0, stderr
    assert f"removed {path}.tmp, left by a checkpoint write that did not finish" in stdout
    assert "resuming from" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


# Whole processes, where the launch itself is what is tested.
LAUNCHED = {
    # name: (command, exit code, text of the one error line)
    "torchrun-only script started with python": (
        lambda: python("singlenode_cpu.py"), 2,
        "error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 8 singlenode_cpu.py"),
    "the old launcher without --use-env": (
        lambda: run([sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc-per-node", "1",
                     "singlenode_cpu.py"]), 1,
        "error: --local-rank is what python -m torch.distributed.launch passes without --use-env; "
        "start this script with torchrun, or add --use-env"),
    "GPU script without CUDA": (
        lambda: torchrun(2, "singlenode_gpu.py"), 1, "error: no CUDA GPU is visible (this torch is"),
}


@pytest.mark.parametrize("name", LAUNCHED)
def test_a_wrong_launch_fails_with_one_clear_line(name):
    command, code, message = LAUNCHED[name]
    if name == "GPU script without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = command()
    assert result.returncode == code, result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, result.stderr
    assert message in error_lines[0]
    if result.args[1] == "singlenode_cpu.py":
        assert "Traceback" not in result.stderr  # (torchrun adds its own report of a failed worker)


# In this process: the same code paths, without paying for a new one each time.
IN_PROCESS = {
    # name: (script and arguments, text of the one error line)
    "GPU script started with python": (["singlenode_gpu.py"], "error: start this script with torchrun"),
    "zero batch size": (
        ["start_with_torchrun.py", "--batch_size", "0"],
        "error: argument --batch_size: must be a positive integer, got 0"),
    "negative epochs": (
        ["mp_spawn.py", "--max_epochs", "-3"], "error: argument --max_epochs: must be a positive integer, got -3"),
    "learning rate not a number": (
        ["singlenode_cpu.py", "--lr", "fast"], "error: argument --lr: 'fast' is not a number"),
    "more ranks than training samples": (
        ["mp_spawn.py", "--nprocs", "3", "--train_size", "2"],
        "error: 3 ranks but only 2 training samples: every rank needs at least one"),
    "a lock file that is a folder": (
        ["start_with_torchrun.py", *SMALL, "--checkpoint", "{tmp}/ckpt.pt"],
        "error: cannot lock checkpoint {tmp}/ckpt.pt: {tmp}/ckpt.pt.lock: Is a directory"),
    "a temporary file that is a folder": (
        ["start_with_torchrun.py", *SMALL, "--checkpoint", "{tmp}/ckpt.pt"],
        "error: {tmp}/ckpt.pt.tmp is a folder, not what a checkpoint write leaves: move it away"),
    "checkpoint folder that does not exist": (
        ["start_with_torchrun.py", *SMALL, "--checkpoint", "{tmp}/missing/ckpt.pt"],
        "error: cannot write checkpoint {tmp}/missing/ckpt.pt: {tmp}/missing is not a directory"),
    "the old launcher's --local-rank": (
        ["singlenode_cpu.py", "--local-rank=0"],
        "error: --local-rank is what python -m torch.distributed.launch passes without --use-env"),
    # The lessons past the basics: each started with python, and each of their own options out of range.
    **{f"{script} started with python": ([script], "error: start this script with torchrun, e.g. torchrun "
                                         f"--standalone --nproc-per-node 2 {script}")
       for script in ["grad_accumulation.py", "uneven_inputs.py", "unused_parameters.py", "sync_batchnorm.py",
                      "model_parallel.py", "debug_hang.py"]},
    "no micro-batches": (["grad_accumulation.py", "--accum_steps", "0"],
                         "error: argument --accum_steps: must be from 1 to 1e+06, got 0"),
    "an unknown fix": (["unused_parameters.py", "--fix", "ignore"], "error: argument --fix: invalid choice: 'ignore'"),
    "a negative branch period": (["unused_parameters.py", "--branch_every", "-1"],
                                 "error: argument --branch_every: must be from 0 to 1e+06, got -1"),
    "an unknown BatchNorm": (["sync_batchnorm.py", "--bn", "global"], "error: argument --bn: invalid choice: 'global'"),
    "BatchNorm after a single layer": (["sync_batchnorm.py", "--model", "linear"],
                                       "error: --model linear has no hidden layer for BatchNorm to normalise"),
    "a model that cannot be split": (["model_parallel.py", "--model", "linear"],
                                     "error: --model linear is a single layer: there is nothing to split"),
    "a device that is not offered": (["model_parallel.py", "--device", "mps"],
                                     "error: argument --device: invalid choice: 'mps'"),
    "a negative stuck rank": (["debug_hang.py", "--stuck_rank", "-1"],
                              "error: argument --stuck_rank: must be from 0 to 1e+06, got -1"),
    "fp16 on CPUs": (["singlenode_cpu.py", "--precision", "fp16"],
                     "error: argument --precision: invalid choice: 'fp16'"),
    "a clip of zero": (["mp_spawn.py", "--clip_grad_norm", "0"],
                       "error: argument --clip_grad_norm: must be a positive finite number, got 0"),
}


@pytest.mark.parametrize("name", IN_PROCESS)
def test_bad_input_fails_with_one_clear_line(name, tmp_path, monkeypatch):
    argv, message = IN_PROCESS[name]
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    made = {"a lock file that is a folder": "ckpt.pt.lock", "a temporary file that is a folder": "ckpt.pt.tmp"}
    if name in made:
        (tmp_path / made[name]).mkdir()
    code, _, stderr = run_main(*[arg.format(tmp=tmp_path) for arg in argv])
    assert code == 2
    error_lines = [line for line in stderr.splitlines() if "error:" in line]  # argparse adds its usage
    assert len(error_lines) == 1 and message.format(tmp=tmp_path) in error_lines[0]
    left = {p.name for p in tmp_path.iterdir()}
    assert left <= {"ckpt.pt.lock", made.get(name)}  # nothing half-written
    assert name not in made or made[name] in left  # nor removed


def test_a_port_in_use_is_named_with_how_to_pick_another():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, stderr = run_main("mp_spawn.py", "--nprocs", "2", "--port", str(port))
    assert code == 2
    assert stderr.strip() == (f"error: port {port} on 127.0.0.1 is already in use: "
                                     "pass --port 0 to let the system pick a free one, or name another")


def test_more_processes_than_gpus_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        common.check_gpus(2, "--nproc-per-node", "singlenode_cpu.py")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: 2 processes on this node but 1 GPUs: use --nproc-per-node 1 or fewer, one per GPU\n")


def test_no_script_loads_a_checkpoint_without_weights_only():
    for path in REPO.glob("*.py"):
        for line in path.read_text().splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{path.name}: {line.strip()}"


def test_mp_spawn_rendezvous_listens_on_loopback_only():
    with common.listen_on_loopback(0) as sock:
        assert sock.getsockname()[0] == "127.0.0.1"
        with pytest.raises(SystemExit):
            common.listen_on_loopback(sock.getsockname()[1])  # taken: one line, exit 2 (shown above)


def test_a_failed_checkpoint_write_stops_with_one_line_and_keeps_the_previous_file(good_checkpoint, tmp_path,
                                                                                   monkeypatch, capsys):
    """A full disk (ENOSPC at fsync) and then the folder gone: each write fails, its .tmp is
    removed, the file from before stays whole, and the run stops with one line."""
    path = tmp_path / "ckpt.pt"
    write(path, good_checkpoint)
    before = path.read_bytes()
    checkpoints = common.Checkpoints(str(path), rank=0)

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    checkpoints.save({**good_checkpoint, "epoch": 2}, "epoch 1 | ...")
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.close()
    assert exit_info.value.code == 1
    assert capsys.readouterr() == ("", f"error: could not save checkpoint {path}: No space left on device\n")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]

    missing = tmp_path / "gone" / "ckpt.pt"
    checkpoints = common.Checkpoints(str(missing), rank=0)
    checkpoints.save(good_checkpoint, "epoch 0 | ...")
    with pytest.raises(SystemExit):
        checkpoints.close()
    assert capsys.readouterr().err == f"error: could not save checkpoint {missing}: No such file or directory\n"


# Issue 8: every bad input, by class, one line per rank and nothing lost. Each table runs in this
# process; each row names the script and its arguments, and the one line it must print.
# What torchrun would set for a world of one; every row stops before the rendezvous, so port 1 is
# never dialled.
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}

OPTIONS = {
    "--timeout inf": (["singlenode_cpu.py", "--timeout", "inf"], "argument --timeout: must be from 1 to 1e+07, got"),
    "--timeout 1e300": (["start_with_torchrun.py", "--timeout", "1e300"], "must be from 1 to 1e+07, got 1e300"),
    "--timeout 1e-9": (["mp_spawn.py", "--timeout", "1e-9"], "argument --timeout: must be from 1 to 1e+07, got 1e-9"),
    "comm script --timeout inf": (["comm_collectives.py", "--timeout", "inf"], "must be from 1 to 1e+07, got inf"),
    "--seed -1": (["singlenode_cpu.py", "--seed", "-1"], "argument --seed: must be from 0 to 9.22337e+18, got -1"),
    "--seed 2**64": (["singlenode_cpu.py", "--seed", str(2**64)], f"must be from 0 to 9.22337e+18, got {2**64}"),
    "--seed 1.5": (["singlenode_cpu.py", "--seed", "1.5"], "argument --seed: '1.5' is not an integer"),
    "--lr inf": (["start_with_torchrun.py", "--lr", "inf"], "argument --lr: must be a positive finite number, got inf"),
    "--port 70000": (["mp_spawn.py", "--port", "70000"], "argument --port: must be from 0 to 65535, got 70000"),
    "--port -1": (["mp_spawn.py", "--port", "-1"], "argument --port: must be from 0 to 65535, got -1"),
    "data too large for memory": (
        ["start_with_torchrun.py", "--train_size", str(10**12)],
        "--train_size 1000000000000 and --val_size 1024 on 1 process need 168,000,000,172,032 bytes of memory "
        "and this machine has "),
    "more micro-batches than an epoch holds": (
        ["grad_accumulation.py", "--accum_steps", "100", "--train_size", "301", "--batch_size", "7"],
        "--accum_steps 100 is more than the 43 micro-batches of --batch_size 7 that a rank holds in an epoch"),
    "a BatchNorm batch of one sample": (
        ["sync_batchnorm.py", "--train_size", "65", "--batch_size", "32"],
        "--batch_size 32 and --train_size 65 on 1 rank leave a batch of 1 sample, whose per-rank BatchNorm "
        "statistics do not exist"),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_every_numeric_option_has_a_range_and_says_so_in_one_line(name, monkeypatch):
    argv, message = OPTIONS[name]
    for variable, value in TORCHRUN_ENV.items():  # as torchrun would start the script
        monkeypatch.setenv(variable, value)
    code, _, stderr = run_main(*argv)
    assert code == 2
    errors = [line for line in stderr.splitlines() if "error:" in line]  # argparse adds its usage
    assert len(errors) == 1 and message in errors[0], stderr
    assert "Traceback" not in stderr


def test_a_port_that_may_not_be_bound_is_one_line(monkeypatch, capsys):
    def refuse(self, address):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(SystemExit) as exit_info:
        common.listen_on_loopback(80)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: cannot listen on port 80 of 127.0.0.1: Permission denied (ports "
                                       "below 1024 need root): pass --port 0 to let the system pick a free one\n")


def test_far_more_processes_than_cores_is_a_warning_in_one_line():
    code, stdout, stderr = run_main("mp_spawn.py", "--nprocs", "100", "--train_size", "50")
    assert stdout == (f"warning: 100 processes on {os.cpu_count()} CPU cores: each gets a fraction of a core, and "
                      "starting them alone takes a while\n")
    assert code == 2 and "100 ranks but only 50 training samples" in stderr  # and nothing was started


def full_disk(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


PATHS = {
    # name: (how to make the place, the --checkpoint argument, the one line)
    "empty": (None, "", "error: argument --checkpoint: is empty: name a file, or leave --checkpoint out"),
    "ends in /": (None, "{tmp}/ckpt/", "error: argument --checkpoint: '{tmp}/ckpt/' ends in /, so it names a folder"),
    "a directory": (lambda path: path.mkdir(), "{tmp}/ckpt.pt",
                    "error: checkpoint {tmp}/ckpt.pt is a directory: name a file"),
    "a FIFO": (lambda path: os.mkfifo(path), "{tmp}/ckpt.pt",
               "error: checkpoint {tmp}/ckpt.pt is not a regular file (a FIFO, a socket or a device): name a file"),
    "a full disk": (None, "{tmp}/ckpt.pt", "error: cannot write checkpoint {tmp}/ckpt.pt: No space left on device"),
}


@pytest.mark.parametrize("name", PATHS)
def test_a_checkpoint_path_that_cannot_work_is_refused_at_start(name, tmp_path, monkeypatch):
    make, argument, message = PATHS[name]
    if make:
        make(tmp_path / "ckpt.pt")
    if name == "a full disk":
        monkeypatch.setattr(os, "fsync", full_disk)  # the trial write at start meets it
    before = sorted(p.name for p in tmp_path.iterdir())
    code, stdout, stderr = run_main("start_with_torchrun.py", *SMALL, "--checkpoint", argument.format(tmp=tmp_path))
    assert code == 2
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message.format(tmp=tmp_path) in errors[0], stderr
    assert "epoch 0 |" not in stdout  # refused before any training
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_symlinked_checkpoint_is_written_through_to_its_target(tmp_path):
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "ckpt.pt", tmp_path / "ckpt.pt"
    link.symlink_to(target)
    for epochs in ("1", "2"):
        code, stdout, stderr = run_main("start_with_torchrun.py", *SMALL, "--max_epochs", epochs,
                                        "--checkpoint", str(link))
        assert code == 0, stderr
    assert "resuming from" in stdout
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert torch.load(target, weights_only=True)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt.pt", "ckpt.pt", "real"]


def field(edit):
    """Make ckpt.pt from the good checkpoint with `edit` applied to a copy of it."""
    def prepare(path, good):
        groups = [dict(group) for group in good["optimizer"]["param_groups"]]
        state = {**good, "config": dict(good["config"]), "optimizer": {**good["optimizer"], "param_groups": groups}}
        edit(state)
        write(path, state)
    return prepare


def legacy(path, good) -> None:
    torch.save(good, path, _use_new_zipfile_serialization=False)


FIELDS = {
    "epoch negative": (field(lambda s: s.update(epoch=-5)), "its epoch is -5, where a count of epochs done"),
    "epoch a string": (field(lambda s: s.update(epoch="3")), "its epoch is '3', where a count of epochs done"),
    "epoch a bool": (field(lambda s: s.update(epoch=True)), "its epoch is True, where a count of epochs done"),
    "config without seed": (field(lambda s: s["config"].pop("seed")), "its config lacks seed"),
    "config not a dict": (field(lambda s: s.update(config=[1, 2])),
                          "its config lacks batch_size, clip_grad_norm, lr, model"),
    "world_size zero": (field(lambda s: s["config"].update(world_size=0)), "its config has world_size 0, where a"),
    "model of numbers": (field(lambda s: s.update(model={"net.0.weight": 1.0})), "its model is not a state_dict"),
    "optimizer not a dict": (field(lambda s: s.update(optimizer=[])), "its optimizer is not an optimizer's state_dict"),
    "optimizer for other parameters": (
        field(lambda s: s["optimizer"]["param_groups"][0].update(params=[0, 1])),
        "its optimizer holds state for other parameters than this model's"),
    "optimizer at another learning rate": (
        field(lambda s: s["optimizer"]["param_groups"][0].update(lr=0.1)),
        "its optimizer has learning rate 0.1, and the run --lr 0.005"),
    "another precision": (
        field(lambda s: s["config"].update(precision="fp16")),
        "was written with --precision fp16, this run has --precision fp32"),
    "the format before torch 1.6": (
        legacy, "torch.save wrote it in the format of torch before 1.6, which has no checksums"),
}


@pytest.mark.parametrize("name", FIELDS)
def test_every_checkpoint_field_is_checked_before_anything_is_loaded(name, good_checkpoint, tmp_path):
    prepare, message = FIELDS[name]
    path = tmp_path / "ckpt.pt"
    prepare(path, good_checkpoint)
    before = path.read_bytes()
    code, stdout, stderr = run_main("start_with_torchrun.py", *SMALL, "--checkpoint", str(path))
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and message in stderr, stderr
    assert "resuming" not in stdout and path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


ENVIRONMENTS = {
    # name: (variables over torchrun's, variables removed, the one line)
    "LOCAL_RANK without the rest": ({}, ["RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"],
                                    "LOCAL_RANK set but not RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                                    "MASTER_PORT: start this script with torchrun"),
    "no LOCAL_WORLD_SIZE": ({}, ["LOCAL_WORLD_SIZE"], "but not LOCAL_WORLD_SIZE: start this script with torchrun"),
    "RANK without LOCAL_RANK": ({}, ["LOCAL_RANK"], "but not LOCAL_RANK: start this script with torchrun"),
    "no MASTER_ADDR": ({}, ["MASTER_ADDR"], "but not MASTER_ADDR: start this script with torchrun"),
    "WORLD_SIZE=abc": ({"WORLD_SIZE": "abc"}, [], "WORLD_SIZE='abc' is not an integer: start this script with"),
    "MASTER_PORT=abc": ({"MASTER_PORT": "abc"}, [], "MASTER_PORT='abc' is not an integer: start this script with"),
    "RANK beyond WORLD_SIZE": ({"RANK": "4", "WORLD_SIZE": "2"}, [],
                               "RANK=4, LOCAL_RANK=0, WORLD_SIZE=2 and LOCAL_WORLD_SIZE=1 do not fit together"),
}


@pytest.mark.parametrize("script", ["singlenode_cpu.py", "start_with_torchrun.py", "comm_intro.py"])
@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_a_partial_or_malformed_launcher_environment_is_one_line(name, script, monkeypatch):
    extra, removed, message = ENVIRONMENTS[name]
    for variable, value in {**TORCHRUN_ENV, **extra}.items():
        monkeypatch.setenv(variable, value)
    for variable in removed:
        monkeypatch.delenv(variable)
    code, _, stderr = run_main(script, *SMALL if script != "comm_intro.py" else [])
    assert code == 2
    assert stderr.count("\n") == 1 and message in stderr, stderr


def test_die_writes_its_line_in_one_write(monkeypatch):
    """Two ranks' lines never run together: each is one write of the whole line."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": writes.append, "flush": lambda self: None})())
    with pytest.raises(SystemExit):
        common.die("a line")
    assert writes == ["error: a line\n"]


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    important = tmp_path / "important.txt"
    important.write_text("keep me")
    (tmp_path / "ckpt.pt.lock").symlink_to(important)
    code, _, stderr = run_main("start_with_torchrun.py", *SMALL, "--checkpoint", str(tmp_path / "ckpt.pt"))
    assert code == 2
    assert stderr == f"error: cannot lock checkpoint {tmp_path}/ckpt.pt: {tmp_path}/ckpt.pt.lock: " \
                     "Too many levels of symbolic links\n"
    assert important.read_text() == "keep me" and (tmp_path / "ckpt.pt.lock").is_symlink()


def test_no_flipped_bit_anywhere_in_a_checkpoint_loads_or_escapes_as_a_traceback(good_checkpoint, tmp_path):
    """One bit flipped at a few hundred places spread over the file, the zip directory included:
    each is refused as an Unusable with one line. torch.load alone loads many of them."""
    path = tmp_path / "ckpt.pt"
    write(path, good_checkpoint)
    data = path.read_bytes()
    model = build_model("mlp")
    checkpoints = common.Checkpoints(str(path), rank=0)
    for at in range(0, len(data), max(1, len(data) // 300)):
        damaged = bytearray(data)
        damaged[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(damaged))
        try:
            checkpoint, _ = checkpoints._read(torch.device("cpu"))
            optimizer = torch.optim.Adam(model.parameters(), lr=good_checkpoint["config"]["lr"])
            checkpoints._validate(checkpoint, good_checkpoint["config"], model, optimizer)
        except common.Unusable as unusable:
            assert "\n" not in str(unusable) and str(path) in str(unusable)
            continue
        # Read and valid: then the bit was in bytes that change nothing, and the weights are the same.
        for name, tensor in good_checkpoint["model"].items():
            assert torch.equal(checkpoint["model"][name], tensor), (at, name)


def test_a_write_that_fails_is_said_once_and_a_folder_gone_mid_run_is_one_line(good_checkpoint, tmp_path,
                                                                                monkeypatch, capsys):
    """The writer fails on epoch 0's state; the next save stops the run with its line, and close()
    in the `finally` does not say it again. Then the folder vanishes under a job that holds the lock."""
    def disk_full(state, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common, "save_checkpoint", disk_full)
    code, stdout, stderr = run_main("start_with_torchrun.py", *SMALL, "--max_epochs", "3",
                                    "--checkpoint", str(tmp_path / "ckpt.pt"))
    assert code == 1 and stderr == f"error: could not save checkpoint {tmp_path}/ckpt.pt: No space left on device\n"
    monkeypatch.undo()

    folder = tmp_path / "gone"
    folder.mkdir()
    checkpoints = common.Checkpoints(str(folder / "ckpt.pt"), rank=0)
    model = build_model("mlp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    assert checkpoints.load(torch.device("cpu"), good_checkpoint["config"], model, optimizer)[0] is None
    assert (folder / "ckpt.pt.lock").exists()
    for child in folder.iterdir():
        child.unlink()
    folder.rmdir()
    capsys.readouterr()
    checkpoints.save(good_checkpoint, "epoch 0 | ...")
    with pytest.raises(SystemExit) as exit_info:
        checkpoints.close()
    assert exit_info.value.code == 1
    assert capsys.readouterr() == ("", f"error: could not save checkpoint {folder}/ckpt.pt: No such file or "
                                       "directory\n")  # and no FileNotFoundError from releasing the lock


STOP_INSIDE_SAVE = """
import os, signal, sys, time
import common
path = sys.argv[1]
checkpoints = common.Checkpoints(path, rank=0)
slow = common.save_checkpoint
def slowly(state, target):
    time.sleep(1)
    slow(state, target)
common.save_checkpoint = slowly
checkpoints.save({"epoch": 1}, "epoch 0 | saved")
time.sleep(0.2)  # the write is in flight
notify = checkpoints.wakeup.notify
def notify_then_stop():
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs while save() holds the lock
    notify()
checkpoints.wakeup.notify = notify_then_stop
checkpoints.save({"epoch": 2}, "epoch 1 | queued")
time.sleep(30)
"""


def test_a_stop_signal_inside_save_waits_for_the_write_and_ends(tmp_path):
    """The handler runs in the main thread, which may hold the lock the writer thread takes between
    writes: it must neither take that lock nor join the thread, or both wait for ever."""
    path = tmp_path / "ckpt.pt"
    started = time.monotonic()
    result = run([sys.executable, "-c", STOP_INSIDE_SAVE, str(path)], timeout=20)
    assert result.returncode == 128 + signal.SIGTERM
    assert time.monotonic() - started < 10
    assert result.stdout.splitlines()[-2:] == [
        "epoch 0 | saved",
        f"rank 0 stopped by SIGTERM: every epoch printed above is saved in {path}, and the same command resumes "
        "from there"]
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


@pytest.mark.parametrize("launcher, alive", [("None", True), ("os.getppid()", True), ("os.getppid() + 10**6", False)])
def test_only_a_launched_process_follows_its_launcher(launcher, alive):
    """The parent-death signal is asked for only under a launcher (a backgrounded `python
    start_with_torchrun.py` outlives its shell), and a launcher already gone ends the process."""
    code = ("import ctypes, os, signal, common\n"
            f"common.exit_promptly_on_signals(launcher={launcher})\n"
            "found = ctypes.c_int()\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(found))  # PR_GET_PDEATHSIG\n"
            "print(found.value)\n")
    result = run([sys.executable, "-c", code], timeout=30)
    if alive:
        assert result.returncode == 0 and int(result.stdout) == (0 if launcher == "None" else signal.SIGTERM)
    else:
        assert result.returncode == -signal.SIGTERM
