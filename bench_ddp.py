"""What DDP costs and what it buys, measured in one run: its overhead at one rank, and weak scaling.

At every batch size of --batch-sizes (samples per step on each rank), the rows of PyTorch's own DDP
benchmark: the model without DDP ("plain") and DDP at one rank, on rank 0 while the other ranks wait;
DDP on every rank; and the same under no_sync(), which skips the all-reduce ("compute"). The rows take
turns, round after round, so that a slow moment of a shared machine hits all of them alike; a step
takes as long as its slowest rank. A figure is computed within each round, from times measured side by
side, and reported as the median [min, max] over the rounds. No data loading is timed.

    overhead       1 - plain's step time / DDP's at one rank: what the wrapper costs
    efficiency     step time at one rank / at N ranks, the same batch on every rank: samples per second
                   at N ranks over N times one rank's (weak scaling)
    contention     step time at one rank / compute's at N ranks: N processes computing side by side
    communication  compute's step time / DDP's at N ranks; efficiency = contention × communication

    torchrun --standalone --nproc-per-node 2 bench_ddp.py
    torchrun --standalone --nproc-per-node 2 bench_ddp.py --json --trace traces

Explained in docs/benchmarks.md.
"""
import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import benchtools
from benchtools import die, per_round, print_line, spread
from data import FEATURES, make_datasets
from model import build_model

MODEL = "wide"  # model.py's model sized so that the all-reduce matters; its others are too small to time
ROWS = ("plain", "one rank", "all ranks", "compute")
TRACE_STEPS = 3
COUNT = benchtools.number_in(1, 10_000, int)  # steps or rounds: more would run for days


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo",
                        help="gloo for CPUs, nccl for one GPU per process")
    parser.add_argument("--batch-sizes", type=benchtools.number_in(1, 2**24, int), nargs="+",
                        default=[8, 32, 128, 512, 2048], help="samples per step on each rank")
    parser.add_argument("--warmup", type=COUNT, default=3, help="untimed steps of every row (2 or more)")
    parser.add_argument("--steps", type=COUNT, default=5, help="timed steps per row and batch size per round")
    parser.add_argument("--rounds", type=COUNT, default=5, help="rounds, each timing every row in turn")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--trace", metavar="DIR", help=f"write a torch.profiler trace of {TRACE_STEPS} DDP steps per "
                        "rank here (rank0.json, ...), and draw rank 0's (rank0.png) where matplotlib is installed")
    parser.add_argument("--timeout", type=benchtools.timeout_seconds, default=300.0,
                        help="seconds a collective waits for a peer before the process group gives up")
    args = parser.parse_args()
    if args.warmup < 2:  # DDP lays its buckets out again in the second step's forward, once
        parser.error("--warmup must be 2 or more: DDP rebuilds its buckets in the second step")
    return args


def overhead(plain: float, ddp: float) -> float:
    """1 - throughput of DDP at one rank / throughput of the plain model, from their step times."""
    return 1 - plain / ddp


def efficiency(one_rank: float, n_ranks: float) -> float:
    """(n × batch / t_n) / (n × batch / t_1): samples per second at n ranks over n times one rank's."""
    return one_rank / n_ranks


def build_rows(args: argparse.Namespace, rank: int, device: torch.device) -> dict:
    """{row: (model, optimizer)}, every model from the same weights. Rank 0 alone trains the plain
    model and the one-rank DDP, on a process group of its own: the other ranks need no copy."""
    one_rank_group = dist.new_group([0])  # every rank takes part in making it; rank 0 alone is in it

    def row(wrap: Callable[[torch.nn.Module], torch.nn.Module]) -> tuple:
        torch.manual_seed(0)
        model = wrap(build_model(MODEL).to(device))  # on its device: DDP then needs no device_ids
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    rows = {"all ranks": row(DDP), "compute": row(DDP)}
    if rank == 0:  # DDP's construction talks only to its own group, here rank 0 alone: no rank waits
        rows["plain"] = row(lambda m: m)
        rows["one rank"] = row(lambda m: DDP(m, process_group=one_rank_group))
    return rows


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               all_reduce: bool) -> None:
    optimizer.zero_grad(set_to_none=True)
    # no_sync() skips the gradients' all-reduce: what remains of the step is compute alone.
    with nullcontext() if all_reduce else model.no_sync():
        F.mse_loss(model(x), y).backward()
    optimizer.step()


def measure(args: argparse.Namespace, rank: int, world_size: int,
            device: torch.device) -> tuple[dict, Callable[[], None]]:
    """Warm up and time every row at every batch size; return the report (the same on every rank) and a
    function that takes one DDP step on every rank (for the trace)."""
    most = max(args.batch_sizes)
    train_set, _ = make_datasets(train_size=world_size * most * 2, val_size=0)
    x, y = (t[rank::world_size].to(device) for t in train_set.tensors)  # this rank's shard, before any clock
    rows = build_rows(args, rank, device)
    steps_taken = dict.fromkeys(rows, 0)

    def run(name: str, size: int, steps: int) -> float:
        """Seconds per step over `steps` steps of one row, on this rank (0 if it sits the row out)."""
        if name not in rows:
            return 0.0
        model, optimizer = rows[name]
        benchtools.finish(device)
        start = time.perf_counter()
        for _ in range(steps):
            first = (steps_taken[name] * size) % (len(x) - size + 1)  # a new slice at every step
            train_step(model, optimizer, x[first:first + size], y[first:first + size], all_reduce=name != "compute")
            steps_taken[name] += 1
        benchtools.finish(device)
        return (time.perf_counter() - start) / steps

    plan = [(name, size) for size in args.batch_sizes for name in ROWS]
    if rank == 0:  # minutes of silence otherwise
        sys.stderr.write(f"bench_ddp.py: {len(plan)} rows of {args.warmup} warm-up steps, then {args.rounds} rounds "
                         f"of {args.steps} timed steps\n")
    for name, size in plan:
        dist.barrier()  # a one-rank row runs while the other ranks wait here
        run(name, size, args.warmup)
    seconds = torch.zeros(args.rounds, len(plan), dtype=torch.float64)
    for r in range(args.rounds):
        for i, (name, size) in enumerate(plan):
            dist.barrier()  # every rank starts the clock together
            seconds[r, i] = run(name, size, args.steps)
    # A step takes as long as its slowest rank; a rank that sat a row out adds 0.
    seconds = seconds.to(device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    ms = {f"{name}@{size}": (seconds[:, i] * 1e3).tolist() for i, (name, size) in enumerate(plan)}

    model = rows["all ranks"][0].module
    report = {
        "backend": args.backend, "world_size": world_size, "threads_per_rank": torch.get_num_threads(),
        "machine": benchtools.machine(device), "model": MODEL,
        "parameters": sum(p.numel() for p in model.parameters()),
        "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
        "step_ms": {key: spread(values) for key, values in ms.items()},
        "rounds_ms": ms,  # every round's times: every figure below can be recomputed from them
        "scaling": [{
            "batch": b,
            "overhead": per_round(overhead, ms[f"plain@{b}"], ms[f"one rank@{b}"]),
            "samples_per_s": per_round(lambda t, b=b: world_size * b / t * 1e3, ms[f"all ranks@{b}"]),
            "efficiency": per_round(efficiency, ms[f"one rank@{b}"], ms[f"all ranks@{b}"]),
            "contention": per_round(efficiency, ms[f"one rank@{b}"], ms[f"compute@{b}"]),
            "communication": per_round(efficiency, ms[f"compute@{b}"], ms[f"all ranks@{b}"]),
        } for b in args.batch_sizes],
    }
    return report, lambda: run("all ranks", most, 1)


def print_table(report: dict) -> None:
    print_line(f"# bench_ddp.py: {report['backend']}, {report['world_size']} ranks × {report['threads_per_rank']} "
               f"thread(s), model {report['model']} ({report['parameters']:,} parameters, "
               f"{report['gradient_bytes'] / 1e6:.1f} MB of gradients), {report['rounds']} rounds × "
               f"{report['steps']} timed steps ({report['warmup']} warm-up) per row and batch size")
    print_line(f"# {report['machine']}")
    print_line("# ms per step: the median over the rounds, the slowest rank's. A figure: median [min, max] over "
               "the rounds of the figure computed within each round")
    print_line(f"# {'batch':>6} {'plain':>8} {'one rank':>9} {'all ranks':>9} {'compute':>8}  {'overhead':<20} "
               f"{'samples/s':>9}  {'efficiency':<20} {'contention':>10} {'communication':>13}")

    def fig(s: dict, form: str) -> str:
        return f"{form.format(s['median'])} [{form.format(s['min'])}, {form.format(s['max'])}]"

    for row in report["scaling"]:
        step = {name: report["step_ms"][f"{name}@{row['batch']}"]["median"] for name in ROWS}
        print_line(f"  {row['batch']:>6} {step['plain']:>8.2f} {step['one rank']:>9.2f} {step['all ranks']:>9.2f} "
                   f"{step['compute']:>8.2f}  {fig(row['overhead'], '{:.1%}'):<20} "
                   f"{row['samples_per_s']['median']:>9.0f}  {fig(row['efficiency'], '{:.3f}'):<20} "
                   f"{row['contention']['median']:>10.3f} {row['communication']['median']:>13.3f}")


def needed_bytes(args: argparse.Namespace, world_size: int) -> int:
    """About the bytes one process needs, all float32 (4 bytes)."""
    model, most = build_model(MODEL), max(args.batch_sizes)
    widths = sum(layer.out_features for layer in model.modules() if isinstance(layer, torch.nn.Linear))
    data = world_size * most * 2 * (FEATURES + 1) * 4 * 2  # every rank draws the whole set, twice over while drawing
    rows = 4 * 5 * sum(p.numel() for p in model.parameters()) * 4  # weights, gradients, buckets, Adam's 2 moments
    activations = most * widths * 4 * 2 * 2  # each layer's output, kept for backward, and as much in backward
    return data + rows + activations


def main() -> None:
    args = parse_args()
    launched = benchtools.launcher_env()  # None without a launcher
    if launched is None:
        die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 bench_ddp.py")
    rank, local_rank, world_size, procs_on_node = launched
    device = benchtools.pick_device(args.backend, local_rank, procs_on_node)
    if device.type == "cpu":
        # Every process gets its share of the cores, one rank alone as many as each of N side by side.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs_on_node))
    if local_rank == 0:  # the others are stopped by torchrun if this one stops
        benchtools.check_memory(needed_bytes(args, world_size) * procs_on_node,
                                f"batches of up to {max(args.batch_sizes)} samples on {procs_on_node} process(es)")
        if args.trace:
            try:
                os.makedirs(args.trace, exist_ok=True)  # now, not after minutes of measuring
            except OSError as exc:
                die(f"--trace {args.trace}: cannot create the folder: {exc.strerror}")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        report, step = measure(args, rank, world_size, device)
        trace = benchtools.write_trace(args.trace, rank, step, TRACE_STEPS) if args.trace else None
        # DDP holds the process group (model.process_group): a wrapper freed after destroy_process_group
        # can leave gloo's teardown waiting for ever on the GIL (seen with torch 2.13). All go now, with step.
        del step
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return  # every rank holds the same report: one prints it
    if args.json:
        print_line(json.dumps(report, indent=1))
    else:
        print_table(report)
    if trace:
        try:
            benchtools.draw_trace(trace, os.path.join(args.trace, "rank0.png"))
        except ImportError:  # matplotlib is an optional extra
            sys.stderr.write(f"{args.trace}/rank0.png not drawn: pip install -r requirements-plot.txt\n")


if __name__ == "__main__":
    main()
    benchtools.exit_now()  # skips the interpreter's teardown of torch (see benchtools)
