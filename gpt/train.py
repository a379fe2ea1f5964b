"""Train a GPT on a token stream with DDP, FSDP2, HSDP, tensor and pipeline parallel: the job to copy.

    torchrun --standalone --nproc-per-node 2 gpt/train.py --model tiny        # 2 CPU cores, ~10 s
    torchrun --standalone --nproc-per-node 8 gpt/train.py --model gpt2 --data DIR --seq_len 1024 \\
        --batch_size 16 --grad_accum 4 --precision bf16 --compile --parallel ddp
    python gpt/train.py --model tiny --grad_accum 2 --out_dir out/one         # the same, one process

Steps, not epochs: the batch of step s is drawn from (--seed, s) and split among the ranks, so the
run is the same at any world size with the same global batch (--batch_size × --grad_accum × ranks,
a tp group or a pipeline counting once),
and the tests show it. Every --log_every steps rank 0 prints one line and appends it to
OUT_DIR/metrics.jsonl; every --eval_every steps every rank evaluates its share of a fixed
validation set. The whole story: docs/gpt_job.md; on 8 GPUs or several nodes: docs/gpt_cluster.md.
"""
import os

# This process's launcher, before anything else runs: torch's imports take about 1.5 s, and a torchrun
# that died in them would go unseen (setup() compares this with the parent after its request).
PARENT_AT_START = os.getppid()

import argparse
import contextlib
import ctypes
import gc
import json
import math
import signal
import sys
import time
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP

import checks
import context
import data
import hf
import options
import parallelize
import pipeline
import trackers
from checkpoint import Checkpoints
from checks import weights_are_finite
from metrics import peak_flops, peak_memory, time_left
from model import GPT, GPTConfig, export
from optimizer import make_optimizer
from parallelize import DTYPES
from stop import StopRequest

# What a checkpoint records of the run that wrote it; a resume with other values says so in one line.
RUN = ("data", "max_steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "seed", "batch_size",
       "grad_accum", "parallel", "tp", "pp", "pp_schedule", "ep", "cp", "cp_method", "precision")
GC_EVERY = 100  # steps between garbage collections, on every rank at once


def parser() -> argparse.ArgumentParser:
    return options.parser(__doc__.split("\n\n")[0])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(options.with_file(p, sys.argv[1:] if argv is None else argv))
    args.model = "tiny" if args.model is None and args.init_from is None else args.model
    for name in ("max_steps", "batch_size", "grad_accum", "seq_len", "log_every", "eval_every", "val_tokens",
                 "vocab_size", "keep"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    for name in ("lr", "timeout", "peak_tflops"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < math.inf:  # also refuses nan
            p.error(f"--{name} must be above 0 and finite")
    for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "seed", "save_every"):
        if getattr(args, name) is not None and not 0 <= getattr(args, name) < math.inf:
            p.error(f"--{name} must not be negative, nan or infinite")
    # Far past any real value, and far below where they fail with a traceback: Adam's first step overflows
    # float32 at an lr above ~3e37 (lr / (1 - 0.9)), timedelta at a timeout above ~9e13 s.
    for name in ("lr", "min_lr", "timeout"):
        if getattr(args, name) is not None and not getattr(args, name) < 1e7:
            p.error(f"--{name} must be below 1e7")
    if args.profile and args.profile[1] > args.max_steps:
        p.error(f"--profile {args.profile[0]}:{args.profile[1]} ends after --max_steps {args.max_steps}")
    if args.seed >= 2**64:
        p.error("--seed must be below 2**64 (torch.manual_seed's range)")
    if args.vocab_size is not None and args.data == "synthetic":
        p.error(f"--vocab_size is for files; the synthetic data has {data.SYNTHETIC_VOCAB} tokens")
    if refused := trackers.missing(args):
        p.error(refused)
    if refused := parallelize.refused_layout(args):  # simulate.py refuses the same: one function
        p.error(refused)
    return args


def setup(args: argparse.Namespace) -> tuple[int, int, int, torch.device]:
    """(rank, local_rank, world_size, device), with the process group up. Without torchrun, one
    process in a group of its own, so the same code runs."""
    rank, local_rank, world_size = (int(os.environ.get(k, d)) for k, d in
                                    (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)))
    timeout = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # local, not global, rank: the GPU on this node
        torch.cuda.set_device(device)  # before init: NCCL binds each rank to its device
        torch.set_float32_matmul_precision("high")  # TF32 matmuls in fp32
        backend, init = "nccl", {"device_id": device}
    else:
        device, backend, init = torch.device("cpu"), "gloo", {}
    if "RANK" not in os.environ:  # plain python: a group of one, with no port to pick
        init["store"], init["rank"], init["world_size"] = dist.HashStore(), 0, 1
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's own store: see attempt_store
        init["store"], init["rank"], init["world_size"] = attempt_store(local_rank), rank, world_size
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and sys.platform == "linux":
        # torchrun starts each worker in a session of its own: a `kill -9` of torchrun would leave the
        # workers training (and rank 0 holding OUT_DIR's lock). Linux sends this signal when it dies,
        # which stops the job as a preemption does: every rank saves the step in flight.
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != PARENT_AT_START:  # torchrun died before the request: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)
    dist.init_process_group(backend, **init, **timeout)
    return rank, local_rank, world_size, device


def attempt_store(local_rank: int) -> dist.Store:
    """The store of this attempt of a torchrun job that may restart (--max-restarts).

    torchrun hands its workers its rendezvous store, which outlives a restart with every key the
    dead workers wrote, gloo's addresses among them: a restarted gloo group can read a dead
    worker's address and fail to connect, or hang (pytorch/pytorch#135712). So each attempt meets
    under keys of its own. The attempt number is each agent's own restart count, which the agents
    of several nodes do not agree on (pytorch/pytorch#108158): restarts on several nodes need
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every attempt a new store (and env://)."""
    nodes, restarts = (int(os.environ.get(k, "0")) for k in ("GROUP_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"))
    if nodes > 1 and restarts > 0:
        if local_rank == 0:  # one line per node
            print("error: torchrun --max-restarts on several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                  "torchrun's environment on every node (pytorch/pytorch#135712)", file=sys.stderr, flush=True)
        sys.exit(2)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to --lr over --warmup_steps, then a cosine down to --min_lr at --max_steps."""
    min_lr = args.lr / 10 if args.min_lr is None else args.min_lr
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module | pipeline.Pipeline, tokens: data.Tokens, starts, args: argparse.Namespace, mesh,
             dp_rank: int, dp_size: int, device: torch.device, autocast) -> float:
    """The mean loss per token over the whole validation set, each window counted once.

    Rank r takes windows r, r + N, ... (r and N: dp_rank and dp_size, data_rank()'s); each rank sums its token
    losses in float64, and one all-reduce adds the sums and the counts (a tp group's, once per rank: the
    mean is the same). Every rank runs the same number of forwards, one with
    nothing to count where its share runs out first: under FSDP each forward all-gathers weights. A pipeline
    takes a step's worth of windows at a time, in micro-batches of the training's shape, the last chunk padded
    with targets -100 (not counted); its last stage counts."""
    pipe = model if isinstance(model, pipeline.Pipeline) else None
    model.eval()
    mine = starts[dp_rank::dp_size]
    size = args.batch_size * (args.grad_accum if pipe else 1)
    batches = -(-len(starts[0::dp_size]) // size)  # data rank 0 has the most windows
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, tokens)
    for i in range(batches):
        chunk = mine[i * size:(i + 1) * size]
        if pipe:
            x, y = data.windows(tokens.val, np.concatenate([chunk, np.repeat(starts[:1], size - len(chunk))]),
                                args.seq_len, device)
            y = y.clone()  # not a view of x's rows
            y[len(chunk):] = -100  # cross_entropy's ignore_index
            total = pipe.evaluate(x, y)
            if total is not None:
                totals[0] += total
                totals[1] += (pipe.cut(x, y)[1] != -100).sum()  # --cp: this rank's tokens
            continue
        x, y = data.windows(tokens.val, chunk if len(chunk) else starts[:1], args.seq_len, device)
        with autocast, parallelize.loss_context(mesh):
            losses = model(x, y)  # (batch × seq), fp32
        if len(chunk):
            totals[0] += losses.double().sum()
            totals[1] += losses.numel()
    dist.all_reduce(totals)  # every rank's sums: the mean over the whole set
    model.train()
    return (totals[0] / totals[1]).item()


def resume(args: argparse.Namespace, checkpoints: Checkpoints, parts: list[torch.nn.Module],
           optimizers: list[torch.optim.Optimizer], scaler: torch.amp.GradScaler, config: GPTConfig, rank: int) -> int:
    """Load the newest whole checkpoint in OUT_DIR, if there is one; return the step to start from.

    Any world size or --parallel resumes (DCP reshards); another model config is refused. A changed
    schedule, --max_steps, seed or weight decay is the user's choice: said in one line, and applied (the
    optimizer's settings are this run's, its moments the checkpoint's). `parts`: the model, or this rank's
    pipeline stages, each with its optimizer. The optimizer's state is
    created where a fresh run creates it (get_state_dict takes one step of zero gradients at lr 0:
    moments beside the parameters, `step` on the CPU unless fused) and the saved values are copied in:
    never Adam's `step` moved to the GPU, where every later step would sync on it (pytorch#128208)."""
    found = checkpoints.newest()
    if found is None:
        return 0
    folder, manifest = found
    if manifest["step"] > args.max_steps:
        raise ValueError(f"checkpoint {folder} is at step {manifest['step']}, beyond --max_steps {args.max_steps}")
    if not checks.same_config(manifest.get("config"), config):
        raise ValueError(f"checkpoint {folder} is of another model ({manifest.get('config')}), not {asdict(config)}: "
                         "give another --out_dir, or the --model, --seq_len and data it was trained with")
    state = parallelize.state_dict(parts, optimizers)
    checkpoints.load(folder, state)
    own = [{k: v for k, v in group.items() if k != "params"} for optimizer in optimizers
           for group in optimizer.param_groups]
    parallelize.load_state_dict(parts, optimizers, state)  # new param_groups: load_state_dict replaces them
    for group, settings in zip([g for optimizer in optimizers for g in optimizer.param_groups], own, strict=True):
        # load_state_dict brings back the saved groups' settings too: a changed --weight_decay would be
        # said below and not applied, and a CPU checkpoint resumed on a GPU would run unfused
        group.update(settings)
    if manifest["scaler"]:
        scaler.load_state_dict(manifest["scaler"])
    if rank == 0:
        print(f"resuming from {folder}: step {manifest['step']} of {args.max_steps}" + (
            ": the run had finished, and nothing is trained (a larger --max_steps trains on)"
            if manifest["step"] == args.max_steps else ""), flush=True)
        world_size = dist.get_world_size()
        run = {**{f"--{name}": getattr(args, name) for name in RUN}, "ranks": world_size,
               "global batch": args.batch_size * args.grad_accum * world_size // (args.tp * args.pp * args.cp)}
        changed = [f"{name} {value} (was {was})" for name, value in run.items()  # --pp, --cp say their methods'
                   if (was := manifest["run"].get(name, value)) != value
                   and (name not in ("--pp_schedule", "--cp_method") or None not in (was, value))]
        schedule = [name for name in ("lr", "min_lr", "warmup_steps", "max_steps")
                    if manifest["run"].get(f"--{name}", getattr(args, name)) != getattr(args, name)]
        old = argparse.Namespace(**{**vars(args), **{n: manifest["run"][f"--{n}"] for n in schedule}})
        lr = ""
        if lr_at(manifest["step"], old) != lr_at(manifest["step"], args):  # the new schedule from the next step on
            lr = (f"; the learning rate of step {manifest['step'] + 1}: {lr_at(manifest['step'], args):.2e} (the "
                  f"old schedule's: {lr_at(manifest['step'], old):.2e})")
        if changed:
            print(f"changed since that checkpoint, as asked: {', '.join(changed)}{lr}", flush=True)
    return manifest["step"]


def train_step(model: torch.nn.Module | pipeline.Pipeline, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler, autocast, mesh, batch: tuple[torch.Tensor, torch.Tensor], lr: float,
               args: argparse.Namespace, loss_sum: torch.Tensor) -> torch.Tensor:
    """One optimizer step on this rank's share of the batch, (inputs, targets) of --batch_size × --grad_accum
    sequences: a forward and a backward per micro-batch (under --pp, the schedule runs them), the gradient's
    norm clipped, the optimizer stepped. Adds the loss to loss_sum (on the device: no host sync) and returns the
    gradient's norm before clipping, on the device too."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = batch
    if isinstance(model, pipeline.Pipeline):  # loss_sum gains the micro-batches' mean on the last stage, 0 elsewhere
        loss_sum += model.step(x, y)
    for micro in range(0 if isinstance(model, pipeline.Pipeline) else args.grad_accum):
        rows = slice(micro * args.batch_size, (micro + 1) * args.batch_size)
        with parallelize.loss_context(mesh):  # tp: the forward's and the backward's cross-entropy
            with parallelize.gradient_sync(model, micro == args.grad_accum - 1), autocast:
                # each token's loss (batch × seq), fp32; / grad_accum: the micro-steps' mean (the ranks': DDP, FSDP)
                loss = model(x[rows], y[rows]).mean() / args.grad_accum
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
    parallelize.tp_moe_gradients(model)  # --tp: the experts' gradients, each tp rank's tokens', summed
    pipe = model if isinstance(model, pipeline.Pipeline) else None
    grad_norm = (pipe or parallelize).clip_gradients(*([] if pipe else [model]), args.grad_clip)
    scaler.step(optimizer)
    parallelize.moe_step(model)  # the experts' routing: DeepSeek's bias
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device
          ) -> tuple[torch.nn.Module | int, dict | None]:
    """(The trained model, or the number of the signal that stopped the run before --max_steps (it
    is saved); gpt/prepare.py's record of the tokenizer that made --data's ids, or None)."""
    # Refused before OUT_DIR is made: what any rank finds is the job's error (checks.agree). Then OUT_DIR, its
    # lock, and only then the data read in full: a job refused for a held lock reads none.
    tokens, config = checks.arguments_and_data(args, world_size)
    checks.out_dir(args, rank)
    checkpoints = Checkpoints(args.out_dir, rank, world_size, args.keep, args.timeout or 1800.0)
    try:
        try:
            no_lock = checkpoints.lock()
        except ValueError as error:  # every rank raises rank 0's verdict: named as rank 0's on every host
            checks.agree(str(error) if rank == 0 else None)
            raise
        checks.token_ids(args, tokens, rank, world_size, device)
        return train_steps(args, config, tokens, checkpoints, no_lock, rank, world_size, device), tokens.tokenizer
    finally:
        checkpoints.close()  # the save in flight finishes first


def train_steps(args: argparse.Namespace, config: GPTConfig, tokens: data.Tokens, checkpoints: Checkpoints,
                no_lock: str | None, rank: int, world_size: int, device: torch.device) -> torch.nn.Module | int:
    mesh = parallelize.make_mesh(args, world_size, device)
    with torch.device("meta"):  # no memory: parallelize_gpt gives each rank what it holds, and the weights
        gpt = GPT(config)
    n_params, flops_per_token = gpt.num_params(), gpt.flops_per_token()
    resuming = [bool(checkpoints.committed())]  # a checkpoint comes first: --init_from's folder is then not read
    dist.broadcast_object_list(resuming, src=0)  # rank 0's view of OUT_DIR, as Checkpoints.newest() takes it
    start = hf.from_hf(args.init_from, config) if args.init_from and not resuming[0] else None  # checked already
    model = parallelize.parallelize_gpt(gpt, mesh, args, device, start=start)
    del start
    dp_rank, dp_size = parallelize.data_rank(mesh, rank, world_size)  # a tp group's ranks read the same batch
    pipe = model if isinstance(model, pipeline.Pipeline) else None  # --pp: this rank's stages, and their schedule
    parts = pipe.parts if pipe else [model]
    optimizers = [make_optimizer(part, args) for part in parts]  # a stage's state: its module's and its own
    optimizer = pipeline.Optimizers(optimizers) if pipe else optimizers[0]
    dtype = DTYPES[args.precision]
    # DDP computes in `dtype` under autocast; FSDP casts its weights through the policy instead.
    autocast = torch.autocast(device.type, dtype=dtype, enabled=args.parallel == "ddp" and dtype != torch.float32)
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")  # fp16's range needs scaling
    global_batch = args.batch_size * args.grad_accum * dp_size
    val_starts = data.val_starts(len(tokens.val), args.seq_len, args.val_tokens)
    peak = peak_flops(args, device)
    if rank == 0:
        shape = " × ".join(f"{name} {n}" for name, n in zip(mesh.mesh_dim_names, mesh.shape, strict=True)) \
            if mesh is not None and mesh.ndim > 1 else ""
        print(f"gpt {args.model or args.init_from} ({n_params / 1e6:.2f}M parameters) | {args.parallel} on "
              f"{world_size} rank{'s' if world_size > 1 else ''}{f' ({shape})' if shape else ''}"
              f"{f', schedule {args.pp_schedule}' if args.pp > 1 else ''}{f', ep {args.ep}' if args.ep > 1 else ''}"
              f"{f', cp by {args.cp_method}' if args.cp > 1 else ''}, "
              f"{device.type}"
              f"{'' if args.activation_checkpoint == 'none' else f', {args.activation_checkpoint} checkpointing'} | "
              f"data {tokens.summary()} | global batch {global_batch} × {args.seq_len} tokens"
              f"{f' | weights from {args.init_from}' if args.init_from and not resuming[0] else ''}", flush=True)
        if args.cp > 1 and args.cp_method == "ulysses" and config.n_kv_head // args.tp % args.cp:
            print(context.repeated_heads(args, config), flush=True)
        node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if node % args.tp:  # tp innermost: its groups stay in a node only if they tile it
            print(f"--tp {args.tp}: its groups span nodes of {node} ranks, and tp's collectives (12 a block a step) "
                  "cross them", flush=True)
        for line in [no_lock] if no_lock else []:
            print(line, flush=True)
        if args.warmup_steps >= args.max_steps:  # said, not refused: a short test run may mean it
            print(f"--warmup_steps {args.warmup_steps} spans the whole run (--max_steps {args.max_steps}): the "
                  f"learning rate rises to {lr_at(args.max_steps - 1, args):.2e} at the last step, with no decay",
                  flush=True)
        if len(val_starts) < max(1, args.val_tokens // args.seq_len) and len(tokens.val) < args.val_tokens:
            print(f"validation: {len(val_starts) * args.seq_len:,} tokens, what the val split's {len(tokens.val):,} "
                  f"tokens hold in windows of --seq_len (--val_tokens {args.val_tokens:,} asks more)", flush=True)
        if device.type == "cuda" and peak is None:
            print(f"no mfu: the peak of {torch.cuda.get_device_name(device)} is not known; give --peak_tflops",
                  flush=True)
    first_step = resume(args, checkpoints, parts, optimizers, scaler, config, rank)
    metrics, problem = None, None  # rank 0's metrics.jsonl, TensorBoard, W&B
    if rank == 0:
        try:
            metrics = trackers.Trackers(args, first_step, {**options.values(args, parser()), "ranks": world_size})
        except ValueError as error:  # W&B's: no API key, say
            problem = str(error)
    checks.agree(problem)
    if rank == 0:  # what this run resolved, once it is OUT_DIR's run: --config OUT_DIR/config.toml reruns it
        options.save(args, parser(), os.path.join(args.out_dir, "config.toml"))
    if isinstance(model, DDP) and first_step < args.max_steps:
        starts = data.batch_starts(first_step, args.seed, len(tokens.train), args.seq_len, global_batch)
        x = data.windows(tokens.train, starts[:args.batch_size], args.seq_len, device)[0]
        parallelize.settle_buckets(model, x, autocast)

    def log(record: dict, line: str) -> None:
        if rank == 0:  # after every rank's collective: never a collective inside this guard
            print(line, flush=True)
            metrics.write(record)

    def save(step: int) -> None:
        extra = {"config": asdict(config), "run": {**{f"--{n}": getattr(args, n) for n in RUN}, "ranks": world_size,
                                                   "global batch": global_batch},
                 "scaler": scaler.state_dict() if scaler.is_enabled() else None, "tokenizer": tokens.tokenizer}
        checkpoints.save(parallelize.state_dict(parts, optimizers), step, extra)

    def not_finite(what: str, step: int) -> None:
        checkpoints.wait()  # the save in flight is committed (or fails) first: `last` is the newest
        last = checkpoints.committed()
        raise ValueError(f"{what} are not finite at step {step + 1}: stopped without saving"
                         + (f"; the last checkpoint, {last[-1]}, is untouched" if last else ""))

    loss_sum = torch.zeros((), device=device)  # on the device until a log line: no host sync per step
    steps_since_log, started, profiler, profiled_step = 0, time.perf_counter(), None, contextlib.ExitStack()
    # Python's garbage collector would pause each rank at its own moments, and every other rank waits in the
    # next collective: everything built so far is frozen (never scanned again) and collections run on every
    # rank at the same steps (as torchtitan and nanochat do).
    gc.collect()
    gc.freeze()
    gc.disable()
    # Traced: --profile's steps from this run's first (a resume may start inside them) to its last.
    profile_from = max(args.profile[0], first_step + 1) if args.profile else 0
    if rank == 0 and args.profile and profile_from > args.profile[1]:
        print(f"no profile: this run starts at step {first_step + 1}, past --profile {args.profile[0]}:"
              f"{args.profile[1]}", flush=True)
    stop = StopRequest(args.timeout)  # its first agreement starts here: from now on, the finally below waits for it
    try:
        for step in range(first_step, args.max_steps):
            if args.profile and step + 1 == profile_from:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []))
                profiler.start()
            if profiler:  # each step a named range in the trace
                profiled_step.enter_context(torch.profiler.record_function(f"step {step + 1}"))
            if step % GC_EVERY == 0:
                gc.collect()
            lr = lr_at(step, args)
            starts = data.batch_starts(step, args.seed, len(tokens.train), args.seq_len, global_batch)
            mine = starts[dp_rank * args.batch_size * args.grad_accum:][:args.batch_size * args.grad_accum]
            grad_norm = train_step(model, optimizer, scaler, autocast, mesh, data.windows(
                tokens.train, mine, args.seq_len, device), lr, args, loss_sum)
            steps_since_log += 1
            done = step + 1 == args.max_steps
            # a signal to any rank stops every rank after this same step; at --max_steps the run is done anyway
            stopping = stop.agreed() and not done
            saving = done or stopping or (args.save_every and (step + 1) % args.save_every == 0)
            if (step + 1) % args.log_every == 0 or done or saving:
                dist.all_reduce(loss_sum)  # every rank's sequences (gloo has no AVG: sum, then divide)
                # the one host sync of the interval; under --pp, the last stage's ranks alone had a loss
                loss = loss_sum.item() / (world_size // args.pp * steps_since_log)
                now = time.perf_counter()
                interval, tokens_per_s = now - started, steps_since_log * global_batch * args.seq_len / (now - started)
                started = now  # all that follows counts in the next interval: a save's copy to CPU memory too
                # fp16: an infinite gradient is the scaler's to handle (it skips the step, lowers the scale)
                if not (math.isfinite(loss) and (scaler.is_enabled() or math.isfinite(grad_norm.item()))
                        and (not saving or weights_are_finite(list(model.parameters())))):
                    # The same all-reduced loss, global norm and weights' verdict on every rank: all stop
                    # here, and nothing is saved over the last good checkpoint.
                    not_finite(f"the loss ({loss}), the gradient's norm ({grad_norm.item()}) or the weights", step)
                record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(),
                          "tokens_per_s": tokens_per_s}
                line = (f"step {step + 1}/{args.max_steps} | loss {loss:.4f} | lr {lr:.2e} | grad_norm "
                        f"{grad_norm.item():.3f} | {tokens_per_s:,.0f} tok/s")
                record, line = parallelize.moe_metrics(model, record, line)  # the experts' figures, if any
                if peak:
                    record["mfu"] = tokens_per_s * flops_per_token / (world_size * peak)
                    line += f" | mfu {record['mfu']:.1%}"
                if pipe:  # each stage's share of step() spent waiting, the most micro-batches it held: pipeline.py
                    stages = pipe.report()  # every rank (a gather over its pipeline); a host sync, as .item() above
                    record["pp_wait"] = [round(r["wait"], 4) for r in stages]
                    record["pp_held"] = {s: n for r in stages for s, n in r["held"].items()}
                    line += " | pp wait " + " ".join(f"{r['wait']:.0%}" for r in stages)
                    if done and rank == 0:  # the last step's timeline of each stage: gpt/plot.py --pipeline draws it
                        with open(os.path.join(args.out_dir, "pp_timeline.json"), "w") as file:
                            json.dump({"schedule": args.pp_schedule, "pp": args.pp, "micro_batches": args.grad_accum,
                                       "ranks": [r["timeline"] for r in stages]}, file)
                if args.cp_method == "ring":  # every rank: one all-reduce
                    record, line = context.wait_metrics(record, line, interval, device)
                memory, words = peak_memory(device)
                left = "" if done else f" | {time_left((args.max_steps - step - 1) * interval / steps_since_log)}"
                log({**record, **memory}, f"{line} | {words}{left}")
                loss_sum.zero_()
                steps_since_log = 0
            if (step + 1) % args.eval_every == 0 or done:
                eval_started, waited = time.perf_counter(), context.WAITED[0]
                val_loss = evaluate(model, tokens, val_starts, args, mesh, dp_rank, dp_size, device, autocast)
                context.WAITED[0] = waited  # the ring's waits in evaluation are not training's either
                record, line = {"step": step + 1, "val_loss": val_loss}, f"step {step + 1} | val_loss {val_loss:.4f}"
                if tokens.floor is not None:
                    record["floor"] = tokens.floor
                    line += f" | floor {tokens.floor:.4f} ({val_loss / tokens.floor:.3f} × floor)"
                memory, words = peak_memory(device)
                log({**record, **memory}, f"{line} | {words}")
                started += time.perf_counter() - eval_started  # evaluation is not training time
                if not (stopping or done) and stop.now():  # a signal during it: agreed now, not intervals later
                    stopping = saving = True
                    if not weights_are_finite(list(model.parameters())):  # as above: the last checkpoint stays
                        not_finite("the weights", step)
            if saving:
                save(step + 1)
            profiled_step.close()
            if profiler and (step + 1 == args.profile[1] or stopping):  # a stop ends the trace too
                profiler.stop()
                path = os.path.join(args.out_dir, "profile", f"steps_{profile_from}-{step + 1}_rank{rank}.json")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                profiler.export_chrome_trace(path)
                profiler = None
                if rank == 0:
                    print(f"profile of steps {profile_from} to {step + 1}: {path}, one file per rank (open it in "
                          "https://ui.perfetto.dev)", flush=True)
            if stopping:
                checkpoints.wait()  # inside torchrun's shutdown window (30 s), then out
                if rank == 0:
                    print(f"stopped by {stop.name} after step {step + 1}: saved "
                          f"{os.path.join(args.out_dir, checkpoints.committed()[-1])}; the same command resumes",
                          flush=True)
                return stop.number  # no model: --export asks for the one at --max_steps
        checkpoints.wait()
    finally:
        stop.restore()
        if profiler:  # a run that failed inside the traced steps: no trace
            profiler.stop()
        gc.enable()
        gc.unfreeze()
        if metrics:
            metrics.close(failed=sys.exc_info()[0] is not None)  # W&B marks the run failed
    return model


def export_model(model: torch.nn.Module | pipeline.Pipeline, path: str, rank: int, tokenizer: dict | None) -> None:
    """The whole model as a plain state_dict on rank 0. Under FSDP every rank must take part: the
    full tensors are gathered from every shard (and under --pp, from every stage)."""
    if isinstance(model, pipeline.Pipeline):
        state = model.full_state_dict()
        if rank == 0:
            export(path, model.parts[0].config, state, tokenizer)
        return
    gpt = model.module if isinstance(model, DDP) else model
    if not isinstance(gpt, FSDPModule):  # ddp (at one rank, the model alone): every rank holds all of it
        state = gpt.state_dict()
    else:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # one writer
        state = {name: tensor.cpu() for name, tensor in state.items()}
        first = {}
        for name, param in gpt.named_parameters(remove_duplicate=False):  # tied weights: one tensor, saved once
            state[name] = state[first.setdefault(id(param), name)]
        export(path, gpt.config, state, tokenizer)


def train_and_export(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> int:
    """0, or 128 + the signal that stopped the run: not done, so no launcher or scheduler takes it
    for a success. The model is a local here, freed on return: a DDP wrapper still alive at
    destroy_process_group() keeps gloo's threads running (docs/pitfalls.md)."""
    model, tokenizer = train(args, rank, world_size, device)
    if isinstance(model, int):
        return 128 + model
    if args.export:  # with the record of the tokenizer that made --data's shards, where prepare.py made them
        export_model(model, args.export, rank, tokenizer)
        if rank == 0:
            print(f"exported to {args.export}", flush=True)
    return 0


def main() -> None:
    args = parse_args()
    rank, _, world_size, device = setup(args)
    try:
        code = train_and_export(args, rank, world_size, device)
    except ValueError as error:  # bad input, agreed by every rank: one line (checks.report)
        checks.report(error, rank)
        sys.exit(1)
    except Exception as error:  # one rank's own failure, or a peer's seen as a failed collective
        if checks.failure(error, rank):  # another rank's came first: said in one line
            sys.exit(1)
        raise  # the first failure: its traceback
    finally:
        dist.destroy_process_group()
    sys.exit(code)


if __name__ == "__main__":
    main()
