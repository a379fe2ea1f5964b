"""The pipeline bubble measured: GPipe, 1F1B and zero bubble (ZB-H1) side by side, against each one's formula.

Runs pipeline_parallel.py under torchrun for each schedule at each number of stages, --steps training steps each,
and prints per schedule the idle fraction the stages measured (median, min-max over the steps), the formula's
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(3m+p-1) for zero bubble (a forward, an input and a weight pass of equal
time), the step's time (median) and the most micro-batches' activations a stage held. The schedules of one stage
count run one after the other on the same machine; compare within a row of stages, not across machines.

    python bench_pipeline.py
    python bench_pipeline.py --stages 2 --micro_batches 8 --steps 6

Explained in docs/zero_bubble.md.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys

import torch

from benchtools import die, machine, number_in

IDLE = re.compile(r"^step \d+ \|.*\| idle (\S+) of (\S+) ms, \(p-1\)/\(3?m\+p-1\) = (\S+)$", re.MULTILINE)
KEPT = re.compile(r"at most (\d+) of \d+ micro-batches")


def run(schedule: str, stages: int, args: argparse.Namespace) -> tuple[list[float], list[float], float, int]:
    """(each step's idle fraction, each step's time in ms, the formula's idle fraction, the most micro-batches a
    stage held) of one torchrun."""
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(stages),
           os.path.join(here, "pipeline_parallel.py"), "--schedule", schedule,
           "--micro_batches", str(args.micro_batches), "--batch_size", str(args.sequences * args.micro_batches),
           "--n_embd", str(args.n_embd), "--steps", str(args.steps)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        die(f"{schedule} at {stages} stages took more than 300 s", 1)
    except KeyboardInterrupt:  # torchrun, in this terminal's process group, got it too and passes it on
        die(f"stopped by Ctrl-C during {schedule} at {stages} stages", 130)
    lines = IDLE.findall(result.stdout)
    if result.returncode or len(lines) != args.steps:  # the workers' own error line, not torchrun's box after it
        said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]
        die(f"{schedule} at {stages} stages failed: {said[0] if said else 'exit code ' + str(result.returncode)}", 1)
    return ([float(idle) for idle, _, _ in lines], [float(ms) for _, ms, _ in lines], float(lines[0][2]),
            max(map(int, KEPT.findall(result.stdout))))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=number_in(2, 8, int), nargs="+", default=[2, 3, 4], help="ranks: 2 to 8")
    parser.add_argument("--micro_batches", type=number_in(1, 64, int), default=8, help="m")
    parser.add_argument("--sequences", type=number_in(1, 64, int), default=4, help="per micro-batch, of 32 tokens")
    parser.add_argument("--n_embd", type=number_in(8, 1024, int), default=256, help="width: a multiple of 4 heads")
    parser.add_argument("--steps", type=number_in(1, 100, int), default=5, help="training steps measured per run")
    args = parser.parse_args()
    if args.n_embd % 4:
        parser.error(f"--n_embd must be a multiple of 4 (the lesson's heads), got {args.n_embd}")
    if max(args.stages) > args.micro_batches:
        parser.error(f"--micro_batches {args.micro_batches}: 1F1B and zero bubble need one per stage or more")
    for stages in args.stages:  # torch's zero bubble, checked beside the lesson's, runs rounds of m // stages
        if args.micro_batches % (args.micro_batches // stages):
            parser.error(f"--micro_batches {args.micro_batches} at {stages} stages: not a multiple of "
                         f"{args.micro_batches // stages}, the rounds of torch's zero bubble")
    return args


def main() -> None:
    args = parse_args()
    # Stopped by SIGTERM, this process exits, and subprocess.run kills the run's torchrun on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"# {machine(torch.device('cpu'))}; m = {args.micro_batches} micro-batches of {args.sequences} "
          f"sequences, n_embd {args.n_embd}, 8 blocks; idle fraction over {args.steps} steps: median (min-max)")
    print(f"{'stages':>6} | {'schedule':>8} | {'idle measured':>17} | {'formula':>7} | {'step ms':>7} | most "
          "micro-batches held")
    for stages in args.stages:
        for schedule in ("gpipe", "1f1b", "zb"):
            idle, ms, formula, kept = run(schedule, stages, args)
            print(f"{stages:>6} | {schedule:>8} | {statistics.median(idle):.2f} ({min(idle):.2f}-{max(idle):.2f}) "
                  f"| {formula:>7.2f} | {statistics.median(ms):>7.0f} | {kept}", flush=True)


if __name__ == "__main__":
    main()
