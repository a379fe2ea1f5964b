"""Tokens per second of train.py at several world sizes on one machine, and the scaling efficiency; or instead
what saving, the stop agreement, tp, cp, pp or (--host) a step's host work costs; or (--layouts) layouts side by side.

    python gpt/bench.py                                  # 1, 2 and 4 ranks of the tiny model on CPUs
    python gpt/bench.py --world_sizes 1 8 -- --model gpt2 --data DIR --seq_len 1024 --precision bf16
    python gpt/bench.py --world_sizes 2 --save_every 5      # what asynchronous checkpoints cost
    python gpt/bench.py --world_sizes 1 --resume            # a resumed run against a fresh one
    python gpt/bench.py --world_sizes 2 4 --stop_agreement  # what agreeing on a stop costs a step
    python gpt/bench.py --world_sizes 4 --tp 1 2 4          # fsdp 4, fsdp 2 × tp 2, tp 4: tokens/s and bytes
    python gpt/bench.py --world_sizes 4 --cp 1 2 4          # each cp method: tokens/s, memory, the ring's wait
    python gpt/bench.py --world_sizes 2 --pp GPipe 1F1B ZBVZeroBubble -- --grad_accum 8  # the bubble, measured
    python gpt/bench.py --host                           # what a step costs the host, per layout
    python gpt/bench.py --world_sizes 1 --layouts ddp fsdp --repeats 6  # fsdp's tokens/s over ddp's, at 1 rank

Each world size runs train.py under torchrun `--repeats` times with the same per-rank batch (weak
scaling), in a temporary --out_dir, and reads tokens_per_s from its metrics.jsonl, leaving out the
first log interval (start-up, first steps). A run's figure is the median of its intervals; the
table gives the median of the runs with their min and max. Efficiency is tokens/s at N ranks over
N × tokens/s at one rank: 100% is perfect scaling. On a CPU each rank gets cores // N threads, so
the comparison is fair; on GPUs each rank has its own device. Arguments after `--` go to train.py.
--stop_agreement times instead a step of the model's own compute (no gradient all-reduce: the
agreement's cost is not hidden behind it) alone, with a blocking all-reduce of the stop flag after
every step (how train.py agreed before), and with stop.StopRequest's (train.py's): asynchronous, about once a second.
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import context
import pipeline

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = ["--max_steps", "60", "--log_every", "10", "--eval_every", "1000000", "--val_tokens", "64",
            "--save_every", "0"]


def run(world_size: int, train_args: list[str], threads: int, out_dir: str | None = None,
        after: int = 0, script: str = "train.py") -> list[float]:
    """tokens_per_s of each log interval past step `after` but the first (start-up, first steps), of
    one run in `out_dir` (a fresh folder if None); `script`: train.py, or one that runs its main()."""
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = out_dir or scratch
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(world_size), os.path.join(HERE, script), *DEFAULTS, *train_args, "--out_dir", out_dir]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:  # train.py's own line if it said one, else the end of the traceback
            said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
            raise SystemExit(f"error: {world_size} ranks failed: {said[0][7:]}" if said else
                             f"error: {world_size} ranks failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as file:
            records = [json.loads(line) for line in file]
    figures = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > after][1:]
    if not figures:
        raise SystemExit("error: fewer than two log intervals: raise --max_steps or lower --log_every")
    return figures


def stop_worker(steps: int, repeats: int) -> None:
    """Under torchrun: each rank's mean time of a step of the tiny model's forward, backward and AdamW
    step, alone and then with each way to agree on a stop; rank 0 prints the slowest rank's as JSON."""
    sys.path.insert(0, HERE)
    from model import CONFIGS, GPT, GPTConfig
    from stop import StopRequest

    dist.init_process_group("gloo")
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, **CONFIGS["tiny"]))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(dist.get_rank()))
    times = {"alone": [], "blocking": [], "async": []}
    for _ in range(repeats):
        for way in times:  # interleaved: a drift in the machine's speed touches every way alike
            stop = None if way == "alone" else StopRequest(60.0, blocking=way == "blocking")
            dist.barrier()
            started = time.perf_counter()
            for _ in range(steps):
                model(x, x).mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if stop:
                    stop.agreed()
            mean = torch.tensor((time.perf_counter() - started) / steps)
            if stop:
                stop.restore()
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # the job runs at its slowest rank's pace
            times[way].append(mean.item())
    if dist.get_rank() == 0:
        print("STOP " + json.dumps(times), flush=True)
    dist.destroy_process_group()


def stop_agreement(world_sizes: list[int], repeats: int, cores: int) -> None:
    steps = 200
    print(f"stop agreement: a step of the tiny model's compute ({steps} steps, slowest rank; median of {repeats}, "
          "min and max)")
    print(f"{'ranks':>5} {'step alone':>12} {'+ blocking all-reduce (before)':>32} {'+ StopRequest (after)':>30}")
    for world_size in world_sizes:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(world_size), os.path.abspath(__file__), "--stop_worker", str(steps), "--repeats", str(repeats)]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cores // world_size))}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"error: {world_size} ranks failed:\n{result.stderr[-2000:]}")
        times = json.loads(result.stdout.split("STOP ", 1)[1].splitlines()[0])
        alone = statistics.median(times["alone"])
        costs = [cost(times[way], times["alone"], alone) for way in ("blocking", "async")]
        print(f"{world_size:>5} {1e3 * alone:>9.2f} ms {costs[0]:>32} {costs[1]:>30}", flush=True)


def tensor_parallel(world_size: int, degrees: list[int], train_args: list[str], repeats: int, cores: int) -> None:
    """fsdp with each tp degree at one world size, on one global batch (--batch_size × tp per tp group): the
    tokens/s, and beside them what rank 0 holds and sends a step, as simulate.py counts them."""
    train_parser = argparse.ArgumentParser(add_help=False)  # train.py's defaults; the last one given wins
    for name, default in (("--batch_size", 8), ("--seq_len", 64), ("--vocab_size", None)):
        train_parser.add_argument(name, type=int, default=default)
    for name, default in (("--model", "mini"), ("--precision", "fp32"), ("--data", "synthetic")):  # mini: 4 heads
        train_parser.add_argument(name, default=default)
    known = train_parser.parse_known_args(train_args)[0]
    if known.vocab_size is None and known.data != "synthetic":
        raise SystemExit("error: --tp with --data: give train.py's --vocab_size too, for the bytes a rank holds")
    bad = [tp for tp in degrees if tp < 1 or world_size % tp]
    if bad:
        raise SystemExit(f"error: --tp {bad[0]} does not divide the {world_size} ranks")
    threads = 1 if torch.cuda.is_available() else max(1, cores // world_size)
    print(f"{'layout':>18} {'tokens/s (median)':>18} {'min':>10} {'max':>10} {'held per rank':>14} "
          f"{'sent per step':>14}")
    for tp in degrees:
        layout = ["--model", known.model, "--parallel", "fsdp", "--tp", str(tp), "--batch_size",
                  str(known.batch_size * tp)]
        runs = [statistics.median(run(world_size, [*train_args, *layout], threads)) for _ in range(repeats)]
        command = [sys.executable, os.path.join(HERE, "simulate.py"), "--ranks", str(world_size), *layout,
                   "--seq_len", str(known.seq_len), "--vocab_size", str(known.vocab_size or 64), "--precision",
                   known.precision, "--json"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"error: simulate.py at tp {tp}: {result.stderr.strip().splitlines()[-1]}")
        figures = json.loads(result.stdout)[0]
        name = f"fsdp {world_size // tp} × tp {tp}" if 1 < tp < world_size else f"tp {tp}" if tp > 1 else \
            f"fsdp {world_size}"
        print(f"{name:>18} {statistics.median(runs):>18,.0f} {min(runs):>10,.0f} {max(runs):>10,.0f} "
              f"{sum(figures['held'].values()) / 2**20:>10.2f} MiB {sum(figures['wire'].values()) / 2**20:>10.2f} MiB",
              flush=True)


def pipelined(world_size: int, schedules: list[str], train_args: list[str], repeats: int, cores: int,
              keep: str | None) -> None:
    """--pp at the world size with each schedule (fsdp, one pipeline, --model mini unless given: 4 blocks): the
    tokens/s, each pipeline rank's share of a step spent waiting (train.py's pp_wait: the median of the log
    intervals but the first, over the runs) beside its paper's formula, and the most micro-batches each stage
    held. keep: a folder for each schedule's pp_timeline.json (gpt/plot.py --pipeline draws them)."""
    train_parser = argparse.ArgumentParser(add_help=False)
    train_parser.add_argument("--model", default="mini")
    train_parser.add_argument("--grad_accum", type=int, default=8)
    known = train_parser.parse_known_args(train_args)[0]
    threads = 1 if torch.cuda.is_available() else max(1, cores // world_size)
    print(f"{'schedule':>22} {'tokens/s':>9} {'waited, measured, by rank':>26} {'formula':>8}  most micro-batches "
          "held, by stage")
    for schedule in schedules:
        speeds, waits = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as out_dir:
                layout = ["--model", known.model, "--grad_accum", str(known.grad_accum), "--parallel", "fsdp",
                          "--pp", str(world_size), "--pp_schedule", schedule]
                speeds.append(statistics.median(run(world_size, [*train_args, *layout], threads, out_dir)))
                with open(os.path.join(out_dir, "metrics.jsonl")) as file:
                    logged = [r for r in map(json.loads, file) if "pp_wait" in r][1:]
                waits.extend(r["pp_wait"] for r in logged)
                held = logged[-1]["pp_held"]
                if keep:
                    os.makedirs(keep, exist_ok=True)
                    shutil.copy(os.path.join(out_dir, "pp_timeline.json"), os.path.join(keep, f"{schedule}.json"))
        waited = " ".join(f"{statistics.median(w[r] for w in waits):.0%}" for r in range(world_size))
        formula = pipeline.bubble(schedule, world_size, known.grad_accum)
        print(f"{schedule:>22} {statistics.median(speeds):>9,.0f} {waited:>26} {formula:>8.0%}  "
              f"{' '.join(f'{s}:{held[s]}' for s in sorted(held, key=int))}", flush=True)


# --cp: one sequence of llama-mini's (8 heads, for ulysses at cp up to 8) a cp group, long enough that attention
# counts; train.py's arguments after -- come later and win
CP_SHAPE = ["--model", "llama-mini", "--seq_len", "1024", "--batch_size", "1", "--max_steps", "10", "--log_every", "2"]


def context_parallel(world_size: int, degrees: list[int], train_args: list[str], repeats: int, cores: int) -> None:
    """fsdp at one world size with each --cp degree and each method (cp 1: none), one sequence a cp group a step:
    each rank holds seq_len / cp of its tokens. The tokens/s, the largest rank's peak memory (on a CPU its resident
    set, torch's runtime included; on CUDA the most allocated), and under the ring the largest share of the time a
    rank waited for k and v (train.py's cp_wait): medians of the log intervals but the first, then of the runs."""
    threads = 1 if torch.cuda.is_available() else max(1, cores // world_size)
    print(f"{'layout':>24} {'tokens/s (median)':>18} {'min':>10} {'max':>10} {'peak memory':>12} {'cp wait':>8}")
    for cp in degrees:
        for method in context.METHODS if cp > 1 else [None]:
            layout = ["--parallel", "fsdp", *(["--cp", str(cp), "--cp_method", method] if method else [])]
            speeds, peaks, waits = [], [], []
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as out_dir:
                    speeds.append(statistics.median(run(world_size, [*CP_SHAPE, *train_args, *layout], threads,
                                                        out_dir)))
                    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
                        logged = [r for r in map(json.loads, file) if "tokens_per_s" in r][1:]
                peaks.append(max(r.get("peak_allocated_gib", r.get("peak_rss_gib", 0)) for r in logged))
                waits.extend(r["cp_wait"] for r in logged if "cp_wait" in r)
            name = f"fsdp {world_size // cp} × cp {cp} {method}" if method else f"fsdp {world_size}"
            wait = f"{statistics.median(waits):.0%}" if waits else "-"
            print(f"{name:>24} {statistics.median(speeds):>18,.0f} {min(speeds):>10,.0f} {max(speeds):>10,.0f} "
                  f"{statistics.median(peaks):>8.2f} GiB {wait:>8}", flush=True)


# --host: a model too small to compute anything (tiny, 8 tokens, one sequence): a step's time is what every step
# pays on the host (the launch, dispatch and hooks, the optimizer, clipping, data and bookkeeping), per layout
HOST_SHAPE = ["--model", "tiny", "--seq_len", "8", "--batch_size", "1"]
HOST_LAYOUTS = {"ddp": (1, []), "fsdp": (1, ["--parallel", "fsdp"]),
                "fsdp 1 × tp 2": (2, ["--parallel", "fsdp", "--tp", "2"]),
                "fsdp 1 × pp 2": (2, ["--parallel", "fsdp", "--pp", "2", "--grad_accum", "2"])}



def shown(argv: list[str]) -> str:
    """train.py's arguments as it reads them: each option once, where it first comes, with the last value given."""
    options, i = {}, 0
    while i < len(argv):
        lone = i + 1 == len(argv) or argv[i + 1].startswith("--")
        options[argv[i]] = [] if lone else [argv[i + 1]]
        i += 1 if lone else 2
    return " ".join(word for option, value in options.items() for word in (option, *value))

def host_cost(train_args: list[str], repeats: int, cores: int) -> None:
    """Each of HOST_LAYOUTS' step time on HOST_SHAPE, in ms: the median of a run's log intervals, then of the
    runs (interleaved, so that a drift in the machine's speed touches every layout alike), with min and max."""
    print(f"{'layout':>14} {'ranks':>5} {'ms per step (median)':>21} {'min':>7} {'max':>7}")
    times = {name: [] for name in HOST_LAYOUTS}
    for repeat in range(repeats):
        for name, (world_size, layout) in HOST_LAYOUTS.items():
            tokens = 8 * (2 if "--pp" in layout else 1)  # a step's tokens: the pipeline takes two micro-batches
            speeds = run(world_size, [*HOST_SHAPE, *layout, *train_args], max(1, cores // world_size))
            times[name].append(1e3 * tokens / statistics.median(speeds))
            if repeat == repeats - 1:
                print(f"{name:>14} {world_size:>5} {statistics.median(times[name]):>18.2f} ms {min(times[name]):>7.2f} "
                      f"{max(times[name]):>7.2f}", flush=True)


def compare_layouts(world_size: int, names: list[str], train_args: list[str], repeats: int, cores: int) -> None:
    """--layouts: each --parallel layout's tokens/s at `world_size` ranks, their runs interleaved (a drift in the
    machine's speed touches each alike), and its ratio to the first layout's in the same round of runs: the
    median of the rounds' ratios, with min and max."""
    threads = 1 if torch.cuda.is_available() else max(1, cores // world_size)
    speeds = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            speeds[name].append(statistics.median(run(world_size, [*train_args, "--parallel", name], threads)))
    print(f"{'layout':>8} {'tokens/s (median)':>18} {'min':>10} {'max':>10}  {'÷ ' + names[0]:>8} "
          "(min to max, per round)")
    for name in names:
        ratios = sorted(s / b for s, b in zip(speeds[name], speeds[names[0]], strict=True))
        print(f"{name:>8} {statistics.median(speeds[name]):>18,.0f} {min(speeds[name]):>10,.0f} "
              f"{max(speeds[name]):>10,.0f}  {statistics.median(ratios):>8.2f} ({ratios[0]:.2f} to {ratios[-1]:.2f})",
              flush=True)


def cost(with_it: list[float], without: list[float], alone: float) -> str:
    """The median extra time per step, in us and as a share of a step alone, [min, max]."""
    extra = sorted(1e6 * (t - a) for t, a in zip(with_it, without, strict=True))
    return (f"{statistics.median(extra):+.0f} us ({statistics.median(extra) / (1e4 * alone):+.1f}%) "
            f"[{extra[0]:+.0f}, {extra[-1]:+.0f}]")


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} × {torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4], help="ranks per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per world size (--host: per layout; --layouts: rounds)")
    parser.add_argument("--save_every", type=int, help="also run each world size with checkpoints this often, and "
                                                        "print what the saves cost")
    parser.add_argument("--resume", action="store_true", help="also compare a run resumed at its --max_steps (60) "
                                                              "with the same steps of a fresh run")
    parser.add_argument("--stop_agreement", action="store_true", help="instead: what agreeing on a stop costs a "
                                                                      "step, the old way and train.py's")
    parser.add_argument("--tp", type=int, nargs="+", help="instead: fsdp with each of these tp degrees at the last of "
                                                          "--world_sizes,\non one global batch, and what each rank "
                                                          "holds and sends (simulate.py)")
    parser.add_argument("--cp", type=int, nargs="+", help="instead: fsdp with each of these cp degrees (each method) "
                        "at the last of --world_sizes,\none sequence of llama-mini's 1,024 tokens a cp group a step")
    parser.add_argument("--pp", nargs="+", choices=pipeline.SCHEDULES, help="instead: --pp at the last of "
                        "--world_sizes with each of these schedules:\nthe time each stage waits, against the "
                        "formula, and the micro-batches it holds")
    parser.add_argument("--host", action="store_true", help="instead: the host's time per step of ddp and fsdp at 1 "
                        "rank, fsdp 1 × tp 2 and\nfsdp 1 × pp 2 at 2, on a model too small to compute anything "
                        "(tiny, one sequence\nof 8 tokens); --world_sizes is not used. Each row prints when its "
                        "last run ends;\nabout 20 s a run on 2 idle cores")
    parser.add_argument("--layouts", nargs="+", choices=["ddp", "fsdp", "hsdp"], help="instead: these --parallel "
                        "layouts at the first of --world_sizes, their\nruns interleaved, and each one's tokens/s "
                        "over the first's")
    parser.add_argument("--timelines", help="with --pp: keep each schedule's pp_timeline.json in this folder")
    parser.add_argument("--stop_worker", type=int, help=argparse.SUPPRESS)  # stop_agreement's ranks, under torchrun
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: train.py's own arguments")
    args = parser.parse_args()
    if any(n < 1 for n in args.world_sizes) or args.repeats < 1 or (args.save_every or 1) < 1:
        parser.error("--world_sizes, --repeats and --save_every must be at least 1")
    if args.layouts and (len(set(args.layouts)) < len(args.layouts) or args.host or args.tp or args.cp or args.pp or
                         args.stop_agreement or args.save_every or args.resume):
        parser.error("--layouts names each layout once, and runs alone (not with --host, --tp, --cp, --pp, "
                     "--stop_agreement, --save_every or --resume)")
    if args.cp and any(cp < 1 or args.world_sizes[-1] % cp for cp in args.cp):
        parser.error(f"--cp: each degree must divide the {args.world_sizes[-1]} ranks (the last of --world_sizes)")
    if args.pp and args.world_sizes[-1] < 2:
        parser.error("--pp runs one pipeline over the last of --world_sizes: it must be 2 or more")
    if args.stop_worker:
        return stop_worker(args.stop_worker, args.repeats)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    train_parser = argparse.ArgumentParser(add_help=False)
    train_parser.add_argument("--max_steps", type=int)  # train.py's, as it reads them: the last one given wins
    steps = train_parser.parse_known_args([*DEFAULTS, *train_args])[0].max_steps
    cores = os.cpu_count() or 1
    print(f"machine: {machine()}")
    if args.stop_agreement:
        return stop_agreement(args.world_sizes, args.repeats, cores)
    if args.host:
        print(f"train.py {shown(DEFAULTS + HOST_SHAPE + train_args)}, each layout interleaved, {args.repeats} runs")
        return host_cost(train_args, args.repeats, cores)
    if args.layouts:
        print(f"train.py {shown(DEFAULTS + train_args)} --parallel LAYOUT on {args.world_sizes[0]} "
              f"rank{'s' if args.world_sizes[0] > 1 else ''}, each layout interleaved, {args.repeats} runs")
        return compare_layouts(args.world_sizes[0], args.layouts, train_args, args.repeats, cores)
    if args.pp:
        print(f"train.py {shown(DEFAULTS + train_args)} on {args.world_sizes[-1]} ranks: --model mini and "
              "--grad_accum 8 unless given, --parallel fsdp --pp N (one pipeline)")
        return pipelined(args.world_sizes[-1], args.pp, train_args, args.repeats, cores, args.timelines)
    if args.cp:
        print(f"train.py {shown(DEFAULTS + CP_SHAPE + train_args)} --parallel fsdp --cp N --cp_method M on "
              f"{args.world_sizes[-1]} ranks, {args.repeats} run{'s' if args.repeats > 1 else ''} each")
        return context_parallel(args.world_sizes[-1], args.cp, train_args, args.repeats, cores)
    if args.tp:
        print(f"train.py {shown(DEFAULTS + train_args)} on {args.world_sizes[-1]} ranks: --model mini unless "
              "given, --parallel fsdp --tp T, T × --batch_size per tp group (one global batch)")
        return tensor_parallel(args.world_sizes[-1], args.tp, train_args, args.repeats, cores)
    print(f"train.py {shown(DEFAULTS + train_args)}")
    print(f"{'ranks':>5} {'threads':>7} {'tokens/s (median)':>18} {'min':>10} {'max':>10} {'per rank':>10} "
          f"{'efficiency':>10}")
    base = None
    for world_size in args.world_sizes:
        threads = 1 if torch.cuda.is_available() else max(1, cores // world_size)
        runs = [statistics.median(run(world_size, train_args, threads)) for _ in range(args.repeats)]
        median = statistics.median(runs)
        base = base or (median / world_size if world_size == 1 else None)
        efficiency = f"{median / (world_size * base):.0%}" if base else "-"
        print(f"{world_size:>5} {threads:>7} {median:>18,.0f} {min(runs):>10,.0f} {max(runs):>10,.0f} "
              f"{median / world_size:>10,.0f} {efficiency:>10}", flush=True)
        if args.save_every:  # the same runs with a checkpoint every N steps, interleaved with plain ones
            pairs = [(statistics.median(run(world_size, [*train_args, "--save_every", "0"], threads)),
                      statistics.median(run(world_size, [*train_args, "--save_every", str(args.save_every)], threads)))
                     for _ in range(args.repeats)]
            costs = sorted(1 - saving / plain for plain, saving in pairs)
            print(f"{'':>5} saving every {args.save_every} steps: {statistics.median(s for _, s in pairs):,.0f} "
                  f"tokens/s against {statistics.median(p for p, _ in pairs):,.0f} in the runs beside them, "
                  f"{statistics.median(costs):.1%} slower (min {costs[0]:.1%}, max {costs[-1]:.1%})", flush=True)
        if args.resume:  # steps s + 1 to 2s after a resume from step s, and in a run that never stopped
            pairs = []
            for _ in range(args.repeats):
                with tempfile.TemporaryDirectory() as out_dir:
                    run(world_size, train_args, threads, out_dir)
                    resumed = run(world_size, [*train_args, "--max_steps", str(2 * steps)], threads, out_dir,
                                  after=steps)
                fresh = run(world_size, [*train_args, "--max_steps", str(2 * steps)], threads, after=steps)
                pairs.append((statistics.median(resumed), statistics.median(fresh)))
            print(f"{'':>5} resumed at step {steps}: {statistics.median(r for r, _ in pairs):,.0f} tokens/s against "
                  f"{statistics.median(f for _, f in pairs):,.0f} for the same steps of a fresh run", flush=True)


if __name__ == "__main__":
    main()
