"""Data-parallel training on one machine's GPUs: torchrun starts one process per GPU, nccl connects them.

`diff singlenode_cpu.py singlenode_gpu.py` is the lesson (docs/first_training.md): each process binds its local
rank's GPU, batches come from pinned memory, the forward runs in bf16, or fp16 with a GradScaler.

    torchrun --standalone --nproc-per-node 8 singlenode_gpu.py --precision fp16 --clip_grad_norm 1.0
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import LOSS_FLOOR, make_datasets
from model import build_model

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffle")
    parser.add_argument("--train_size", type=int, default=4096, help="training samples")
    parser.add_argument("--val_size", type=int, default=1024, help="validation samples")
    parser.add_argument("--checkpoint", default=None, help="saved after every epoch; resumed from if it exists")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32", help="dtype of the forward")
    parser.add_argument("--clip_grad_norm", type=float, default=None, help="largest norm of the gradients")
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size", "clip_grad_norm"):
        if getattr(args, name) is not None and not 0 < getattr(args, name) < 1e7:  # nan too; a clip of -1 flips
            parser.error(f"--{name} must be above 0 and below 1e7, got {getattr(args, name)}")
    return args


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Rank r takes samples r, r + N, r + 2N, ... of a permutation of seed + epoch, repeating a few if N does
    # not divide the size: a rank with an extra step would wait for ever in that step's all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, pin_memory=True)
    # Validation all-reduces no gradients, so it needs no equal steps: a strided shard, no repeats.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size,
                            pin_memory=True)  # pinned (page-locked) host memory: copies to the GPU need not block
    return train_loader, val_loader


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                    dtype: torch.dtype, scaler: torch.amp.GradScaler, clip_grad_norm: float | None):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.mse_loss(model(x).float(), y)  # the loss in fp32
        # fp16: the scaler scales the loss up (no gradient underflows to 0), then down; skips steps that overflow
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
        if clip_grad_norm:
            scaler.unscale_(optimizer)  # else the norm clipped would be the scaled one
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach() * len(y)  # stays a tensor: no sync per step
    return loss_sum, len(loader.sampler)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, dtype: torch.dtype):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss_sum += F.mse_loss(model(x).float(), y, reduction="sum")
    return loss_sum, len(loader.dataset)


def epoch_means(train_totals: tuple, val_totals: tuple, device: torch.device) -> tuple[float, float]:
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` the others never join."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64, device=device)  # nccl: on the GPU
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int) -> torch.nn.Module:
    device = torch.device("cuda", local_rank)
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model().to(device)
    scaler = torch.amp.GradScaler("cuda", enabled=args.precision == "fp16")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # Every rank loads its replica; map_location: not onto the saver's device. weights_only: no code runs.
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint.get("scaler") or scaler.state_dict())  # fp16's scale, or a fresh one
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    model = DDP(model, device_ids=[local_rank])  # this process's one GPU: the local rank, not the global one
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer, device, PRECISIONS[args.precision], scaler,
                                       args.clip_grad_norm)
        val_totals = evaluate(model.module, val_loader, device, PRECISIONS[args.precision])  # .module: see cpu
        train_loss, val_loss = epoch_means(train_totals, val_totals, device)
        if rank == 0:  # one writer; no barrier after it, as no rank reads the file during the run
            if args.checkpoint:  # .module: keys without DDP's "module." prefix, loadable by a plain model
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                         "scaler": scaler.state_dict()}
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model.module


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 8 singlenode_gpu.py")
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if not local_rank < torch.cuda.device_count():
        raise SystemExit(f"error: local rank {local_rank} but {torch.cuda.device_count()} GPUs: one process per GPU")
    if world_size > args.train_size:
        raise SystemExit(f"error: {world_size} ranks but {args.train_size} training samples: each needs one")
    torch.cuda.set_device(local_rank)  # before anything touches a GPU, or every process would use GPU 0
    # device_id: nccl binds the communicator to this process's GPU, and makes it at once.
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=torch.device("cuda", local_rank))
    try:  # destroy also when training raises
        train(args, rank, local_rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
