"""ZeRO stage 1 under DDP: each rank keeps the optimizer state of its own share of the parameters.

`diff singlenode_cpu.py zero_optimizer.py` is the lesson (docs/sharding.md): a rank keeps Adam's state (8 of
DDP's 16 bytes per parameter) of its own parameters only, updates them, broadcasts them; prints what it holds.

    torchrun --standalone --nproc-per-node 2 zero_optimizer.py  # and with --no_zero
    torchrun --standalone --nproc-per-node 3 zero_optimizer.py --checkpoint zero.pt  # again: it resumes
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
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
    parser.add_argument("--model", default="wide", choices=["mlp", "linear", "wide"], help="a model of model.py")
    parser.add_argument("--no_zero", action="store_true", help="plain Adam on every rank: DDP's memory, to compare")
    parser.set_defaults(max_epochs=3, lr=1e-3, train_size=1024)  # the wide model: seconds on 2 cores, no overshoot
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size"):
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


def bytes_held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Bytes of the parameters, gradients and Adam's state (2 moments and a step count each) on this rank."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer  # ZeRO: its own Adam
    params, state = list(model.parameters()), [t for entry in local.state.values() for t in entry.values()]
    sizes = [sum(t.nbytes for t in ts if t is not None) for ts in (params, [p.grad for p in params], state)]
    return "parameters {:,} | gradients {:,} | optimizer state {:,}".format(*sizes)


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
        optimizer.step()  # ZeRO: Adam on this rank's parameters, then each broadcast from its rank to all
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
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` it would hang."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(args.model)
    # ZeRO: each rank's own Adam, for a share of whole parameters dealt out largest first to the emptiest rank
    optimizer = (torch.optim.Adam(model.parameters(), lr=args.lr) if args.no_zero  # all the state on every rank
                 else ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr))
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # Every rank loads its replica; map_location: not onto the saver's device. weights_only: no code runs.
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])  # ZeRO keeps the entries of this rank's parameters
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    model = DDP(model, gradient_as_bucket_view=True)  # each .grad a view into DDP's buckets, not a second copy
    step_time = 0.0
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        started = time.perf_counter()
        train_totals = train_one_epoch(model, train_loader, optimizer)
        step_time += (time.perf_counter() - started) / len(train_loader)
        if epoch == start_epoch:  # after a step: Adam's state exists
            print(f"[rank {rank}/{world_size}] bytes held: {bytes_held(model, optimizer)}\n", end="", flush=True)
        val_totals = evaluate(model.module, val_loader)  # .module: a forward through DDP may wait for ranks
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if args.checkpoint and not args.no_zero:  # a collective: the others broadcast their shares, rank 0 keeps them
            optimizer.consolidate_state_dict(to=0)  # without it rank 0's state_dict() raises, or is stale
        if rank == 0:  # one writer; no barrier after it, as no rank reads the file during the run
            if args.checkpoint:  # .module: keys without DDP's "module." prefix, loadable by a plain model
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"step time: {1e3 * step_time / (args.max_epochs - start_epoch):.2f} ms\ndone | val_loss:{val_loss:.6f} "
              f"floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)", flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 zero_optimizer.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > args.train_size:
        raise SystemExit(f"error: {world_size} ranks but {args.train_size} training samples: each needs one")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises: gloo's threads end with the group
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
