"""gpt/train.py against nanoGPT's train.py: the same model shape, batch, precision, compile setting and token ids.

    git clone https://github.com/karpathy/nanoGPT ~/nanoGPT
    python gpt/vs_nanogpt.py --nanogpt ~/nanoGPT                  # on a CPU: the tiny shape, fp32, eager
    python gpt/vs_nanogpt.py --nanogpt ~/nanoGPT --shape gpt2 --batch_size 16 --precision bf16 --compile  # a GPU

Writes random token ids (below GPT-2's 50,257, or below 256 for the tiny shape) as nanoGPT's train.bin and
val.bin in a temporary folder, which both read; runs gpt/train.py (one process: ddp at one rank) and nanoGPT's
train.py (from its own folder, as its README does) one after the other, --repeats times each, alternating, and
prints each one's tokens/s (the median over the steps past the warm-up), the ratio, the median of steps 11-30
and 41-60 (a drift shows there; "-" for a run too short), gpt/'s MFU, and on a GPU the share of a step the GPU
is busy: the union of the kernels' times over the span from the first kernel to the last, in a torch.profiler
trace of three steps of a separate gpt/ run. nanoGPT's tokens/s is its printed time per step (it syncs at every
log line, --log_interval 1, its default); gpt/'s is train.py's own over intervals of 5 steps. Nothing of nanoGPT
is copied here.
"""
import argparse
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# --shape: gpt/'s --model, the width nanoGPT is given, its sequence length and the ids' vocabulary
SHAPES = {"tiny": dict(model="tiny", n_layer=2, n_head=2, n_embd=64, seq_len=64, vocab=256),
          "gpt2": dict(model="gpt2", n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab=50257)}
LOG_EVERY = 5  # gpt/'s log interval: tokens/s over 5 steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nanogpt", required=True, help="a checkout of github.com/karpathy/nanoGPT (its train.py)")
    p.add_argument("--shape", choices=SHAPES, help="tiny (2 layers, 64 wide, seq_len 64, vocab 256) or gpt2 "
                                                   "(124M, seq_len 1024); default: gpt2 on a GPU, tiny on a CPU")
    p.add_argument("--batch_size", type=int, help="sequences per step (default: 16 for gpt2, 8 for tiny)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="default: bf16 on a GPU, fp32 on a CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile in both (gpt/: each block and the head)")
    p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp"], default="ddp",
                   help="gpt/'s layout at its one rank (default ddp; nanoGPT has none at one process)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default 60); the first 10 are the warm-up, "
                                                          "and steps 41-60 need 60")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating (default 3)")
    p.add_argument("--peak_tflops", type=float, help="the GPU's peak, for gpt/'s MFU (default: train.py's, from the "
                                                     "GPU's name)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if there is one")
    args = p.parse_args(argv)
    if args.steps < 20 or args.repeats < 1 or (args.batch_size is not None and args.batch_size < 1) or \
            (args.peak_tflops is not None and not 0 < args.peak_tflops < 1e7):
        p.error("--steps must be at least 20, --repeats and --batch_size at least 1, --peak_tflops above 0")
    if not os.path.isfile(os.path.join(args.nanogpt, "train.py")) or \
            not os.path.isfile(os.path.join(args.nanogpt, "configurator.py")):
        p.error(f"--nanogpt {args.nanogpt}: no nanoGPT checkout there (its train.py and configurator.py); "
                "git clone https://github.com/karpathy/nanoGPT")
    import torch  # only to look for a GPU
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no GPU is visible here")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.shape = args.shape or ("gpt2" if args.device == "cuda" else "tiny")
    args.batch_size = args.batch_size or (16 if args.shape == "gpt2" else 8)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    if args.device == "cpu" and args.precision == "bf16":
        p.error("--precision bf16 is for a GPU: nanoGPT runs a CPU in fp32 (no autocast there)")
    return args


def write_ids(folder: str, vocab: int, seed: int = 0) -> None:
    """nanoGPT's train.bin and val.bin (uint16 ids, no header), which gpt/train.py --data reads as they are,
    and meta.pkl with the vocabulary when it is not GPT-2's (nanoGPT's train.py reads it from there)."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    rng.integers(0, vocab, 1 << 21, dtype=np.uint16).tofile(os.path.join(folder, "train.bin"))
    rng.integers(0, vocab, 1 << 16, dtype=np.uint16).tofile(os.path.join(folder, "val.bin"))
    if vocab != SHAPES["gpt2"]["vocab"]:
        with open(os.path.join(folder, "meta.pkl"), "wb") as file:
            pickle.dump({"vocab_size": vocab}, file)


def gpt_command(args: argparse.Namespace, data: str, out_dir: str, profile: str | None = None) -> list[str]:
    shape = SHAPES[args.shape]
    command = [sys.executable, os.path.join(HERE, "train.py"), "--model", shape["model"], "--data", data,
               "--seq_len", str(shape["seq_len"]), "--batch_size", str(args.batch_size), "--precision",
               args.precision, "--max_steps", str(args.steps), "--log_every", str(LOG_EVERY), "--eval_every",
               str(10 * args.steps), "--val_tokens", str(shape["seq_len"]), "--save_every", "0", "--out_dir", out_dir,
               "--parallel", args.parallel]
    if shape["vocab"] != SHAPES["gpt2"]["vocab"]:
        command += ["--vocab_size", str(shape["vocab"])]
    return command + (["--compile"] if args.compile else []) + (["--profile", profile] if profile else []) + (
        ["--peak_tflops", str(args.peak_tflops)] if args.peak_tflops else [])


def nanogpt_command(args: argparse.Namespace, data: str, out_dir: str) -> list[str]:
    """nanoGPT's --key=value overrides (its configurator.py): its dataset folder is data/<dataset>, and an absolute
    path there is taken as it is; biases on (gpt/'s model has them), no dropout, one evaluation (at step 0)."""
    shape = SHAPES[args.shape]
    config = dict(dataset=data, out_dir=out_dir, device=args.device, compile=args.compile,
                  dtype="bfloat16" if args.precision == "bf16" else "float32", n_layer=shape["n_layer"],
                  n_head=shape["n_head"], n_embd=shape["n_embd"], block_size=shape["seq_len"],
                  batch_size=args.batch_size, gradient_accumulation_steps=1, bias=True, dropout=0.0,
                  max_iters=args.steps - 1, eval_interval=10 * args.steps, eval_iters=1, log_interval=1,
                  always_save_checkpoint=False, wandb_log=False)
    return [sys.executable, "train.py", *(f"--{key}={value}" for key, value in config.items())]


def run(command: list[str], cwd: str | None, who: str, device: str) -> str:
    """The command's stdout; its failure one line. A signal that stops this script stops the command too."""
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}  # train.py takes a GPU it sees
    child = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = child.communicate()
    except BaseException:  # Ctrl-C, or SIGTERM (main's handler): the child goes first, then the temporary folders
        child.kill()
        child.wait()
        raise
    if child.returncode != 0:
        said = [line for line in stderr.splitlines() if line.strip()]
        raise SystemExit(f"error: {who} failed (exit {child.returncode}): {said[-1] if said else 'no output'}")
    return stdout


def gpt_figures(out_dir: str, tokens_per_step: int) -> dict:
    """tokens/s of each gpt/ log interval, by the step that ends it, and its mfu if it printed one."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as file:
        records = [r for r in map(json.loads, file) if "tokens_per_s" in r]
    return {"by_step": {r["step"]: r["tokens_per_s"] for r in records},
            "mfu": [r["mfu"] for r in records if "mfu" in r and r["step"] > 10]}


def nanogpt_figures(stdout: str, tokens_per_step: int) -> dict:
    """tokens/s of each nanoGPT step from its lines `iter N: loss L, time T ms, mfu M%` (N from 0)."""
    by_step = {}
    for line in stdout.splitlines():
        if line.startswith("iter ") and "time " in line:
            step = int(line.split()[1].rstrip(":")) + 1
            by_step[step] = tokens_per_step / (float(line.split("time ")[1].split("ms")[0]) / 1e3)
    if not by_step:
        raise SystemExit("error: nanoGPT's train.py printed no `iter N: ... time T ms` line")
    return {"by_step": by_step, "mfu": []}


def past_warm_up(figures: dict, who: str) -> dict:
    if not any(step > 10 for step in figures["by_step"]):
        raise SystemExit(f"error: {who} printed no step past the 10th")
    return figures


def window(by_step: dict, first: int, last: int) -> float | None:
    figures = [v for step, v in by_step.items() if first < step <= last]
    return statistics.median(figures) if figures else None


def busy_share(trace_path: str) -> tuple[float, int] | None:
    """(the share of the span from the first GPU kernel to the last that some kernel runs, kernels) in a
    torch.profiler chrome trace; None when it holds no kernel (a CPU run)."""
    with open(trace_path) as file:
        events = json.load(file).get("traceEvents", [])
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e)
    if not spans:
        return None
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:  # the union: kernels on several streams may overlap
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / (end - spans[0][0]), len(spans)


def uneven(per_run: dict[str, list[float]]) -> str | None:
    """A warning where one script's runs differ by more than 2x in tokens/s: something else had the cores."""
    for who, speeds in per_run.items():
        if max(speeds) > 2 * min(speeds):
            return (f"warning: {who}'s runs differ by more than 2x ({min(speeds):,.0f} to {max(speeds):,.0f} "
                    f"tokens/s): other work had the cores; run again on idle ones")
    return None


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit("error: stopped by SIGTERM"))
    try:
        compare(args)
    except KeyboardInterrupt:
        sys.exit("error: interrupted")


def compare(args: argparse.Namespace) -> None:
    shape = SHAPES[args.shape]
    tokens_per_step = args.batch_size * shape["seq_len"]
    results = {"gpt/train.py": [], "nanoGPT": []}
    with tempfile.TemporaryDirectory() as scratch:
        data = os.path.join(scratch, "data")
        write_ids(data, shape["vocab"])
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as out_dir:
                run(gpt_command(args, data, out_dir), None, "gpt/train.py", args.device)
                results["gpt/train.py"].append(past_warm_up(gpt_figures(out_dir, tokens_per_step), "gpt/train.py"))
            with tempfile.TemporaryDirectory() as out_dir:
                stdout = run(nanogpt_command(args, data, out_dir), args.nanogpt, "nanoGPT's train.py", args.device)
                results["nanoGPT"].append(past_warm_up(nanogpt_figures(stdout, tokens_per_step), "nanoGPT's train.py"))
        busy = None
        if args.device == "cuda":  # a separate run: the profiler's own cost stays out of the tokens/s
            with tempfile.TemporaryDirectory() as out_dir:
                run(gpt_command(args, data, out_dir, profile="15:17"), None, "gpt/train.py --profile", args.device)
                traces = [os.path.join(out_dir, "profile", name) for name in os.listdir(os.path.join(out_dir,
                                                                                                     "profile"))]
                busy = busy_share(traces[0])
    print(f"{args.shape} shape ({shape['n_layer']} layers, {shape['n_embd']} wide, {shape['n_head']} heads, vocab "
          f"{shape['vocab']}), seq_len {shape['seq_len']}, batch {args.batch_size}, {args.precision}, "
          f"{'compiled' if args.compile else 'eager'}, {args.device}, gpt/ under {args.parallel}, {args.steps} steps, "
          f"{args.repeats} "
          f"run{'s' if args.repeats > 1 else ''} each")
    print(f"{'':>14} {'tokens/s':>10} {'min':>10} {'max':>10} {'steps 11-30':>12} {'steps 41-60':>12}")
    medians, spread = {}, {}
    for who, runs in results.items():
        per_run = spread[who] = [window(r["by_step"], 10, args.steps) for r in runs]
        medians[who] = statistics.median(per_run)
        early, late = (statistics.median(w) if (w := [x for r in runs if (x := window(r["by_step"], a, b))]) else None
                       for a, b in ((10, 30), (40, 60)))
        print(f"{who:>14} {medians[who]:>10,.0f} {min(per_run):>10,.0f} {max(per_run):>10,.0f} "
              f"{f'{early:,.0f}' if early else '-':>12} {f'{late:,.0f}' if late else '-':>12}")
    pairs = sorted(window(g["by_step"], 10, args.steps) / window(n["by_step"], 10, args.steps)
                   for g, n in zip(results["gpt/train.py"], results["nanoGPT"], strict=True))
    print(f"ratio gpt/ : nanoGPT {medians['gpt/train.py'] / medians['nanoGPT']:.2f} (each pair of runs: "
          f"{pairs[0]:.2f} to {pairs[-1]:.2f})")
    if warning := uneven(spread):
        print(warning)
    mfu = [m for r in results["gpt/train.py"] for m in r["mfu"]]
    print(f"gpt/ mfu {statistics.median(mfu):.1%}" if mfu else "gpt/ mfu - (no GPU peak known: a CPU)")
    print(f"gpt/ GPU busy {busy[0]:.1%} of steps 15-17 ({busy[1]} kernels)" if busy else
          "gpt/ GPU busy - (no GPU kernels: a CPU)")


if __name__ == "__main__":
    main()
