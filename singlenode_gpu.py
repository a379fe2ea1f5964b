"""Data-parallel training on one machine's GPUs: torchrun starts one process per GPU, nccl connects them.

The same training as singlenode_cpu.py; what changes is the device. Each process binds the GPU
named by its LOCAL_RANK before it joins the process group, DDP gets device_ids=[local_rank],
batches are copied from pinned memory without blocking, and the forward pass can run in bf16,
or in fp16 with a GradScaler, which must unscale the gradients before --clip_grad_norm clips them.

    torchrun --standalone --nproc-per-node 2 singlenode_gpu.py
    torchrun --standalone --nproc-per-node 8 singlenode_gpu.py --precision bf16
    torchrun --standalone --nproc-per-node 8 singlenode_gpu.py --precision fp16 --clip_grad_norm 1.0 --compile

These models have no batch norm; sync_batchnorm.py shows torch.nn.SyncBatchNorm, which runs on
GPU modules only, and the same synchronisation by hand on CPUs.
Explained in docs/first_training.md.
"""
import argparse
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

import common
from data import LOSS_FLOOR, make_datasets
from model import build_model

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser)
    common.reject_old_launcher_flag(parser)
    common.add_step_args(parser, PRECISIONS,
                         "forward-pass precision: bf16 autocast, or fp16 autocast with a GradScaler")
    return parser.parse_args()


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Each rank draws a disjoint 1/world_size of a shuffled epoch. When the size is not divisible,
    # the sampler repeats a few samples so that every rank runs the same number of steps: a rank
    # with an extra step would wait forever in that step's all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    # Pinned (page-locked) host memory lets the copy to the GPU run without blocking.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
    # Validation needs no equal steps (no gradients to all-reduce), so take a strided shard with no
    # padding: each validation sample is counted exactly once.
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size, pin_memory=True)
    return train_loader, val_loader


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                    dtype: torch.dtype, scaler: torch.amp.GradScaler, clip_grad_norm: float | None):
    """Train on this rank's shard; return (sum of loss × samples, samples, steps before the first
    loss that was not finite) for this rank."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    finite_steps = torch.zeros((), dtype=torch.int64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.mse_loss(model(x).float(), y)  # the loss itself in fp32
        # fp16 gradients can underflow to 0: the scaler multiplies the loss up and the gradients
        # back down, and skips a step whose gradients overflowed. A no-op unless enabled.
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
        if clip_grad_norm:
            # The gradients are still multiplied by the scaler's scale: unscale them first, or the norm
            # measured is the scaled one. (step() then does not unscale again; a no-op unless fp16.)
            scaler.unscale_(optimizer)
            # After backward, so after the all-reduce: every rank clips the same averaged gradient
            # by the same factor, and the replicas stay identical.
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach() * len(y)  # stays on the device: no sync per step
        finite_steps += torch.isfinite(loss_sum)  # a nan or inf loss leaves the sum non-finite for good
        samples += len(y)
    return loss_sum, samples, finite_steps


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, dtype: torch.dtype = torch.float32):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum += F.mse_loss(model(x).float(), y, reduction="sum")
        samples += len(y)
    return loss_sum, samples


def epoch_means(train_totals: tuple, val_totals: tuple, device: torch.device) -> tuple[float, float]:
    """Exact means over every sample of every rank. Each rank's own number covers only its shard,
    so one all_reduce of the sums and counts is needed; it runs on every rank, never behind a
    rank guard, or the ranks that skip it leave the others waiting."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    train_loss_sum, train_samples, val_loss_sum, val_samples = totals.tolist()
    return train_loss_sum / train_samples, val_loss_sum / val_samples


def resume(args: argparse.Namespace, rank: int, world_size: int, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, checkpoints: common.Checkpoints,
           device: torch.device) -> int:
    """Load the checkpoint, if there is one, on every rank; return the next epoch to run."""
    # map_location: without it every rank loads the tensors onto the device they were saved from.
    checkpoint, found = checkpoints.load(device, common.run_config(args, world_size), model, optimizer)
    # Each rank read the file for itself, so compare what they found before anything is trained or
    # saved: a rank on a node that cannot see the file (a node-local path, a stale mount) would start
    # afresh while rank 0 resumes, and rank 0 would save the mixture. Every rank takes part, and if
    # any one cannot go on, every one stops with the same line.
    found_by_rank = [None] * world_size
    dist.all_gather_object(found_by_rank, found)
    checkpoints.require_agreement(found_by_rank)
    if checkpoint is None:
        return 0
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if "scaler" in checkpoint:
        scaler.load_state_dict(checkpoint["scaler"])
    if rank == 0 and checkpoint["epoch"] < args.max_epochs:  # else train() says there is nothing to do
        print(f"resuming from {args.checkpoint}: {checkpoint['epoch']} of {args.max_epochs} epochs done", flush=True)
    # The shuffle is the run's only randomness after the weights are drawn, and DistributedSampler
    # derives it from seed + epoch, so no random-number state needs saving. (Dropout would change that.)
    return checkpoint["epoch"]  # the next epoch to run: none is repeated


def settle_buckets(model: DDP, loader: DataLoader, device: torch.device, dtype: torch.dtype) -> None:
    """One backward pass with all-zero gradients, so that every real step uses the same buckets.

    DDP's first backward all-reduces the gradients in one bucket laid out in the order the model
    defines its parameters (with find_unused_parameters=False, the default, whatever the model's
    size); then it rebuilds its buckets in the order the gradients became ready. With 3 or more
    ranks, where a number sits in a bucket decides the order in which the backend adds up the
    ranks' values, and so how the sum is rounded. After this pass every step of a fresh run and of
    a resumed one uses the rebuilt layout, and a resumed run ends bit for bit equal to an
    uninterrupted one. The weights and the optimizer are untouched, and in eval mode no batch-norm
    statistics change and no dropout is drawn.
    """
    model.eval()  # train_one_epoch switches back
    x, _ = next(iter(loader))
    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):  # the graph of a real step
        output = model(x.to(device))
    output.float().sum().mul(0).backward()  # all-reduces zeros, as every backward does
    model.zero_grad(set_to_none=True)


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    common.print_line(
        f"[rank {rank}/{world_size}] device {device} | batch_size {args.batch_size} | "
        f"steps per epoch {len(train_loader)}"
    )
    # The same seed on every rank gives every replica the same initial weights. (DDP also
    # broadcasts rank 0's weights when it wraps the model: a second line of defence.)
    torch.manual_seed(args.seed)
    model = build_model(args.model).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    dtype = PRECISIONS[args.precision]
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")

    # Every rank reads the checkpoint. Global rank 0 alone writes it (one writer, not one per node),
    # in the background, and holds a lock on it that keeps a second job off the same path.
    checkpoints = common.Checkpoints(args.checkpoint, rank) if args.checkpoint else None
    try:
        start_epoch = resume(args, rank, world_size, model, optimizer, scaler, checkpoints, device) \
            if checkpoints else 0
        if args.compile:
            # The module inside DDP, not the wrapper: dynamo traces the model alone, and still cuts its
            # graph at DDP's bucket boundaries (DDPOptimizer), so that each bucket's all-reduce starts
            # while the rest of backward runs. dynamic=True: one graph for every batch size, where the
            # default would compile again at the first batch of a new size (an epoch's shorter last one).
            model.compile(dynamic=True)
        # device_ids: this process's one GPU, named by its local rank (the global rank breaks on node 2).
        model = DDP(model, device_ids=[local_rank])
        started = time.perf_counter()
        settle_buckets(model, train_loader, device, dtype)  # the first forward and backward: --compile compiles here
        if rank == 0 and args.compile:
            print(f"compile: the first forward and backward took {time.perf_counter() - started:.1f} s", flush=True)

        for epoch in range(start_epoch, args.max_epochs):
            # Reseeds the shuffle with the epoch; without it every epoch sees the same order.
            train_loader.sampler.set_epoch(epoch)
            loss_sum, samples, finite_steps = train_one_epoch(model, train_loader, optimizer, device, dtype, scaler,
                                                              args.clip_grad_norm)
            # Evaluate the plain module: ranks may hold different numbers of validation batches, and a
            # forward through the DDP wrapper may wait for the other ranks.
            val_totals = evaluate(model.module, val_loader, device, dtype)
            train_loss, val_loss = epoch_means((loss_sum, samples), val_totals, device)
            if not (math.isfinite(train_loss + val_loss) and common.all_finite(model.module)):
                # The all-reduced losses and the replicas' weights are the same on every rank, so every
                # rank stops here, before rank 0 could save the ruined weights over the last good
                # checkpoint; and every rank takes part in this all_reduce, which finds the first step
                # at which any rank's loss went bad (the last, if only the weights did).
                dist.all_reduce(finite_steps, op=dist.ReduceOp.MIN)
                step = min(finite_steps.item() + 1, len(train_loader))
                common.die(f"the loss or the weights stopped being finite in epoch {epoch}, by step {step} of "
                           f"{len(train_loader)}: stopped before saving (a learning rate too high, or weights that "
                           "were not finite in the checkpoint)", code=1)
            line = f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}"
            if rank == 0 and checkpoints:
                # .module unwraps DDP so the keys carry no "module." prefix and load into a plain model.
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch + 1, "config": common.run_config(args, world_size)}
                if scaler.is_enabled():  # fp16 only; --precision, in the config, must match on resume
                    state["scaler"] = scaler.state_dict()
                # The line is printed once the epoch is on disk: after a restart, no epoch shows up twice.
                checkpoints.save(state, line)
            elif rank == 0:
                common.print_line(line)
            # No barrier after the save: no other rank reads the file during the run.
    finally:
        if checkpoints:
            checkpoints.close()  # waits for the write in flight, also when training stops early

    if rank == 0:
        if start_epoch >= args.max_epochs:
            print(f"{args.checkpoint} already holds {start_epoch} epochs: nothing to train. "
                  "Raise --max_epochs or delete the file.", flush=True)
        else:
            print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
                  flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    launched = common.launcher_env()  # None without a launcher; one line if its variables are incomplete
    if launched is None:
        common.die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 singlenode_gpu.py")
    # torchrun sets these for every process it starts.
    rank, local_rank, world_size = launched
    common.check_sizes(args, world_size, procs_on_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    common.check_gpus(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc-per-node", "singlenode_cpu.py")

    device = torch.device("cuda", local_rank)
    # Before anything touches the GPU: without it every process would allocate on GPU 0.
    torch.cuda.set_device(device)
    # A stop signal ends this process at once, and so does torchrun's death (see common).
    common.exit_promptly_on_signals(launcher=common.PARENT_AT_START)

    timeout = timedelta(seconds=args.timeout)
    # torchrun's own store, in which each restart meets under keys of its own (common.torchrun_store
    # says why); None without one, and then env:// reads MASTER_ADDR and MASTER_PORT.
    # device_id binds this process's nccl communicator to its own GPU, and makes it at once.
    dist.init_process_group("nccl", store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device)
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()  # skips the interpreter's teardown of torch, seconds of an 8-process run (see common)
