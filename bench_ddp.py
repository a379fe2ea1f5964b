"""What DDP buys and what it costs, measured in one run.

Its overhead at one rank, weak scaling over a sweep of batch sizes, how much of the all-reduce hides
behind backward, and DDP's tuning knobs. Every figure is a step time measured beside its reference in
the same run: the configurations take turns, round after round (a slow moment of a shared machine then
hits all of them alike), and each figure is computed within a round, then reported as the median over
the rounds with the min and the max. So a figure is not the ratio of the median times printed beside
it, which come from different rounds; --json gives every round's times. A step takes as long as its
slowest rank. "One rank" runs on rank 0 alone while the other ranks wait at a barrier; "all ranks"
runs on every rank. The batches are drawn before timing: no data loading is measured.

    overhead     1 - (plain model's step time / DDP's at one rank): what the wrapper costs
    efficiency   step time at one rank / at N ranks, with the same batch on every rank: samples per second
                 at N ranks over N times one rank's (weak scaling)
    overlap      compute alone (steps under no_sync(), which skips the all-reduce), the all-reduce alone
                 (the same buckets through dist.all_reduce), and the step; "hidden" is the part of the
                 all-reduce that the step does not pay: (compute + all-reduce - step) / all-reduce
    knobs        each DDP option's step time over the default's, and the loss after the same steps

    torchrun --standalone --nproc-per-node 2 bench_ddp.py
    torchrun --standalone --nproc-per-node 2 bench_ddp.py --json --plot bench_ddp.png --trace traces
    torchrun --standalone --nproc-per-node 8 bench_ddp.py --backend nccl --compare-dp
    python bench_ddp.py --startup 8

--startup N, with plain python, times whole torchrun jobs of N workers in turn: workers that only join
and leave, workers that also build a model and a torch.optim optimizer and take one DDP step, and
singlenode_cpu.py. Explained in docs/benchmarks.md, which defines every figure and gives this machine's.
"""
import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import common
from data import FEATURES, make_datasets
from model import MODELS, build_model

ACCUMULATION = 4  # micro-batches per optimizer step in the accumulation rows
VAL_SIZE = 1024  # validation samples, for the loss after the knobs' steps
TRACE_STEPS = 3
PLOT_EXTRA = "pip install -r requirements-plot.txt"
COUNT = common.number_in(0, 10_000, int)  # steps or rounds: more would run for days


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo",
        help="gloo for CPUs, nccl for one GPU per process; default: nccl if CUDA is available",
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="wide", help="which model from model.py")
    parser.add_argument("--batch-sizes", type=common.positive_int, nargs="+", default=[8, 32, 128, 512, 2048],
                        help="samples per step on each rank, for the weak-scaling sweep")
    parser.add_argument("--batch-size", type=common.positive_int, default=128,
                        help="samples per step on each rank for the overhead, overlap and knob figures")
    parser.add_argument("--warmup", type=COUNT, default=3, help="untimed steps of every configuration (2 or more)")
    parser.add_argument("--steps", type=COUNT, default=5, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=COUNT, default=5, help="rounds, each timing every configuration")
    parser.add_argument("--lr", type=common.positive_float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--busbw", type=common.positive_float, default=None, metavar="GBPS",
                        help="bench_comm.py's all_reduce busbw at the buckets' size: predicts the all-reduce time")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    parser.add_argument("--plot", metavar="PATH.png", help="draw the scaling curve and the knobs' ratios here")
    parser.add_argument("--trace", metavar="DIR", help=f"write a torch.profiler trace of {TRACE_STEPS} steps per "
                        "rank here (rank0.json, ...), for Perfetto or chrome://tracing")
    parser.add_argument("--compare-dp", action="store_true",
                        help="also time torch.nn.DataParallel over this node's GPUs (2 or more)")
    parser.add_argument("--timeout", type=common.timeout_seconds, default=300.0,
                        help="seconds a collective waits for a peer before the process group gives up")
    parser.add_argument("--startup", type=common.number_in(1, 1024, int), metavar="N",
                        help="with plain python: time torchrun jobs of N workers against the two floors")
    parser.add_argument("--floor", choices=("join", "step"), help=argparse.SUPPRESS)  # --startup's workers
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be 2 or more: DDP lays out its buckets in the first steps, "
                     "and PowerSGD compresses from the third")
    if args.batch_size % ACCUMULATION:
        parser.error(f"--batch-size must be a multiple of {ACCUMULATION}: the accumulation rows split it")
    if args.plot is not None and not args.plot.endswith(".png"):
        parser.error("--plot names a .png file")
    if args.trace == "":
        parser.error("--trace names a folder")
    if args.startup and (args.plot or args.trace or args.compare_dp):
        parser.error("--plot, --trace and --compare-dp belong to a torchrun run, not to --startup")
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be 1 or more")
    return args


# ---- The arithmetic of the figures ----

def spread(values: list[float]) -> dict:
    """A figure's min, median and max over the rounds."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def per_round(fn: Callable[..., float], *series: list[float]) -> dict:
    """A figure computed in each round from that round's times, then spread over the rounds: a ratio of
    two things measured side by side, never of two medians taken at different moments."""
    return spread([fn(*times) for times in zip(*series, strict=True)])


def overhead(plain: float, ddp: float) -> float:
    """1 - throughput of DDP at one rank / throughput of the plain model, from their step times."""
    return 1 - plain / ddp


def efficiency(one_rank: float, n_ranks: float) -> float:
    """(n × batch / t_n) / (n × batch / t_1): samples per second at n ranks over n times one rank's."""
    return one_rank / n_ranks


def overlap(step: float, forward: float, backward: float, optimizer: float, all_reduce: float) -> dict:
    """Where a DDP step's time goes. A bucket's all-reduce can run only while backward computes the
    gradients after it, so at best a step takes forward + max(backward, all-reduce) + optimizer; with
    no overlap it takes compute + all-reduce."""
    compute = forward + backward + optimizer
    return {"compute": compute, "no_overlap": compute + all_reduce,
            "perfect_overlap": forward + max(backward, all_reduce) + optimizer,
            "hidden": (compute + all_reduce - step) / all_reduce if all_reduce > 0 else None}


def predicted_all_reduce(bucket_bytes: list[int], world_size: int, busbw_gbps: float) -> float:
    """Seconds for the buckets' all-reduces, one after the other. A bandwidth-optimal all-reduce moves
    2(n-1)/n of a bucket of S bytes through every rank's link: 2(n-1)/n × S / busbw. Latency is left
    out, a fair model for buckets of megabytes."""
    return sum(2 * (world_size - 1) / world_size * size / (busbw_gbps * 1e9) for size in bucket_bytes)


# ---- The configurations ----

@dataclass
class Variant:
    """A model and its optimizer, trained by one configuration, and what it records as it trains."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    micro_batches: int = 1  # per optimizer step
    no_sync: str = "never"  # "never"; "accumulate": every micro-batch but the last; "always": compute alone
    bucket_sizes: list[int] = field(default_factory=list)  # bytes per all-reduce, this step (counting hook)
    phases: dict | None = None  # seconds in forward, backward and optimizer step, when timed apart


def knob_names(device: torch.device) -> list[str]:
    return ["default", "bucket_cap_mb=1", "bucket_cap_mb=25", "bucket_cap_mb=100", "gradient_as_bucket_view",
            "static_graph", "fp16 compression", *(["bf16 compression"] if device.type == "cuda" else []),
            *(["PowerSGD rank 1", "PowerSGD rank 4"] if powersgd_runs(device) is None else []),
            f"accumulate {ACCUMULATION}, no_sync", f"accumulate {ACCUMULATION}, no no_sync"]


def powersgd_runs(device: torch.device) -> str | None:
    """None if the stock PowerSGD hook can run here, else why not. It calls torch.cuda.synchronize(device)
    whenever CUDA is available (torch 2.13), which raises for gradients on the CPU: on a machine with a GPU,
    the CPU benchmark hides the GPU (CUDA_VISIBLE_DEVICES= torchrun ...) to time it."""
    if device.type == "cpu" and torch.cuda.is_available():
        return ("PowerSGD was not timed: its hook calls torch.cuda.synchronize on CPU gradients when CUDA is "
                "available; hide the GPUs (CUDA_VISIBLE_DEVICES=) to time it with gloo")
    return None


def counting_hook(sizes: list[int]) -> Callable:
    """A DDP communication hook that records each bucket's size in bytes, then all-reduces it as DDP's
    default does (the average). It runs once per bucket all-reduce: its count is theirs."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def count_and_all_reduce(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        return allreduce_hook(process_group, bucket)
    return count_and_all_reduce


def build_variants(args: argparse.Namespace, rank: int, device: torch.device) -> dict[str, Variant]:
    """Every configuration starts from the same weights on every rank (one seed), so that the losses
    after the same steps compare."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    one_rank_group = dist.new_group([0])  # every rank takes part in making it; rank 0 alone is in it
    device_ids = [device.index] if device.type == "cuda" else None

    def variant(wrap: Callable | None = None, **options) -> Variant:
        torch.manual_seed(0)
        model = build_model(args.model).to(device)
        model = model if wrap is None else wrap(model)
        return Variant(model, torch.optim.Adam(model.parameters(), lr=args.lr), **options)

    def ddp(**kwargs) -> Callable[[torch.nn.Module], DDP]:
        return lambda module: DDP(module, device_ids=device_ids, **kwargs)

    variants = {
        "all ranks": variant(ddp()),
        "compute alone": variant(ddp(), no_sync="always"),
        "compute split": variant(ddp(), no_sync="always", phases=dict.fromkeys(("forward", "backward", "optimizer"),
                                                                                0.0)),
        "default": variant(ddp()),
        "bucket_cap_mb=1": variant(ddp(bucket_cap_mb=1)),
        "bucket_cap_mb=25": variant(ddp(bucket_cap_mb=25)),
        "bucket_cap_mb=100": variant(ddp(bucket_cap_mb=100)),
        "gradient_as_bucket_view": variant(ddp(gradient_as_bucket_view=True)),
        "static_graph": variant(ddp(static_graph=True)),
    }
    for name, hook in (("fp16 compression", default_hooks.fp16_compress_hook),
                       ("bf16 compression", default_hooks.bf16_compress_hook)):
        if name in knob_names(device):  # the stock bf16 hook refuses anything but CUDA with nccl
            variants[name] = variant(ddp())
            variants[name].model.register_comm_hook(None, hook)
    # PowerSGD's hook starts its second and third all-reduces from callbacks of the first. Under gloo a
    # callback runs on the backend's thread, so with several buckets the ranks can start collectives in
    # different orders, and gloo aborts ("Received data size doesn't match expected size"). One bucket
    # keeps the order: on gloo the PowerSGD rows put all the gradients in one.
    one_bucket = {"bucket_cap_mb": gradient_bytes(build_model(args.model)) / 2**20 + 1} if device.type == "cpu" else {}
    for matrix_rank in (1, 4) if powersgd_runs(device) is None else ():
        # start_powerSGD_iter=2: with the stock 1000, every step of a short run would go uncompressed.
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=matrix_rank, start_powerSGD_iter=2)
        variants[f"PowerSGD rank {matrix_rank}"] = variant(ddp(**one_bucket))
        variants[f"PowerSGD rank {matrix_rank}"].model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    for name, no_sync in ((f"accumulate {ACCUMULATION}, no_sync", "accumulate"),
                          (f"accumulate {ACCUMULATION}, no no_sync", "never")):
        variants[name] = variant(ddp(), micro_batches=ACCUMULATION, no_sync=no_sync)
        variants[name].model.register_comm_hook(None, counting_hook(variants[name].bucket_sizes))
    if rank == 0:  # DDP's construction talks only to its own group, here rank 0 alone: no rank waits
        variants["plain"] = variant()
        variants["one rank"] = variant(ddp(process_group=one_rank_group))
    return variants


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: a clock read needs its work finished


def timed_phase(v: Variant, phase: str, device: torch.device, fn: Callable):
    start = time.perf_counter()
    result = fn()
    sync(device)
    v.phases[phase] += time.perf_counter() - start
    return result


def train_step(v: Variant, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> None:
    """One optimizer step over the batch (x, y), taken in v.micro_batches pieces."""
    v.bucket_sizes.clear()
    v.optimizer.zero_grad(set_to_none=True)
    for i, (xs, ys) in enumerate(zip(x.chunk(v.micro_batches), y.chunk(v.micro_batches), strict=True)):
        # no_sync() skips the all-reduce, and the gradients add up locally; the last micro-batch's
        # backward then all-reduces their sum once. Without it every micro-batch pays an all-reduce.
        skip = v.no_sync == "always" or (v.no_sync == "accumulate" and i < v.micro_batches - 1)
        with v.model.no_sync() if skip else nullcontext():
            if v.phases is None:
                (F.mse_loss(v.model(xs), ys) / v.micro_batches).backward()  # / micro_batches: the batch mean
            else:
                loss = timed_phase(v, "forward", device, lambda xs=xs, ys=ys: F.mse_loss(v.model(xs), ys))
                timed_phase(v, "backward", device, loss.backward)
    if v.phases is None:
        v.optimizer.step()
    else:
        timed_phase(v, "optimizer", device, v.optimizer.step)


def plan(args: argparse.Namespace, world_size: int, device: torch.device) -> list[tuple[str, str, int]]:
    """(figure key, configuration, batch per rank) in the order every round times them; the same list on
    every rank. "all-reduce alone" is the buckets of one step through dist.all_reduce."""
    configs = []
    for size in args.batch_sizes:
        configs += [(f"{name}@{size}", name, size) for name in ("plain", "one rank", "all ranks", "compute alone")]
    b = args.batch_size
    configs += [("plain", "plain", b), ("one rank", "one rank", b), ("compute split", "compute split", b),
                ("all-reduce alone", "all-reduce alone", b)]
    configs += [(name, name, b) for name in knob_names(device)]
    if args.compare_dp and data_parallel_gpus(world_size) is None:
        configs += [("DataParallel", "DataParallel", b * world_size), ("DDP", "all ranks", b)]
    return configs


def data_parallel_gpus(world_size: int) -> str | None:
    """None if DataParallel can be compared here, else why not, in one line."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return f"--compare-dp needs 2 or more GPUs and this machine has {gpus}: DataParallel was not timed"
    if world_size != gpus or int(os.environ["LOCAL_WORLD_SIZE"]) != world_size:
        return f"--compare-dp needs one node with one rank per GPU ({gpus} here): DataParallel was not timed"
    return None


def largest_batch(args: argparse.Namespace, world_size: int) -> int:
    """The most samples one step takes on one process: DataParallel's takes every GPU's batch."""
    return max(*args.batch_sizes, args.batch_size * (world_size if args.compare_dp else 1))


def needed_bytes(args: argparse.Namespace, world_size: int, most: int) -> int:
    """About what measure() needs on each process. The data: every rank draws the whole training set
    (2 of the largest batches per rank) before it keeps its shard, float32 features and target, and as
    much again while they are drawn. The models: about 20 configurations, each with its weights,
    gradients, buckets and Adam's two moments. The activations of the largest batch: forward keeps
    every layer's output for backward, and backward makes as much again."""
    model = build_model(args.model)
    data = (world_size * most * 2 + VAL_SIZE) * (FEATURES + 1) * 4 * 2
    widths = sum(layer.out_features for layer in model.modules() if isinstance(layer, torch.nn.Linear))
    return data + 20 * 5 * gradient_bytes(model) + most * widths * 4 * 2 * 2


def launch_time() -> float | None:
    """When torchrun started, as a wall-clock time: its workers are its own children, so this is the
    start of this process's parent. None where the parent is not a torchrun agent."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    try:
        with open(f"/proc/{os.getppid()}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime: ticks since boot
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


# ---- The measurement ----

def measure(args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
            launched: float | None) -> tuple[dict, Callable]:
    """Warm up and time every configuration; return the report (the same on every rank) and a function
    that takes one step of the default configuration (for the trace)."""
    joined = time.time()
    most = largest_batch(args, world_size)
    train_set, _ = make_datasets(train_size=world_size * most * 2, val_size=0)
    # The same validation samples whatever the sizes of the run: the first ones drawn after one sample.
    _, val_set = make_datasets(train_size=1, val_size=VAL_SIZE)
    # This rank's shard, on the device before any clock starts.
    x_train, y_train = (t[rank::world_size].to(device) for t in train_set.tensors)
    x_val, y_val = (t.to(device) for t in val_set.tensors)
    variants = build_variants(args, rank, device)
    if "DataParallel" in {name for _, name, _ in plan(args, world_size, device)} and rank == 0:
        torch.manual_seed(0)
        model = torch.nn.DataParallel(build_model(args.model).to(device), device_ids=list(range(world_size)))
        variants["DataParallel"] = Variant(model, torch.optim.Adam(model.parameters(), lr=args.lr))
    steps_taken = dict.fromkeys(variants, 0)
    buffers: list[torch.Tensor] = []  # the all-reduce alone's, once the buckets are known

    def run(name: str, size: int, steps: int) -> float:
        """Seconds per optimizer step over `steps` steps of one configuration, on this rank (0 if this
        rank sits the configuration out)."""
        if name != "all-reduce alone" and name not in variants:
            return 0.0
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            if name == "all-reduce alone":
                # Started all at once, then awaited, as DDP starts each bucket's as soon as it is ready.
                for work in [dist.all_reduce(buffer, async_op=True) for buffer in buffers]:
                    work.wait()
                continue
            first = (steps_taken[name] * size) % (len(x_train) - size + 1)  # a new slice at every step
            train_step(variants[name], x_train[first:first + size], y_train[first:first + size], device)
            steps_taken[name] += 1
        sync(device)
        return (time.perf_counter() - start) / steps

    configs = plan(args, world_size, device)
    if rank == 0:  # minutes of silence otherwise
        sys.stderr.write(f"bench_ddp.py: {len(configs)} configurations, {args.warmup} warm-up steps each, then "
                         f"{args.rounds} rounds of {args.steps} timed steps\n")
    run("all ranks", args.batch_sizes[0], 1)
    first_step = time.time()
    for _, name, size in configs:  # warm-up: DDP lays out its buckets, PowerSGD starts compressing
        dist.barrier()  # a one-rank configuration runs while the other ranks wait here
        if name != "all-reduce alone":
            run(name, size, args.warmup)
    # The counting hook saw the buckets of the last warm-up step; the all-reduce alone sends the same.
    bucket_bytes = list(variants[f"accumulate {ACCUMULATION}, no_sync"].bucket_sizes)
    buffers += [torch.ones(size // 4, device=device) for size in bucket_bytes]  # float32 gradients
    run("all-reduce alone", 0, args.warmup)

    seconds = torch.zeros(args.rounds, len(configs) + 3, dtype=torch.float64)
    split = variants["compute split"]
    for r in range(args.rounds):
        for i, (_, name, size) in enumerate(configs):
            dist.barrier()  # every rank starts the clock together
            split.phases.update(dict.fromkeys(split.phases, 0.0))
            seconds[r, i] = run(name, size, args.steps)
            if name == "compute split":
                seconds[r, len(configs):] = torch.tensor(list(split.phases.values())) / args.steps
    # A step takes as long as its slowest rank; a rank that sat a configuration out adds 0.
    seconds = seconds.to(device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    by_key = {key: seconds[:, i].tolist() for i, (key, _, _) in enumerate(configs)}
    forward, backward, optimizer = (seconds[:, len(configs) + j].tolist() for j in range(3))

    with torch.no_grad():  # every rank holds the same replicas, so every rank computes the same losses
        losses = {name: F.mse_loss(variants[name].model.module(x_val), y_val).item() for name in knob_names(device)}
        torch.manual_seed(0)
        initial_loss = F.mse_loss(build_model(args.model).to(device)(x_val), y_val).item()
    startup = torch.tensor([joined - launched, first_step - launched] if launched else [0.0, 0.0],
                           dtype=torch.float64, device=device)
    dist.all_reduce(startup, op=dist.ReduceOp.MAX)  # the job is as far as its last rank

    def ms(values: list[float]) -> dict:
        return spread([value * 1e3 for value in values])

    default = variants["default"].model.module
    report = {
        "backend": args.backend, "world_size": world_size, "threads_per_rank": torch.get_num_threads(),
        "machine": machine_line(device), "model": args.model,
        "parameters": sum(p.numel() for p in default.parameters()),
        "gradient_bytes": gradient_bytes(default),
        "bucket_bytes": bucket_bytes, "batch_size": args.batch_size, "batch_sizes": args.batch_sizes,
        "warmup": args.warmup, "steps": args.steps, "rounds": args.rounds,
        "step_ms": {key: ms(values) for key, values in by_key.items()},
        # Every round's times, from which every figure below can be recomputed.
        "rounds_ms": {key: [value * 1e3 for value in values] for key, values in
                      {**by_key, "forward": forward, "backward": backward, "optimizer": optimizer}.items()},
        "overhead": per_round(overhead, by_key["plain"], by_key["one rank"]),
        "scaling": [{
            "batch": size,
            "overhead": per_round(overhead, by_key[f"plain@{size}"], by_key[f"one rank@{size}"]),
            "samples_per_s": per_round(lambda t, s=size: world_size * s / t, by_key[f"all ranks@{size}"]),
            "efficiency": per_round(efficiency, by_key[f"one rank@{size}"], by_key[f"all ranks@{size}"]),
            # Why it falls short: the ranks' compute is slower side by side than alone (contention), and
            # the step pays the all-reduce that backward does not hide. efficiency = contention × communication.
            "contention": per_round(efficiency, by_key[f"one rank@{size}"], by_key[f"compute alone@{size}"]),
            "communication": per_round(efficiency, by_key[f"compute alone@{size}"], by_key[f"all ranks@{size}"]),
        } for size in args.batch_sizes],
    }
    rounds = [overlap(*times) for times in zip(by_key["default"], forward, backward, optimizer,
                                                 by_key["all-reduce alone"], strict=True)]
    report["overlap"] = {
        "step_ms": ms(by_key["default"]), "all_reduce_ms": ms(by_key["all-reduce alone"]),
        "forward_ms": ms(forward), "backward_ms": ms(backward), "optimizer_ms": ms(optimizer),
        **{f"{key}_ms": ms([row[key] for row in rounds]) for key in ("compute", "no_overlap", "perfect_overlap")},
        # One rank has nothing to all-reduce, and so nothing to hide.
        "hidden": spread([row["hidden"] for row in rounds]) if world_size > 1 else None,
        "busbw_GBps": (2 * (world_size - 1) / world_size * sum(bucket_bytes) / 1e9
                       / statistics.median(by_key["all-reduce alone"])),
        "predicted_all_reduce_ms": (predicted_all_reduce(bucket_bytes, world_size, args.busbw) * 1e3
                                    if args.busbw else None),
    }
    report["initial_loss"] = initial_loss  # the validation loss before any step, for the losses below
    report["knobs"] = []
    for name in knob_names(device):
        row = {"name": name, "ratio": per_round(lambda t, d: t / d, by_key[name], by_key["default"]),
               "step_ms": ms(by_key[name]), "loss": losses[name], "loss_vs_default": losses[name] / losses["default"],
               "optimizer_steps": steps_taken[name]}
        if name.startswith("PowerSGD") and device.type == "cpu":
            row["note"] = "one bucket (gloo: see build_variants)"
        if variants[name].micro_batches > 1:  # counted by the hook on the last step
            row["all_reduces_per_step"] = len(variants[name].bucket_sizes)
            row["buckets"] = len(bucket_bytes)
        report["knobs"].append(row)
    storages, saved = grad_storages(default)
    view_storages, _ = grad_storages(variants["gradient_as_bucket_view"].model.module)
    # With the view the gradients live inside DDP's buckets, which exist either way: the separate
    # gradient tensors of the default are what it saves.
    report["gradient_as_bucket_view"] = {"grad_storages_default": storages, "grad_storages_view": view_storages,
                                         "saved_bytes": saved if view_storages <= len(bucket_bytes) else 0}
    report["startup"] = ({"launch_to_join_s": startup[0].item(), "launch_to_first_step_s": startup[1].item()}
                         if launched else None)
    report["not_timed"] = [why for why in (powersgd_runs(device),) if why]
    if "DataParallel" in by_key:
        report["compare_dp"] = {
            "gpus": world_size, "batch_per_gpu": args.batch_size,
            "data_parallel_ms": ms(by_key["DataParallel"]), "ddp_ms": ms(by_key["DDP"]),
            "ddp_speedup": per_round(lambda dp, ddp: dp / ddp, by_key["DataParallel"], by_key["DDP"]),
        }
    elif args.compare_dp:
        report["compare_dp"] = data_parallel_gpus(world_size)
    return report, lambda: run("default", args.batch_size, 1)


def finite(value):
    """The report with every nan or infinity (a loss that diverged, say) as None: JSON has no NaN."""
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [finite(item) for item in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def gradient_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def grad_storages(model: torch.nn.Module) -> tuple[int, int]:
    """(how many distinct storages hold the gradients, their bytes)."""
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters() if p.grad is not None}
    return len(storages), sum(storages.values())


def machine_line(device: torch.device) -> str:
    from bench_comm import machine
    return machine(device)


# ---- What comes out: tables, JSON, pictures ----

def print_tables(report: dict) -> None:
    line = common.print_line
    n, b = report["world_size"], report["batch_size"]
    line(f"# bench_ddp.py: {report['backend']}, {n} ranks × {report['threads_per_rank']} thread(s), model "
         f"{report['model']} ({report['parameters']:,} parameters, {report['gradient_bytes'] / 1e6:.1f} MB of "
         f"gradients in {len(report['bucket_bytes'])} buckets), {report['rounds']} rounds × {report['steps']} "
         f"timed steps ({report['warmup']} warm-up) per configuration")
    line(f"# {report['machine']}")
    line("# a figure: median [min, max] over the rounds of the figure computed within each round; a time: the median "
         "over the rounds of ms per optimizer step, the slowest rank's. Medians of different rounds: a figure is not "
         "the ratio of the medians beside it")

    def fig(s: dict, form: str = "{:.3f}") -> str:
        return f"{form.format(s['median'])} [{form.format(s['min'])}, {form.format(s['max'])}]"

    step = report["step_ms"]
    line(f"overhead of DDP at one rank, batch {b}: {fig(report['overhead'], '{:.1%}')} "
         f"(median steps: plain {step['plain']['median']:.2f} ms, DDP {step['one rank']['median']:.2f} ms)")
    line(f"# weak scaling at {n} ranks: efficiency = contention × communication, in each round")
    line(f"# {'batch':>6} {'plain':>8} {'overhead':>8} {'one rank':>9} {'all ranks':>9} {'compute':>9} "
         f"{'samples/s':>10}  {'efficiency':<22} {'contention':>10} {'communication':>13}")
    for row in report["scaling"]:
        size = row["batch"]
        line(f"  {size:>6} {step[f'plain@{size}']['median']:>8.2f} {row['overhead']['median']:>8.1%} "
             f"{step[f'one rank@{size}']['median']:>9.2f} {step[f'all ranks@{size}']['median']:>9.2f} "
             f"{step[f'compute alone@{size}']['median']:>9.2f} {row['samples_per_s']['median']:>10.0f}  "
             f"{fig(row['efficiency']):<22} {row['contention']['median']:>10.3f} "
             f"{row['communication']['median']:>13.3f}")
    o = report["overlap"]
    line(f"# overlap at batch {b} (ms): compute (forward + backward + optimizer, in each round), the all-reduce "
         "alone, the step")
    line(f"  forward {o['forward_ms']['median']:.2f}, backward {o['backward_ms']['median']:.2f}, optimizer "
         f"{o['optimizer_ms']['median']:.2f}: compute {o['compute_ms']['median']:.2f}; all-reduce alone "
         f"{o['all_reduce_ms']['median']:.2f} (busbw {o['busbw_GBps']:.2f} GB/s"
         + (f", predicted {o['predicted_all_reduce_ms']:.2f}" if o["predicted_all_reduce_ms"] is not None else "")
         + ")")
    line(f"  step {o['step_ms']['median']:.2f}: no overlap would be {o['no_overlap_ms']['median']:.2f}, perfect "
         f"overlap {o['perfect_overlap_ms']['median']:.2f}; "
         + (f"hidden {fig(o['hidden'], '{:.0%}')} of the all-reduce" if o["hidden"] else "one rank: nothing to hide"))
    line(f"# knobs at batch {b}, all ranks: step time over the default's, and the validation loss after "
         f"{report['knobs'][0]['optimizer_steps']} optimizer steps ({report['initial_loss']:.4f} before the first)")
    line(f"# {'configuration':<28} {'ms':>8}  {'ratio':<22} {'loss':>8} {'vs default':>10}  all-reduces per step")
    for row in report["knobs"]:
        counts = (f"  {row['all_reduces_per_step']} ({row['buckets']} buckets)" if "all_reduces_per_step" in row
                  else f"  {row['note']}" if "note" in row else "")
        line(f"  {row['name']:<28} {row['step_ms']['median']:>8.2f}  {fig(row['ratio']):<22} {row['loss']:>8.4f} "
             f"{row['loss_vs_default']:>10.3f}{counts}")
    for why in report["not_timed"]:
        line(why)
    view = report["gradient_as_bucket_view"]
    line(f"gradient_as_bucket_view: gradients in {view['grad_storages_view']} storages (the buckets) instead of "
         f"{view['grad_storages_default']}: {view['saved_bytes'] / 1e6:.1f} MB saved per rank")
    if report["startup"]:
        s = report["startup"]
        line(f"start-up: launch to joined {s['launch_to_join_s']:.2f} s, to the first step "
             f"{s['launch_to_first_step_s']:.2f} s (python bench_ddp.py --startup N times whole jobs)")
    dp = report.get("compare_dp")
    if isinstance(dp, str):
        line(dp)
    elif dp:
        line(f"DataParallel over {dp['gpus']} GPUs {dp['data_parallel_ms']['median']:.2f} ms, DDP "
             f"{dp['ddp_ms']['median']:.2f} ms per step of {dp['batch_per_gpu']} per GPU: DDP "
             f"{fig(dp['ddp_speedup'], '{:.2f}')} times as fast")


def import_pyplot():
    """matplotlib's pyplot, drawing to files only; or one line on how to install it, and exit 2."""
    try:
        import matplotlib
    except ImportError:
        common.die(f"--plot needs matplotlib, an optional extra: {PLOT_EXTRA}")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(report: dict, path: str) -> None:
    """Left: weak-scaling efficiency against the batch per rank. Right: each knob's step time over the
    default's. Bars and whiskers: median, min and max over the rounds."""
    plt = import_pyplot()
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    batches = [row["batch"] for row in report["scaling"]]
    for key, label in (("efficiency", "efficiency = contention × communication"),
                       ("contention", "contention: one rank alone / all ranks computing"),
                       ("communication", "communication: compute alone / step")):
        medians = [row[key]["median"] for row in report["scaling"]]
        errors = [[m - row[key]["min"] for m, row in zip(medians, report["scaling"], strict=True)],
                  [row[key]["max"] - m for m, row in zip(medians, report["scaling"], strict=True)]]
        left.errorbar(batches, medians, yerr=errors, marker="o", capsize=3, label=label,
                      linewidth=2 if key == "efficiency" else 1)
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    left.set_ylim(0, max(1.1, *(row[key]["max"] * 1.05 for row in report["scaling"]
                                for key in ("efficiency", "contention", "communication"))))
    left.set_xlabel("batch per rank (samples)")
    left.set_title(f"weak scaling, {report['world_size']} ranks ({report['backend']})")
    left.legend(loc="lower right", fontsize=8)
    knobs = report["knobs"]
    medians = [row["ratio"]["median"] for row in knobs]
    errors = [[m - row["ratio"]["min"] for m, row in zip(medians, knobs, strict=True)],
              [row["ratio"]["max"] - m for m, row in zip(medians, knobs, strict=True)]]
    positions = list(range(len(knobs)))[::-1]
    right.barh(positions, medians, xerr=errors, capsize=3, color="tab:blue")
    right.axvline(1.0, color="grey", linewidth=0.8)
    right.set_yticks(positions, [row["name"] for row in knobs], fontsize=8)
    right.set_xlabel(f"step time / default's (batch {report['batch_size']} per rank)")
    right.set_title("DDP's knobs")
    figure.suptitle(f"bench_ddp.py, model {report['model']}: {report['machine']}", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def trace_lanes(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """From a torch.profiler chrome trace, the spans (start, end in ms from the first) of forward,
    backward, optimizer step and all-reduce, the lanes of the picture."""
    lanes = {"forward": [], "backward": [], "optimizer": [], "all-reduce": []}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    for e in events:
        name = e["name"]
        if name.startswith("DistributedDataParallel.forward"):
            lane = "forward"
        elif name.startswith("autograd::engine::evaluate_function"):
            lane = "backward"
        elif name.startswith("Optimizer.step"):
            lane = "optimizer"
        elif name in ("gloo:all_reduce", "nccl:all_reduce") or name.startswith("ncclDevKernel_AllReduce"):
            lane = "all-reduce"  # the backend's own span (on gloo's thread, or the GPU kernel), not the enqueue
        else:
            continue
        lanes[lane].append((e["ts"], e["ts"] + e["dur"]))
    origin = min(start for spans in lanes.values() for start, _ in spans)
    return {lane: [((s - origin) / 1e3, (t - origin) / 1e3) for s, t in spans] for lane, spans in lanes.items()}


def draw_trace(trace_path: str, png_path: str) -> None:
    """A timeline of the traced steps on one rank: where the all-reduces run against backward."""
    plt = import_pyplot()
    with open(trace_path) as f:
        lanes = trace_lanes(json.load(f))
    figure, axes = plt.subplots(figsize=(9, 2.2))
    colours = {"forward": "tab:green", "backward": "tab:orange", "optimizer": "tab:purple", "all-reduce": "tab:blue"}
    for y, (lane, spans) in enumerate(reversed(list(lanes.items()))):
        axes.broken_barh([(s, t - s) for s, t in spans], (y - 0.4, 0.8), color=colours[lane])
    axes.set_yticks(range(len(lanes)), list(reversed(lanes)))
    axes.set_xlabel("ms")
    axes.set_title(f"{os.path.basename(trace_path)}: {TRACE_STEPS} DDP steps", fontsize=9)
    figure.tight_layout()
    figure.savefig(png_path, dpi=70)
    plt.close(figure)


def write_trace(folder: str, rank: int, device: torch.device, step: Callable[[], float]) -> str:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as profiler:
        for _ in range(TRACE_STEPS):
            step()
    path = os.path.join(folder, f"rank{rank}.json")
    profiler.export_chrome_trace(path)
    return path


# ---- Start-up: whole jobs against their floors ----

def first_step() -> None:
    """What every training process pays before it trains: a model, a torch.optim optimizer (whose first
    use imports torch._dynamo) and one DDP step. The DDP wrapper is freed on return, before the process
    group is destroyed: freed after it, gloo's teardown can wait for ever on the GIL (torch 2.13)."""
    torch.manual_seed(0)
    model = DDP(build_model("mlp"))
    optimizer = torch.optim.Adam(model.parameters())
    F.mse_loss(model(torch.randn(32, FEATURES)), torch.zeros(32, 1)).backward()
    optimizer.step()


def floor_worker(kind: str) -> None:
    """A torchrun worker that joins and leaves ("join"), or that also takes a first step ("step")."""
    rank, _, world_size = common.launcher_env() or common.die("the floor workers are started by --startup")
    common.exit_promptly_on_signals(launcher=common.PARENT_AT_START)  # as the training scripts do
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        if kind == "step":
            first_step()
        dist.barrier()  # no worker leaves before every worker has joined (and stepped): the job's whole cost
    finally:
        dist.destroy_process_group()


def time_startup(workers: int, rounds: int, as_json: bool) -> None:
    """Wall time of whole torchrun jobs, in turn: the two floors and the flagship command."""
    here = os.path.dirname(os.path.abspath(__file__))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers)]
    jobs = {"join and leave": [*torchrun, os.path.join(here, "bench_ddp.py"), "--floor", "join"],
            "first step": [*torchrun, os.path.join(here, "bench_ddp.py"), "--floor", "step"],
            "singlenode_cpu.py": [*torchrun, os.path.join(here, "singlenode_cpu.py")]}
    seconds = {name: [] for name in jobs}
    # Stopped, this process stops the job it is timing first: torchrun ends its workers on SIGTERM.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for _ in range(rounds):
        for name, command in jobs.items():
            start = time.perf_counter()
            try:
                done = subprocess.run(command, capture_output=True, text=True,
                                      env=os.environ | {"PYTHONUNBUFFERED": "1"})
            except KeyboardInterrupt:  # Ctrl-C reached the job too: it stops by itself
                common.die(f"stopped by Ctrl-C during the {name} job", code=130)
            seconds[name].append(time.perf_counter() - start)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                common.die(f"the {name} job of {workers} workers failed (exit {done.returncode}): {tail}")
    report = {"workers": workers, "rounds": rounds, "machine": machine_line(torch.device("cpu")),
              "seconds": {name: spread(values) for name, values in seconds.items()},
              **{f"flagship_over_{floor.replace(' ', '_')}": per_round(lambda a, b: a / b, seconds["singlenode_cpu.py"],
                                                                       seconds[floor])
                 for floor in ("join and leave", "first step")}}
    if as_json:
        common.print_line(json.dumps(report, indent=1))
    else:
        print_startup(report)


def print_startup(report: dict) -> None:
    common.print_line(f"# start-up: torchrun --standalone --nproc-per-node {report['workers']}, wall seconds of the "
                      f"whole job, median [min, max] of {report['rounds']} rounds; {report['machine']}")
    for name, s in report["seconds"].items():
        common.print_line(f"  {name:<28} {s['median']:6.2f} [{s['min']:.2f}, {s['max']:.2f}]")
    for key in ("flagship_over_join_and_leave", "flagship_over_first_step"):
        s = report[key]
        common.print_line(f"  {key.replace('_', ' '):<28} {s['median']:6.2f} [{s['min']:.2f}, {s['max']:.2f}]")


def check_at_start(args: argparse.Namespace, world_size: int, procs_on_node: int) -> None:
    """What would fail at the end, or cannot be done here, is said before the measuring starts, by one
    process per node (the others exit with the same status, quietly)."""
    def refuse(message: str) -> None:
        if int(os.environ["LOCAL_RANK"]) != 0:
            sys.exit(2)
        common.die(message)

    if args.plot:
        if not importable("matplotlib"):
            refuse(f"--plot needs matplotlib, an optional extra: {PLOT_EXTRA}")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            refuse(f"--plot {args.plot}: {folder} is not a writable folder")
        if os.path.isdir(args.plot):
            refuse(f"--plot {args.plot} is a folder: name a .png file")
    if args.trace:
        try:
            os.makedirs(args.trace, exist_ok=True)
        except OSError as exc:
            refuse(f"--trace {args.trace}: cannot create the folder: {exc.strerror}")
        if not os.access(args.trace, os.W_OK):
            refuse(f"--trace {args.trace}: the folder is not writable")
    most = largest_batch(args, world_size)
    if int(os.environ["LOCAL_RANK"]) == 0:  # the others are stopped by torchrun if this one stops
        common.check_memory(needed_bytes(args, world_size, most) * procs_on_node,
                            f"batches of up to {most} samples on {procs_on_node} process(es)")
    if args.compare_dp and data_parallel_gpus(world_size) and int(os.environ["RANK"]) == 0:
        sys.stderr.write(data_parallel_gpus(world_size) + "\n")  # said now, and in the report


def main() -> None:
    args = parse_args()
    if args.floor:
        floor_worker(args.floor)
        common.exit_now()  # as the training scripts end: the floor is what a process cannot avoid
    launched = common.launcher_env()  # None without a launcher; one line if its variables are incomplete
    if args.startup:
        if launched is not None:
            common.die("--startup launches torchrun jobs itself: run it with plain python, not under torchrun")
        time_startup(args.startup, args.rounds, args.json)
        return
    if launched is None:
        common.die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 bench_ddp.py "
                   "(or time start-up with python bench_ddp.py --startup 8)")
    rank, local_rank, world_size = launched
    procs_on_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if args.backend == "nccl":
        common.check_gpus(procs_on_node, "--nproc-per-node", "bench_ddp.py --backend gloo")
        torch.cuda.set_device(local_rank)  # before init_process_group, so the communicator is built on it
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        # Every process gets its share of the cores, one rank alone as many as each of N side by side.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // procs_on_node))
    check_at_start(args, world_size, procs_on_node)
    launched_at = launch_time()
    common.exit_promptly_on_signals(launcher=common.PARENT_AT_START)
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(args.backend, store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        dist.barrier()
        report, step = measure(args, rank, world_size, device, launched_at)
        trace = write_trace(args.trace, rank, device, step) if args.trace else None
        del step  # and with it every DDP wrapper, while the process group still exists (see first_step)
    finally:
        dist.destroy_process_group()
    if rank == 0:  # every rank holds the same report: one prints it
        if args.json:
            common.print_line(json.dumps(finite(report), indent=1))
        else:
            print_tables(report)
        if args.plot:
            plot(report, args.plot)
        if trace and importable("matplotlib"):
            draw_trace(trace, os.path.join(args.trace, "rank0.png"))


def importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
    common.exit_now()  # skips the interpreter's teardown of torch (see common)
