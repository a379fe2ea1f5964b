"""Tokens per second of train.py at several world sizes on one machine, and the scaling efficiency.

    python gpt/bench.py                                  # 1, 2 and 4 ranks of the tiny model on CPUs
    python gpt/bench.py --world_sizes 1 8 -- --model gpt2 --data DIR --seq_len 1024 --precision bf16
    python gpt/bench.py --world_sizes 2 --save_every 5      # what asynchronous checkpoints cost
    python gpt/bench.py --world_sizes 1 --resume            # a resumed run against a fresh one

Each world size runs train.py under torchrun `--repeats` times with the same per-rank batch (weak
scaling), in a temporary --out_dir, and reads tokens_per_s from its metrics.jsonl, leaving out the
first log interval (start-up, first steps). A run's figure is the median of its intervals; the
table gives the median of the runs with their min and max. Efficiency is tokens/s at N ranks over
N × tokens/s at one rank: 100% is perfect scaling. On a CPU each rank gets cores // N threads, so
the comparison is fair; on GPUs each rank has its own device. Arguments after `--` go to train.py.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = ["--max_steps", "60", "--log_every", "10", "--eval_every", "1000000", "--val_tokens", "64",
            "--save_every", "0"]


def run(world_size: int, train_args: list[str], threads: int, out_dir: str | None = None,
        after: int = 0) -> list[float]:
    """tokens_per_s of each log interval past step `after` but the first (start-up, first steps), of
    one run in `out_dir` (a fresh folder if None)."""
    with tempfile.TemporaryDirectory() as scratch:
        out_dir = out_dir or scratch
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(world_size), os.path.join(HERE, "train.py"), *DEFAULTS, *train_args, "--out_dir", out_dir]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"error: {world_size} ranks failed:\n{result.stderr[-2000:]}")
        with open(os.path.join(out_dir, "metrics.jsonl")) as file:
            records = [json.loads(line) for line in file]
    figures = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > after][1:]
    if not figures:
        raise SystemExit("error: fewer than two log intervals: raise --max_steps or lower --log_every")
    return figures


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} × {torch.cuda.get_device_name()}, torch {torch.__version__}"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_sizes", type=int, nargs="+", default=[1, 2, 4], help="ranks per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per world size")
    parser.add_argument("--save_every", type=int, help="also run each world size with checkpoints this often, and "
                                                        "print what the saves cost")
    parser.add_argument("--resume", action="store_true", help="also compare a run resumed at its --max_steps (60) "
                                                              "with the same steps of a fresh run")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: train.py's own arguments")
    args = parser.parse_args()
    if any(n < 1 for n in args.world_sizes) or args.repeats < 1 or (args.save_every or 1) < 1:
        parser.error("--world_sizes, --repeats and --save_every must be at least 1")
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    train_parser = argparse.ArgumentParser(add_help=False)
    train_parser.add_argument("--max_steps", type=int)  # train.py's, as it reads them: the last one given wins
    steps = train_parser.parse_known_args([*DEFAULTS, *train_args])[0].max_steps
    cores = os.cpu_count() or 1
    print(f"machine: {machine()}")
    print(f"train.py {' '.join(DEFAULTS + train_args)}")
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
