"""The GPU check: gpt/train.py's CUDA paths on one GPU, in one command and about 5 minutes.

    python gpt/gpu_check.py                         # every check, on one GPU; files in gpu_check/
    python gpt/gpu_check.py --only fp16 sigterm     # some of them
    python gpt/gpu_check.py --dry_run               # the commands it would run (any machine)

Each check runs train.py under torchrun with one process (NCCL at world size 1: the CUDA code paths,
not several GPUs' traffic, binding or sharding; ddp there is the model alone, no DDP), reads what it
printed and its metrics.jsonl, and prints one line: PASS or FAIL, with its figures. The exit status is 1
if any failed. The checks:

    ddp, fsdp   GPT-2 124M, bf16, --compile, 50 steps on random tokens of GPT-2's vocabulary:
                MFU and peak memory printed, no recompilation after the first log line
    fp16        fp16 under fsdp (GradScaler over sharded gradients): the loss falls
    sigterm     SIGTERM mid-run under ddp saves the step in flight; fsdp resumes from it, to the end
    profile     a trace of steps 11 to 14 (a log line at 12): the host waits for the GPU only there
    checkpoint  fsdp in each --activation_checkpoint mode: the same loss, less memory from none to full
    llama       the Llama family at Llama 3.2 1B's shape (GPT-2's vocabulary), bf16, --compile, fsdp, 30 steps:
                MFU and peak memory printed, no recompilation after the first log line
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKS = ("ddp", "fsdp", "fp16", "sigterm", "profile", "checkpoint", "llama")
GPT2 = ["--model", "gpt2", "--seq_len", "1024", "--batch_size", "8", "--precision", "bf16", "--lr", "6e-4",
        "--warmup_steps", "10", "--val_tokens", "8192"]
SMALL = ["--model", "small", "--seq_len", "256", "--batch_size", "16", "--eval_every", "1000000",
         "--val_tokens", "4096"]
# The host's waits for the GPU, as the CUDA runtime records them in a torch.profiler trace.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def commands(out: str) -> dict[str, list[list[str]]]:
    """Each check's train.py arguments, one list per run, in order."""
    data = os.path.join(out, "data")
    compiled = [*GPT2, "--data", data, "--compile", "--max_steps", "50", "--log_every", "10", "--eval_every", "50"]
    return {
        "ddp": [[*compiled, "--parallel", "ddp", "--out_dir", os.path.join(out, "ddp")]],
        "fsdp": [[*compiled, "--parallel", "fsdp", "--out_dir", os.path.join(out, "fsdp")]],
        "fp16": [[*SMALL, "--parallel", "fsdp", "--precision", "fp16", "--max_steps", "100", "--log_every", "10",
                  "--out_dir", os.path.join(out, "fp16")]],
        "sigterm": [[*SMALL, "--parallel", parallel, "--precision", "bf16", "--max_steps", "1000", "--log_every", "10",
                     "--save_every", "100000", "--out_dir", os.path.join(out, "sigterm")]
                    for parallel in ("ddp", "fsdp")],
        "profile": [[*GPT2, "--data", data, "--max_steps", "16", "--log_every", "4", "--eval_every", "1000000",
                     "--profile", "11:14", "--out_dir", os.path.join(out, "profile")]],
        "checkpoint": [[*GPT2, "--data", data, "--parallel", "fsdp", "--max_steps", "10", "--log_every", "5",
                        "--eval_every", "1000000", "--activation_checkpoint", mode,
                        "--out_dir", os.path.join(out, f"checkpoint_{mode}")]
                       for mode in ("none", "selective", "full")],
        "llama": [["--model", "llama3.2-1b", "--seq_len", "1024", "--batch_size", "4", "--precision", "bf16", "--lr",
                   "3e-4", "--warmup_steps", "10", "--val_tokens", "8192", "--data", data, "--compile", "--max_steps",
                   "30", "--log_every", "10", "--eval_every", "30", "--parallel", "fsdp",
                   "--out_dir", os.path.join(out, "llama")]],
    }


def torchrun(argv: list[str], log: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               os.path.join(HERE, "train.py"), *argv]
    env = {**os.environ, "TORCH_LOGS": "recompiles"}  # dynamo says each recompilation, and why
    return subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, text=True,
                            start_new_session=True)


def finish(process: subprocess.Popen, log: str, timeout: float) -> str:
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    with open(log) as file:
        return file.read()


def records(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        return [json.loads(line) for line in file]


def recompiles_after_first_log(output: str) -> list[str]:
    """dynamo's recompilation messages printed after the first `step N/M | loss` line and before the
    last one: the compiled steps must not compile again (evaluation, after, may)."""
    lines = output.splitlines()
    logs = [i for i, line in enumerate(lines) if re.match(r"step \d+/\d+ \| loss ", line)]
    return [line for line in lines[logs[0]:logs[-1]] if "Recompiling function" in line] if logs else []


def host_waits(trace_path: str) -> dict[str, int]:
    """The host's waits for the GPU in each step's range of a train.py --profile trace, by step."""
    with open(trace_path) as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    steps = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events if re.fullmatch(r"step \d+", e["name"])]
    waits = [e["ts"] for e in events if e["name"] in SYNCS]
    return {name: sum(start <= t <= end for t in waits) for name, start, end in steps}


def check(name: str, runs: list[list[str]], out: str, timeout: float) -> tuple[bool, str]:
    """(passed, what was seen) of one check."""
    logs = [os.path.join(out, f"{name}{i}.log") for i in range(len(runs))]
    if name == "sigterm":
        process = torchrun(runs[0], logs[0])
        deadline = time.monotonic() + timeout
        while "step 30/" not in open(logs[0]).read() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if process.poll() is not None:
            return False, f"train.py ended before step 30 (see {logs[0]})"
        os.kill(process.pid, signal.SIGTERM)  # to torchrun, which passes it on, as Slurm's --signal does
        first = finish(process, logs[0], 60)
        stopped = re.search(r"stopped by SIGTERM after step (\d+): saved", first)
        if not stopped:
            return False, f"no save on SIGTERM (see {logs[0]})"
        second = finish(torchrun(runs[1], logs[1]), logs[1], timeout)
        resumed = f"step {stopped[1]} of 1000" in second and re.search(r"^step 1000 \| val_loss", second, re.M)
        return bool(resumed), f"stopped after step {stopped[1]}, " + ("resumed under fsdp to step 1000" if resumed
                                                                      else f"no resume (see {logs[1]})")
    if name == "checkpoint":  # each mode of --activation_checkpoint: the same losses, and less memory than the last
        seen = {}
        for argv, log in zip(runs, logs, strict=True):
            output, out_dir = finish(torchrun(argv, log), log, timeout), argv[argv.index("--out_dir") + 1]
            if "error:" in output or not os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
                return False, f"failed (see {log})"
            logged = [r for r in records(out_dir) if "loss" in r]
            seen[argv[argv.index("--activation_checkpoint") + 1]] = (logged[-1]["loss"],
                                                                     max(r["peak_allocated_gib"] for r in logged))
        losses, peaks = zip(*seen.values(), strict=True)  # none, selective, full
        return all(abs(loss - losses[0]) <= 1e-2 * losses[0] for loss in losses) and peaks[0] > peaks[1] > peaks[2], \
            ", ".join(f"{mode}: loss {loss:.4f}, peak {peak:.2f} GiB" for mode, (loss, peak) in seen.items())
    output = finish(torchrun(runs[0], logs[0]), logs[0], timeout)
    out_dir = runs[0][runs[0].index("--out_dir") + 1]
    if not os.path.exists(os.path.join(out_dir, "metrics.jsonl")) or "error:" in output:
        return False, f"failed (see {logs[0]})"
    logged = [r for r in records(out_dir) if "loss" in r]
    memory = max(r.get("peak_allocated_gib", 0) for r in logged)
    if name in ("ddp", "fsdp", "llama"):
        mfu = [r["mfu"] for r in logged[1:] if "mfu" in r]
        again = recompiles_after_first_log(output)
        seen = (f"mfu {np.median(mfu):.1%} (median of the log lines after the first)" if mfu else "no mfu") + \
            f", peak {memory:.1f} GiB allocated, {len(again)} recompilations after step 10"
        return bool(mfu) and not again and memory > 0, seen
    if name == "fp16":
        losses = [r["loss"] for r in logged]
        return losses[-1] < losses[0] - 0.5, f"loss {losses[0]:.3f} to {losses[-1]:.3f}, peak {memory:.2f} GiB"
    if not os.path.isdir(os.path.join(out_dir, "profile")):
        return False, f"no trace (see {logs[0]})"
    traces = [os.path.join(out_dir, "profile", f) for f in os.listdir(os.path.join(out_dir, "profile"))]
    waits = host_waits(traces[0])
    elsewhere = {step: n for step, n in waits.items() if step != "step 12" and n}
    return sorted(waits) == ["step 11", "step 12", "step 13", "step 14"] and not elsewhere, \
        f"host waits by step {waits} (a log line at step 12)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="the checks to run")
    parser.add_argument("--out", default="gpu_check", help="where the runs, their logs and the data go")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds each run may take")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args()
    if not args.timeout > 0:
        parser.error("--timeout must be above 0")
    runs = {name: argv for name, argv in commands(args.out).items() if name in args.only}
    if args.dry_run:
        for name, argvs in runs.items():
            for argv in argvs:
                print(f"{name}: torchrun --standalone --nproc-per-node 1 gpt/train.py {' '.join(argv)}")
        return
    import torch  # here, not above: --dry_run and --help need no torch
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device: the GPU check needs one (--dry_run prints its commands)")
    if os.path.exists(args.out):
        raise SystemExit(f"error: {args.out} exists: give another --out, or remove it")
    os.makedirs(os.path.join(args.out, "data"))
    rng = np.random.default_rng(0)  # random ids of GPT-2's vocabulary, as nanoGPT's train.bin / val.bin
    for split, count in (("train", 1 << 24), ("val", 1 << 16)):
        rng.integers(0, 50257, count, dtype=np.uint16).tofile(os.path.join(args.out, "data", f"{split}.bin"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    failed = 0
    for name, argvs in runs.items():
        started = time.monotonic()
        try:
            passed, seen = check(name, argvs, args.out, args.timeout)
        except subprocess.TimeoutExpired as error:
            passed, seen = False, f"timed out after {error.timeout:.0f} s"
        except Exception as error:  # a check that breaks is a FAIL, and the others still run
            passed, seen = False, f"{type(error).__name__}: {error}"
        failed += not passed
        print(f"{'PASS' if passed else 'FAIL'} {name:8} {time.monotonic() - started:5.0f} s  {seen}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
