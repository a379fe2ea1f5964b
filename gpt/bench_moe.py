"""Mixtures of experts on this machine: the grouped product against a loop over the experts, and train.py's
tokens/s of moe-tiny at 2 ranks, without and with expert parallel, beside a dense model of the same active
parameters (moe-tiny's, each MoE layer one SwiGLU of top_k × expert_hidden units; the routers' few weights aside).

    python gpt/bench_moe.py                          # both, on CPUs
    python gpt/bench_moe.py --repeats 5 -- --seq_len 256

Times as gpt/bench.py takes them (the median of a run's log intervals past the first, then of the runs, with min
and max; runs interleaved, so that a drift in the machine's speed touches each alike). Arguments after `--` go to
train.py.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench  # noqa: E402
from model import CONFIGS, grouped  # noqa: E402

# (ranks, train.py's options, GPTConfig fields over moe-tiny's or None)
DENSE = {**CONFIGS["moe-tiny"], "n_expert": 0,
         "ffn_hidden": CONFIGS["moe-tiny"]["top_k"] * CONFIGS["moe-tiny"]["expert_hidden"]}
LAYOUTS = {"dense, same active": (2, ["--parallel", "fsdp"], DENSE), "moe, fsdp 2": (2, ["--parallel", "fsdp"], None),
           "moe, fsdp 2 × ep 2": (2, ["--parallel", "fsdp", "--ep", "2"], None)}
SHAPE = ["--model", "moe-tiny", "--seq_len", "128", "--batch_size", "8", "--max_steps", "40"]


def products(tokens: int, experts: int, width: int, hidden: int, repeats: int) -> None:
    """One projection's forward and backward over `tokens` rows split evenly among `experts`, by grouped() (its
    torch._grouped_mm on a CPU in fp32) and by a loop of one matmul per expert: ms per call, each a mean of 20."""
    x = torch.randn(tokens, width, requires_grad=True)
    w = torch.randn(experts, hidden, width, requires_grad=True)
    counts = [tokens // experts] * experts
    grad = torch.randn(tokens, hidden)
    ways = {"grouped": lambda: grouped(x, w, counts),
            "loop": lambda: torch.cat([rows @ w_e.T for rows, w_e in zip(x.split(counts), w, strict=True)])}
    times = {name: [] for name in ways}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, way in ways.items():
            started = time.perf_counter()
            for _ in range(20):
                way().backward(grad)
            if repeat:
                times[name].append(1e3 * (time.perf_counter() - started) / 20)
    loop = statistics.median(times["loop"])
    for name, ms in times.items():
        print(f"{tokens:>7} {experts:>4} {width:>5} {hidden:>6} {name:>8} {statistics.median(ms):>9.3f} "
              f"{min(ms):>7.3f} {max(ms):>7.3f}  {loop / statistics.median(ms):>5.2f}", flush=True)


def training(train_args: list[str], repeats: int, cores: int) -> None:
    speeds = {name: [] for name in LAYOUTS}
    for _ in range(repeats):
        for name, (world_size, layout, config) in LAYOUTS.items():
            os.environ.pop("BENCH_MOE_CONFIG", None)
            if config is not None:
                os.environ["BENCH_MOE_CONFIG"] = json.dumps(config)
            speeds[name].append(statistics.median(bench.run(world_size, [*SHAPE, *layout, *train_args],
                                                             max(1, cores // world_size), script="bench_moe.py")))
    os.environ.pop("BENCH_MOE_CONFIG", None)
    base = speeds[next(iter(LAYOUTS))]
    print(f"{'layout':>20} {'tokens/s (median)':>18} {'min':>8} {'max':>8}  {'÷ dense':>7}")
    for name, figures in speeds.items():
        ratios = sorted(s / b for s, b in zip(figures, base, strict=True))
        print(f"{name:>20} {statistics.median(figures):>18,.0f} {min(figures):>8,.0f} {max(figures):>8,.0f}  "
              f"{statistics.median(ratios):>7.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: train.py's own arguments")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(cores)
    print(f"{bench.machine()}\n\nthe grouped product against a loop, forward and backward, ms per call")
    print(f"{'tokens':>7} {'exp.':>4} {'in':>5} {'out':>6} {'way':>8} {'median':>9} {'min':>7} {'max':>7}  "
          f"{'÷ loop':>5}")
    for tokens, experts, width, hidden in ((1024, 4, 64, 32), (8192, 8, 128, 64), (8192, 64, 256, 128)):
        products(tokens, experts, width, hidden, args.repeats)
    print(f"\ntrain.py, {' '.join(SHAPE)} ({cores} cores, {cores // 2} thread a rank)")
    training([a for a in args.train_args if a != "--"], args.repeats, cores)


if __name__ == "__main__":
    if "BENCH_MOE_CONFIG" in os.environ or "RANK" in os.environ:  # a rank of training(): train.py, config swapped
        import train

        if "BENCH_MOE_CONFIG" in os.environ:
            CONFIGS["moe-tiny"] = json.loads(os.environ["BENCH_MOE_CONFIG"])
        train.main()
    else:
        main()
