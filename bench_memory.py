"""What each rank holds under DDP, ZeRO stage 1 and FSDP2, measured, beside the ZeRO paper's formulas.

For each world size this runs three torchrun jobs in turn, on the same task and model: DDP with
Adam (zero_optimizer.py --no_zero), DDP with ZeroRedundancyOptimizer (zero_optimizer.py) and
FSDP2 (fsdp2.py). Each rank of each job prints the bytes of parameters, gradients and optimizer
state it holds after a step, and rank 0 the median step time; this script gathers those lines
into one table per world size. The formulas, for Ψ parameters in fp32 with Adam (the ZeRO paper,
Rajbhandari et al. 2020, with K = 12 there for mixed precision; here everything is fp32):

    DDP      4Ψ parameters + 4Ψ gradients + 8Ψ optimizer state = 16Ψ on every rank
    ZeRO-1   4Ψ + 4Ψ + 8Ψ/N          (the state of whole parameters, assigned to ranks by size)
    FSDP2    4Ψ/N + 4Ψ/N + 8Ψ/N = 16Ψ/N, plus the layers gathered while they run (freed after): one
             in forward, two in backward, with a layer's whole gradient until it is reduce-scattered

    python bench_memory.py
    python bench_memory.py --world_sizes 2 4 --max_epochs 2

Started under torchrun, it says to use plain python: it starts the jobs itself.
Explained in docs/sharding.md.
"""
import argparse
import os
import re
import signal
import subprocess
import sys

import benchtools
from benchtools import die, print_line
from model import build_model

HELD = re.compile(r"^\[rank (\d+)/(\d+)\] bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                  r"optimizer state ([\d,]+)$", re.MULTILINE)
STEP = re.compile(r"^step time: (\d+\.\d+) ms", re.MULTILINE)
POSITIVE = benchtools.number_in(1, 2**31, int)  # epochs, samples
METHODS = {"DDP": ["zero_optimizer.py", "--no_zero"], "ZeRO-1": ["zero_optimizer.py"], "FSDP2": ["fsdp2.py"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world_sizes", type=benchtools.number_in(1, 64, int), nargs="+", default=[1, 2, 3, 4],
                        help="the numbers of processes to run each method with (1 to 64)")
    parser.add_argument("--model", default="wide", choices=["mlp", "wide"], help="which model from model.py")
    parser.add_argument("--max_epochs", type=POSITIVE, default=1, help="epochs each job trains")
    parser.add_argument("--train_size", type=POSITIVE, default=1024, help="training samples")
    parser.add_argument("--batch_size", type=POSITIVE, default=32, help="samples per step on each rank")
    parser.add_argument("--timeout", type=benchtools.timeout_seconds, default=300.0,
                        help="seconds each job may take before it is stopped")
    return parser.parse_args()


def predicted(parameters: int, method: str, world_size: int) -> dict[str, float]:
    """The paper's bytes per rank: parameters, gradients, optimizer state (fp32 Adam: 2 tensors)."""
    shard = {"DDP": (1, 1, 1), "ZeRO-1": (1, 1, world_size), "FSDP2": (world_size,) * 3}[method]
    return {name: per_parameter * parameters / n
            for name, per_parameter, n in zip(("parameters", "gradients", "optimizer state"), (4, 4, 8), shard,
                                              strict=True)}


def run_job(method: str, world_size: int, args: argparse.Namespace) -> tuple[dict[int, dict], float]:
    """One torchrun job; return ({rank: bytes held}, rank 0's median step time in ms)."""
    here = os.path.dirname(os.path.abspath(__file__))
    script, *flags = METHODS[method]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world_size),
               os.path.join(here, script), *flags, "--model", args.model, "--max_epochs", str(args.max_epochs),
               "--train_size", str(args.train_size), "--batch_size", str(args.batch_size)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env=os.environ | {"PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        die(f"the {method} job at {world_size} ranks took more than --timeout {args.timeout:g} s")
    except KeyboardInterrupt:  # torchrun, in this terminal's process group, got it too and passes it on
        die(f"stopped by Ctrl-C during the {method} job at {world_size} ranks", code=130)
    held = {int(m[1]): dict(zip(("parameters", "gradients", "optimizer state"),
                                (int(m[i].replace(",", "")) for i in (3, 4, 5)), strict=True))
            for m in HELD.finditer(done.stdout)}
    step = STEP.search(done.stdout)
    if done.returncode != 0 or sorted(held) != list(range(world_size)) or step is None:
        # The workers' own one-line error, not the box that torchrun draws after it.
        errors = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
        said = errors[-1] if errors else "no error line; rerun the job by hand to see its output"
        die(f"the {method} job at {world_size} ranks failed (exit {done.returncode}): {said}")
    return held, float(step[1])


def table(world_size: int, parameters: int, results: dict[str, tuple[dict[int, dict], float]]) -> list[str]:
    """One world size's lines: every rank of every method, measured and predicted, in MB (1e6 bytes)."""
    lines = [f"# {world_size} rank{'s' if world_size > 1 else ''}: MB held per rank after a step, measured "
             f"(predicted); step time over DDP's, median of rank 0's steps",
             f"  {'method':<8} {'rank':>4} {'parameters':>16} {'gradients':>16} {'optimizer state':>16} "
             f"{'total':>16} {'step':>6}"]
    ddp_step = results["DDP"][1]
    for method, (held, step) in results.items():
        expected = predicted(parameters, method, world_size)
        for rank, measured in sorted(held.items()):
            cells = [f"{measured[k] / 1e6:.2f} ({expected[k] / 1e6:.2f})" for k in expected]
            total = f"{sum(measured.values()) / 1e6:.2f} ({sum(expected.values()) / 1e6:.2f})"
            ratio = f"{step / ddp_step:.2f}" if rank == 0 else ""  # rank 0 times the steps
            lines.append(f"  {method:<8} {rank:>4} {' '.join(f'{c:>16}' for c in cells)} {total:>16} {ratio:>6}")
    return lines


def main() -> None:
    args = parse_args()
    if benchtools.launcher_env() is not None:
        die("start this script with plain python, e.g. python bench_memory.py: it starts its torchrun jobs itself")
    # Stopped by SIGTERM, this process exits, and subprocess.run kills the job's torchrun on the way out
    # (it kills its child on any exception, SystemExit included).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parameters = sum(p.numel() for p in build_model(args.model).parameters())
    print_line(f"# bench_memory.py: model {args.model} (Ψ = {parameters:,} parameters, fp32, Adam), "
               f"{args.max_epochs} epoch(s) of {args.train_size} samples, batch {args.batch_size} per rank")
    for world_size in args.world_sizes:
        results = {method: run_job(method, world_size, args) for method in METHODS}
        for line in table(world_size, parameters, results):
            print_line(line)


if __name__ == "__main__":
    main()
    benchtools.exit_now()
