"""Plumbing that the training scripts share and that is not the DDP lesson.

Argument checks, a free port, and checkpoint files written atomically. Every distributed call
(init_process_group, DDP, DistributedSampler, all_reduce, ...) stays in the scripts, where the
reader can see it.
"""
import argparse
import errno
import os
import pickle
import socket
import sys
import zipfile
from typing import NoReturn

import torch

import data
from model import MODELS


def die(message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and a non-zero exit: 2 by default, the code argparse uses for bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def print_line(text: str) -> None:
    """Print one line in a single write. print() writes the text and the newline separately, and
    torchrun runs Python unbuffered, so lines from several ranks would otherwise run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The knobs that every training script takes, with defaults that run in seconds on a CPU."""
    parser.add_argument("--max_epochs", type=positive_int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=positive_float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model's weights and the shuffle")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp", help="which model from model.py")
    parser.add_argument("--train_size", type=positive_int, default=data.TRAIN_SIZE, help="training samples")
    parser.add_argument("--val_size", type=positive_int, default=data.VAL_SIZE, help="validation samples")
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0,
        help="seconds a collective waits for a peer before the process group gives up",
    )
    parser.add_argument(
        "--checkpoint", default=None, metavar="PATH",
        help="after every epoch rank 0 saves here; if the file exists at start, training resumes from it",
    )


def reject_old_launcher_flag(parser: argparse.ArgumentParser) -> None:
    """python -m torch.distributed.launch without --use-env appends --local-rank=N to the arguments.
    Say what to do about it, rather than argparse's bare "unrecognized arguments"."""

    class Reject(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is what python -m torch.distributed.launch passes without --use-env; "
                         "start this script with torchrun, or add --use-env (it reads LOCAL_RANK from the environment)")

    parser.add_argument("--local-rank", "--local_rank", action=Reject, help=argparse.SUPPRESS)


def check_world_size(world_size: int, args: argparse.Namespace) -> None:
    if world_size > args.train_size:
        die(f"{world_size} ranks but only {args.train_size} training samples: every rank needs at least one")


def check_gpus(procs_on_node: int, flag: str, cpu_script: str) -> None:
    """Fail fast, in one line, where nccl would otherwise fail late and obscurely: no CUDA at all,
    or more processes on this node than GPUs (two processes cannot share a GPU under nccl)."""
    quiet = int(os.environ.get("LOCAL_RANK", 0)) != 0  # the same line from every process says nothing more
    if not torch.cuda.is_available():
        if quiet:
            sys.exit(2)
        die(f"no CUDA GPU is visible (this torch is {torch.__version__}); on CPUs run {cpu_script} instead")
    gpus = torch.cuda.device_count()
    if procs_on_node > gpus:
        if quiet:
            sys.exit(2)
        die(f"{procs_on_node} processes on this node but {gpus} GPUs: use {flag} {gpus} or fewer, one per GPU")


def listen_on_loopback(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:`port` (0: a free port that the system picks), or one line
    that names the port if another program holds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        die(f"port {port} on 127.0.0.1 is already in use: pass --port 0 to let the system pick a free one, "
            "or name another")
    sock.listen()
    return sock


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (it may be taken again before it is used)."""
    with listen_on_loopback(0) as sock:
        return sock.getsockname()[1]


# Settings that a resumed run must share with the run that wrote the checkpoint: with any other
# value it would silently become a different experiment. The world size may change (an elastic
# job can restart with fewer nodes); that only earns a warning.
RESUME_MUST_MATCH = ("model", "train_size", "batch_size", "lr", "seed")


def run_config(args: argparse.Namespace, world_size: int) -> dict:
    """What a checkpoint records about the run that wrote it (plain types: weights_only can read them)."""
    return {name: getattr(args, name) for name in RESUME_MUST_MATCH} | {"world_size": world_size}


def save_checkpoint(state: dict, path: str) -> None:
    """Write to a temporary file, fsync it, then rename it over `path`: a crash mid-write leaves the
    previous checkpoint whole, never a torn file."""
    tmp_path = f"{path}.tmp"
    with open(tmp_path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)  # atomic on POSIX: readers see the old file or the new one


def open_checkpoint(path: str, rank: int, map_location: torch.device, config: dict,
                    model: torch.nn.Module) -> dict | None:
    """Check that checkpoints can be written at `path`, and return the one there, if any.

    A missing file means a fresh start. A file that exists but cannot be used stops the run with
    one line and is left as it is: silently starting from scratch would throw the training away.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        die(f"cannot write checkpoint {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK):
        die(f"cannot write checkpoint {path}: {folder} is not writable")
    if rank == 0 and os.path.exists(f"{path}.tmp"):
        os.remove(f"{path}.tmp")  # the torn remains of a write that crashed; `path` itself is whole
        print(f"removed {path}.tmp, left by a checkpoint write that did not finish", flush=True)
    if not os.path.exists(path):
        return None

    checkpoint = _read(path, map_location)
    missing = {"model", "optimizer", "epoch", "config"} - set(checkpoint if isinstance(checkpoint, dict) else ())
    if missing:
        die(f"{path} is not a checkpoint of these scripts: it lacks {', '.join(sorted(missing))}")
    for name in RESUME_MUST_MATCH:
        saved, now = checkpoint["config"].get(name), config[name]
        if saved != now:
            die(f"{path} was written with --{name} {saved}, this run has --{name} {now}: "
                f"use the same value, or another --checkpoint path to start afresh")
    expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
    saved_shapes = {key: tuple(t.shape) for key, t in checkpoint["model"].items()}
    if saved_shapes != expected:
        die(f"{path} holds weights of another model: its parameters do not match --model {config['model']}")
    saved_world = checkpoint["config"]["world_size"]
    if rank == 0 and saved_world != config["world_size"]:
        print(f"warning: {path} was written by {saved_world} ranks and this run has {config['world_size']}: "
              f"the global batch changes from {saved_world * config['batch_size']} to "
              f"{config['world_size'] * config['batch_size']} samples, so the result will differ from an "
              "uninterrupted run", flush=True)
    return checkpoint


def _read(path: str, map_location: torch.device) -> dict:
    """torch.load with weights_only=True, each failure told in one line."""
    if not zipfile.is_zipfile(path):
        die(f"cannot read checkpoint {path}: not a file written by torch.save (truncated, or another format)")
    try:
        # weights_only=True: a pickle can name any Python function to call while it loads, so a
        # crafted file would run code. This loader accepts tensors and plain containers only.
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        die(f"refusing to load {path}: it holds Python objects other than tensors and plain types, "
            "and unpickling them could run code")
    except Exception as exc:  # a damaged archive fails in many ways; every one means unusable
        die(f"cannot read checkpoint {path}: {str(exc).splitlines()[0]}")
