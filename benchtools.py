"""What the three benchmarks share: their argument checks, their one-line errors and output, the device
they measure on, and the line that says which machine a figure came from.

bench_comm.py, bench_ddp.py and bench_memory.py import it; no lesson does. Every distributed call stays
in the benchmarks themselves.
"""
import argparse
import os
import platform
import sys
from typing import NoReturn

import torch

# Imported before any process group exists, on purpose. torch.distributed.nn's functions take
# `group=group.WORLD` as a default, evaluated when the module is imported, and an optimizer's
# constructor imports it (through torch._dynamo, which imports torch.distributed.fsdp; torch 2.13).
# Imported after init_process_group, those defaults would hold the process group, and gloo's threads
# with it, past destroy_process_group.
import torch.distributed.nn  # noqa: F401, I001


def die(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, in one write (two ranks' lines never run together), and exit with `code`:
    2 by default, as argparse exits on bad input."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def print_line(text: str) -> None:
    """One line in one write: print() writes the text and the newline apart, and torchrun runs
    Python unbuffered, so lines from several ranks could run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def exit_now() -> NoReturn:
    """Exit with status 0 at once, once main() has returned (the process group destroyed, the output
    flushed). The interpreter's own teardown of torch's modules costs nearly a second of CPU per
    process, which a job of many processes on few cores pays in wall time."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def number_in(low: float, high: float, kind: type = float):
    """An argparse type: a number of `kind` from `low` to `high`, or one line that says the range."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value <= high:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g}, got {text}")
        return value
    return parse


# Seconds: below 1 the rendezvous itself rarely finishes; above 1e7 (115 days) a mistake, and far above
# it (1e300, inf) the number no longer fits the timedelta that init_process_group takes.
timeout_seconds = number_in(1, 10**7)


def launcher_env() -> tuple[int, int, int, int] | None:
    """(rank, local rank, world size, processes on this node) from the variables torchrun sets, or None
    where none is set. Some but not all of them, or one that is not an integer, is one line."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    if not any(name in os.environ for name in names):
        return None
    try:
        rank, local_rank, world_size, procs_on_node = (int(os.environ[name]) for name in names)
    except (KeyError, ValueError):
        found = ", ".join(f"{name}={os.environ.get(name)!r}" for name in names)
        die(f"{found}: start this script with torchrun, which sets them all")
    return rank, local_rank, world_size, procs_on_node


def check_memory(needed: int, what: str) -> None:
    """One line, before anything is allocated, if `needed` bytes cannot fit in this machine's memory."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return  # not Linux: nothing to compare with
    if needed > available:
        die(f"{what} need {needed:,} bytes of memory and this machine has {available:,} available")


def pick_device(backend: str, local_rank: int, procs_on_node: int) -> torch.device:
    """This process's GPU under nccl (one line if this node has fewer GPUs than processes), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < procs_on_node:
        if local_rank != 0:
            sys.exit(2)  # the same line from every process says nothing more
        die(f"--backend nccl needs a CUDA GPU per process: {procs_on_node} processes on this node and {gpus} "
            "GPUs; use --backend gloo")
    torch.cuda.set_device(local_rank)  # before init_process_group, so that nccl's communicator is built on it
    return torch.device("cuda", local_rank)


def finish(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA runs asynchronously, so a clock read needs it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device) -> str:
    """The CPU model (and the GPU), the cores and the torch version: a figure means little without them."""
    model = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
        model = names[0] if names else model
    text = f"{model}, {os.cpu_count()} cores, torch {torch.__version__}"
    return f"{torch.cuda.get_device_name(device)}, {text}" if device.type == "cuda" else text
