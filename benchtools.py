"""What the benchmarks share: their argument checks, their one-line errors and output, the device they
measure on, the line that says which machine a figure came from, a figure's spread over the rounds, and
the profiler trace of a few steps drawn as a timeline.

bench_comm.py, bench_ddp.py, bench_by_hand.py and bench_memory.py import it; no lesson does. Every
distributed call stays in the benchmarks themselves.
"""
import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
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


def spread(values: list[float]) -> dict:
    """A figure's min, median and max over the rounds."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def per_round(fn: Callable[..., float], *series: list[float]) -> dict:
    """A figure computed in each round from that round's times, then spread over the rounds: a ratio of
    two things measured side by side, never of two medians taken at different moments."""
    return spread([fn(*times) for times in zip(*series, strict=True)])


def write_trace(folder: str, rank: int, step: Callable[[], None], steps: int) -> str:
    """A torch.profiler chrome trace of `steps` calls of step(), as folder/rank{rank}.json."""
    with torch.profiler.profile() as profiler:  # the CPU, and the GPU where there is one (its default)
        for _ in range(steps):
            step()
    path = os.path.join(folder, f"rank{rank}.json")
    profiler.export_chrome_trace(path)
    return path


def trace_lanes(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """From a torch.profiler chrome trace, the spans (start, end in ms from the first) of the forward
    (torch DDP's own span, or a record_function("forward") of the benchmark's), backward's autograd nodes,
    the optimizer step and the backend's all-reduce."""
    lanes = {"forward": [], "backward": [], "optimizer": [], "all-reduce": []}
    for event in (e for e in trace["traceEvents"] if e.get("ph") == "X"):
        name = event["name"]
        if name.startswith("DistributedDataParallel.forward") or name == "forward":
            lane = "forward"
        elif name.startswith("autograd::engine::evaluate_function"):
            lane = "backward"
        elif name.startswith("Optimizer.step"):
            lane = "optimizer"
        elif name in ("gloo:all_reduce", "nccl:all_reduce"):
            lane = "all-reduce"  # the backend's own span (on gloo's thread), not the call that queues it
        else:
            continue
        lanes[lane].append((event["ts"], event["ts"] + event["dur"]))
    origin = min(start for spans in lanes.values() for start, _ in spans)
    return {lane: [((s - origin) / 1e3, (t - origin) / 1e3) for s, t in spans] for lane, spans in lanes.items()}


def draw_trace(trace_path: str, png_path: str) -> None:
    """A timeline of the traced steps on one rank: where the all-reduces run against backward."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    with open(trace_path) as f:
        lanes = trace_lanes(json.load(f))
    figure, axes = plt.subplots(figsize=(9, 2.2))
    colours = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple", "all-reduce": "tab:blue"}
    for y, (lane, spans) in enumerate(reversed(lanes.items())):
        axes.broken_barh([(s, t - s) for s, t in spans], (y - 0.4, 0.8), color=colours[lane])
    axes.set_yticks(range(len(lanes)), list(reversed(lanes)))
    axes.set_xlabel("ms")
    figure.tight_layout()
    figure.savefig(png_path, dpi=70)
    plt.close(figure)
