"""Plumbing that the training scripts share and that is not the DDP lesson.

Argument checks, a free port, and checkpoint files written atomically. Every distributed call
(init_process_group, DDP, DistributedSampler, all_reduce, ...) stays in the scripts, where the
reader can see it.
"""
import argparse
import os
import socket
import sys
from typing import NoReturn

import torch

import data
from model import MODELS


def die(message: str) -> NoReturn:
    """One clear line on stderr and exit code 2, the code argparse uses for bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now. Asking the OS for port 0 avoids a hard-coded
    port that a second job on the same host would already hold (EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_checkpoint(state: dict, path: str) -> None:
    """Write to a temporary file, fsync it, then rename over `path`: a crash mid-write leaves the
    previous checkpoint whole, never a torn file."""
    tmp_path = f"{path}.tmp"
    with open(tmp_path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def load_checkpoint(path: str, map_location: torch.device) -> dict | None:
    """The checkpoint at `path`, or None if there is none. A file that exists but cannot be used
    stops the run with one line: silently starting from scratch would throw away the training."""
    if not os.path.exists(path):
        return None
    try:
        # weights_only=True: unpickling arbitrary objects from a file can run arbitrary code.
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; all mean "unusable"
        die(f"cannot read checkpoint {path}: {str(exc).splitlines()[0]}")
    missing = {"model", "optimizer", "epoch"} - set(checkpoint if isinstance(checkpoint, dict) else ())
    if missing:
        die(f"{path} is not a checkpoint of these scripts (missing {', '.join(sorted(missing))})")
    return checkpoint
