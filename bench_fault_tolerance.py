"""What one failure costs: torchft's per-step fault tolerance against gpt/'s checkpoint-and-restart, measured.

The same failure, one of two workers SIGKILLed in step --at (counted from 0), in two ways of training --steps steps:

    torchft      fault_tolerance.py, 2 replicas, --step_time per step: the killed replica is started again
                 and heals from its peer, which trains on alone meanwhile (also: killed mid-step, between its
                 quorum and its all-reduce, so that its peer's all-reduce fails)
    restart      gpt/train.py --model tiny on 2 ranks (ddp) under torchrun --max-restarts 1, a checkpoint every
                 --save_every steps: every rank stops, torchrun starts them all again, they resume from the
                 last checkpoint and compute again the steps since it (the fault injector: tests/inject)

Each runs with and without the failure, --repeats times; the cost is the difference in wall time (medians).
Printed beside it: what the failure took besides time (steps computed again; steps taken by one replica of
two, whose batches the other never saw), and torchft's survivor's longest wait between two steps.

    python bench_fault_tolerance.py

Explained in docs/fault_tolerance_cost.md.
"""
import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, list[tuple[float, str]]]:
    """(wall seconds, [(seconds since start, line)] of its output), failing loudly if the command fails or
    outlives 300 s (then stopped, with its processes: a session of its own)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=HERE, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    watchdog = threading.Timer(300, os.killpg, (proc.pid, signal.SIGTERM))
    watchdog.start()
    try:
        lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
        proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed (exit {proc.returncode})")
    return time.monotonic() - start, lines


def torchft(args: argparse.Namespace, kill: str | None) -> tuple[float, int, float]:
    """(wall seconds, steps replica 0 took alone, its longest wait between two committed steps beyond
    --step_time)."""
    cmd = [sys.executable, "fault_tolerance.py", "--replicas", "2", "--steps", str(args.steps), "--step_time",
           str(args.step_time), *(["--kill", kill] if kill else [])]
    wall, lines = timed(cmd)
    mine = [(t, m) for t, line in lines if (m := re.match(r"replica 0 step (\d+): (\d+) of 2 replicas, .*, committed",
                                                          line))]
    alone = sum(1 for _, m in mine if m[2] == "1")
    wait = max(b - a for (a, _), (b, _) in zip(mine, mine[1:], strict=False)) - args.step_time
    return wall, alone, wait


def restart(args: argparse.Namespace, kill: bool) -> tuple[float, int]:
    """(wall seconds, steps computed twice) of gpt/train.py on 2 ranks under torchrun --max-restarts 1. The
    injector kills in the optimizer step of step --at + 1 (counted from 1): the step that torchft's replica
    dies as it starts (counted from 0), here at its end, so that one is among the steps computed again."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "gpt/train.py", "--parallel", "ddp", "--max_steps", str(args.steps),
               "--save_every", str(args.save_every), "--log_every", "1", "--eval_every", str(args.steps),
               "--seq_len", "64", "--out_dir", out]
        env = {"PYTHONPATH": os.path.join(HERE, "tests", "inject"), "KILL_RANK": "1", "KILL_AT": f"step:{args.at + 1}",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if kill else {}
        wall, lines = timed(cmd, env)
    resumed = [int(m[1]) for _, line in lines if (m := re.search(r"resuming from \S+step_(\d+)", line))]
    return wall, (args.at + 1 - (resumed[-1] if resumed else 0)) if kill else 0  # no checkpoint yet: from 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps in each run")
    p.add_argument("--at", type=int, default=25, help="the step whose start the failure comes at")
    p.add_argument("--save_every", type=int, default=10, help="restart: steps between checkpoints")
    p.add_argument("--step_time", type=float, default=0.1, help="torchft: each step's stand-in compute, seconds")
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind; medians printed")
    args = p.parse_args()
    if not 0 < args.at < args.steps or min(args.save_every, args.repeats) < 1:
        p.error(f"--at must be from 1 to --steps - 1 ({args.steps - 1}); --save_every and --repeats at least 1")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that timed() stops the run in progress
    rows = []
    for name, run in [("torchft, killed as step starts", lambda k: torchft(args, f"1:{args.at}" if k else None)),
                      ("torchft, killed mid-step", lambda k: torchft(args, f"1:{args.at}:mid" if k else None)),
                      (f"restart, a checkpoint every {args.save_every}", lambda k: restart(args, k))]:
        plain, failed = [], []
        for _ in range(args.repeats):  # alternated, so that a slow moment of the machine hits both
            plain.append(run(False))
            failed.append(run(True))
        base, hit = statistics.median(r[0] for r in plain), statistics.median(r[0] for r in failed)
        lost = (f"{statistics.median(r[1] for r in failed):.0f} steps by one replica of two, its longest wait "
                f"{statistics.median(r[2] for r in failed):.2f} s" if name.startswith("torchft") else
                f"{statistics.median(r[1] for r in failed):.0f} steps computed again, by both ranks")
        rows.append(f"| {name} | {base:.1f} s | {hit:.1f} s | {hit - base:+.1f} s | {lost} |")
        print(rows[-1], flush=True)
    print(f"\n{args.steps} steps, one of 2 workers SIGKILLed at step {args.at}, {args.repeats} run(s) each, medians\n"
          "| | without the failure | with it | its cost | and besides |\n|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
