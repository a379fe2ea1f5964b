"""Debugging a hang: singlenode_cpu.py with a barrier that only rank 0 calls, made to fail and say where.

`diff singlenode_cpu.py debug_hang.py` is the lesson (docs/batchnorm_model_parallel_hangs.md). The other ranks
never reach rank 0's barrier and wait in their next all-reduce, silent for the group's timeout (gloo's default: 30 min).

    torchrun --standalone --nproc-per-node 2 debug_hang.py --timeout 2
    torchrun --standalone --nproc-per-node 3 debug_hang.py --timeout 2 --monitored_barrier  # names the absent
    torchrun --standalone --nproc-per-node 2 debug_hang.py --fixed  # the barrier on every rank: no hang
"""
import argparse
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import LOSS_FLOOR, make_datasets
from model import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffle")
    parser.add_argument("--train_size", type=int, default=4096, help="training samples")
    parser.add_argument("--val_size", type=int, default=1024, help="validation samples")
    parser.add_argument("--checkpoint", default=None, help="saved after every epoch; resumed from if it exists")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds any collective waits for its peers")
    parser.add_argument("--monitored_barrier", action="store_true", help="rank 0 names the ranks that never arrive")
    parser.add_argument("--fixed", action="store_true", help="every rank calls the barrier: nothing waits")
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size", "timeout"):
        if not 0 < getattr(args, name) < 1e7:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e7, got {getattr(args, name)}")
    return args


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Rank r takes samples r, r + N, r + 2N, ... of a permutation of seed + epoch, repeating a few if N does
    # not divide the size: a rank with an extra step would wait for ever in that step's all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # Validation all-reduces no gradients, so it needs no equal steps: a strided shard, no repeats.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)
    return train_loader, val_loader


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
        optimizer.step()
        loss_sum += loss.detach() * len(y)  # stays a tensor: no sync per step
    return loss_sum, len(loader.sampler)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        loss_sum += F.mse_loss(model(x), y, reduction="sum")
    return loss_sum, len(loader.dataset)


def epoch_means(train_totals: tuple, val_totals: tuple) -> tuple[float, float]:
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` the others never join."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def barrier(args: argparse.Namespace) -> None:
    if args.monitored_barrier:  # gloo only: rank 0 names who never came. No timeout=: gloo's 30 min, not the group's
        dist.monitored_barrier(timeout=timedelta(seconds=args.timeout), wait_all_ranks=True)
    else:
        dist.barrier()


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # Every rank loads its replica; map_location: not onto the saver's device. weights_only: no code runs.
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    model = DDP(model)  # broadcasts rank 0's weights; each backward averages the gradients
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer)
        val_totals = evaluate(model.module, val_loader)  # .module: a forward through DDP may wait for ranks
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if rank == 0:  # one writer
            if args.checkpoint:  # .module: keys without DDP's "module." prefix, loadable by a plain model
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
            if not args.fixed:  # THE BUG: a collective behind a rank guard, which no other rank calls
                barrier(args)
        if args.fixed:  # on every rank, as every collective must be
            barrier(args)
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model.module


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 debug_hang.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > args.train_size:
        raise SystemExit(f"error: {world_size} ranks but {args.train_size} training samples: each needs one")
    # timeout: how long a collective waits for its peers, so also the longest a rank may lag behind (a slow save)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout))
    try:  # destroy also when training raises: gloo's threads end with the group
        train(args, rank, world_size)
    except RuntimeError as error:  # a collective gave up: one line per rank, with the line of this file it was in
        where = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == __file__][-1]
        print(f"error: [rank {rank}/{world_size}] {where.name}: {where.line.split('  #')[0]}: {error}", file=sys.stderr)
        os._exit(1)  # no teardown: torch 2.13 can deadlock destroying a gloo group whose collective failed
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
