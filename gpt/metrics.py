"""What train.py's log lines report beside the loss: MFU's peak, the memory peaks, the time left, and
metrics.jsonl."""
import argparse
import json
import math
import os
import resource
import sys

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peak per GPU in TFLOP/s (NVIDIA's datasheets give twice these, with sparsity); TF32 is
# half of it. The first key found in the device's name wins: a variant before its family's name.
PEAK_BF16_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200 NVL": 835.0, "H200": 989.0,
                    "A100": 312.0, "GB200": 2500.0, "B200": 2250.0}


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    """Peak FLOP/s of one GPU for MFU: --peak_tflops, else from the device's name, else unknown."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    bf16 = next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in name), None)
    if bf16 is None:
        return None
    return bf16 * 1e12 / (2 if args.precision == "fp32" else 1)


def peak_memory(device: torch.device) -> tuple[dict, str]:
    """(the metrics' fields, the log line's words): the largest peak of any rank in GiB, CUDA's most
    allocated and reserved (what a GPU user tunes first), or on a CPU the process's peak resident set.
    One all-reduce (max): every rank calls it."""
    if device.type == "cuda":
        names = ("peak_allocated_gib", "peak_reserved_gib")
        peaks = [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)]
    else:
        names = ("peak_rss_gib",)  # getrusage's ru_maxrss is in KiB on Linux, in bytes on macOS
        peaks = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)]
    largest = torch.tensor(peaks, dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    fields = dict(zip(names, (value / 2**30 for value in largest.tolist()), strict=True))
    words = " / ".join(f"{value:.2f}" for value in fields.values())
    return fields, f"mem {words} GiB" + (" (allocated / reserved)" if device.type == "cuda" else " (rss)")


def time_left(seconds: float) -> str:
    """The log line's time to the last step at the last interval's pace: 42s left, 3m05s, 2h05m, 3d04h."""
    seconds = round(seconds)
    for unit, size, small, small_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if seconds >= size:
            return f"{seconds // size}{unit}{seconds % size // small_size:02d}{small} left"
    return f"{seconds}s left"


def json_line(record: dict) -> str:
    """One line of strict JSON: a value that is not finite (the gradient's norm of a step that fp16's scaler
    skips is inf) is written as null, where Python's json would write Infinity, which strict readers refuse."""
    def finite(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {key: finite(item) for key, item in value.items()}
        return [finite(item) for item in value] if isinstance(value, list) else value
    return json.dumps(finite(record), allow_nan=False) + "\n"


def open_metrics(out_dir: str, first_step: int):
    """metrics.jsonl for appending, holding only the records up to `first_step`: a resumed run
    drops what the run it resumes logged after its checkpoint, and logs those steps again."""
    path = os.path.join(out_dir, "metrics.jsonl")
    kept = []
    if first_step and os.path.exists(path):
        with open(path) as file:
            for line in file:
                try:
                    if json.loads(line)["step"] <= first_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    pass  # a line cut short by a crash
    with open(path + ".tmp", "w") as file:
        file.writelines(kept)
    os.replace(path + ".tmp", path)
    return open(path, "a", buffering=1)  # noqa: SIM115  (line-buffered: a crash loses no finished line)
