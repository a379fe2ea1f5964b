"""A model on two devices under DDP: model parallelism inside each process, data parallelism across them.

`diff singlenode_cpu.py model_parallel.py` is the lesson (docs/batchnorm_model_parallel_hangs.md). When a replica
does not fit on one GPU, a process can hold it on two: the first layers on one, the rest on the other, its forward
copying the activations across. DDP wraps such a module with no device_ids. Here both devices are the CPU, so this shows
the API, not two devices at work; on GPUs, local rank r would take cuda:2r and cuda:2r+1, with nccl.

    torchrun --standalone --nproc-per-node 2 model_parallel.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch import nn
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


class TwoStages(nn.Module):
    """model.py's MLP cut in two: its Linear and Tanh on `first`, its last Linear on `second`."""

    def __init__(self, net: nn.Sequential, first: torch.device, second: torch.device) -> None:
        super().__init__()
        self.first, self.second = first, second
        self.stage0, self.stage1 = net[:2].to(first), net[2:].to(second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.stage0(x.to(self.first))
        # The activations cross to the second device, and backward sends their gradient the other way. Each
        # device waits while the other computes: pipelining (micro-batches in flight) is what fills that time.
        return self.stage1(hidden.to(self.second))  # (batch, 1), on the second device


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = TwoStages(build_model().net, torch.device("cpu"), torch.device("cpu"))  # parameters in the same order
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
    # No device_ids: DDP refuses them for a module on several devices; its forward places input and output.
    model = DDP(model)  # broadcasts rank 0's weights; each backward averages the gradients, each bucket on its device
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer)
        val_totals = evaluate(model.module, val_loader)  # .module: a forward through DDP may wait for ranks
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if rank == 0:  # one writer; no barrier after it, as no rank reads the file during the run
            if args.checkpoint:  # .module: keys without DDP's "module." prefix, loadable by a plain model
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model.module


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 model_parallel.py")
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
