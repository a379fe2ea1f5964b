"""BatchNorm under DDP: each rank's own batch statistics, or the global batch's, and the running statistics.

`diff singlenode_cpu.py sync_batchnorm.py` is the lesson (docs/batchnorm_model_parallel_hangs.md): BatchNorm
normalises with its batch's statistics: under DDP each rank's own; synchronised, the global batch's, as in one process.

    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py
    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py --bn local
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
    parser.add_argument("--bn", choices=["sync", "local"], default="sync", help="the global batch's or each rank's")
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
        loss.backward()  # DDP all-reduces (averages) the gradients here; synchronised BatchNorm, its own too
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


class AllReduceSum(torch.autograd.Function):
    """dist.all_reduce (sum) that gradients flow through: each rank's loss depends on every rank's batch."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()  # all_reduce works in place
        dist.all_reduce(tensor)  # every rank runs the same forward, so calls it in the same order
        return tensor

    backward = forward  # the gradient of a sum over ranks is the sum of the ranks' gradients: nn.SyncBatchNorm's too


class HandSyncBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d over the global batch in training: nn.SyncBatchNorm by hand, since that refuses CPU tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, features)
        if not self.training:
            return super().forward(x)  # eval mode: the running statistics
        count = len(x) * dist.get_world_size()  # DistributedSampler gives every rank batches of one size
        total, total_of_squares = AllReduceSum.apply(torch.stack([x.sum(0), (x * x).sum(0)]))
        mean, var = total / count, total_of_squares / count - (total / count) ** 2  # biased, as BatchNorm's
        self.running_mean.lerp_(mean.detach(), self.momentum)
        self.running_var.lerp_(var.detach() * count / (count - 1), self.momentum)  # unbiased, as BatchNorm1d's
        self.num_batches_tracked += 1
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model()
    model.net[0].bias = None  # BatchNorm cancels it: its gradient is rounding noise, which Adam would amplify
    model.net.insert(1, (HandSyncBatchNorm1d if args.bn == "sync" else nn.BatchNorm1d)(model.net[0].out_features))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model = DDP(model)  # before each training forward it also copies rank 0's buffers (running statistics) to all
    for epoch in range(args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer)
        val_totals = evaluate(model.module, val_loader)  # .module: a forward through DDP may wait for ranks
        train_loss, val_loss = epoch_means(train_totals, val_totals)  # each rank evaluated with its own statistics
        statistics = torch.cat([model.module.net[1].running_mean, model.module.net[1].running_var])
        extremes = torch.stack([statistics, -statistics])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # every rank: each statistic's largest and -smallest
        if rank == 0:  # the spread: how far apart the ranks' running statistics are
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f} | running statistics "
                  f"of the ranks differ by up to {extremes.sum(0).max():.1e}", flush=True)
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model.module


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 sync_batchnorm.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > args.train_size:
        raise SystemExit(f"error: {world_size} ranks but {args.train_size} training samples: each needs one")
    if 1 in (args.batch_size, (args.train_size + world_size - 1) // world_size % args.batch_size):  # a last batch
        raise SystemExit("error: a batch of 1 sample has no BatchNorm statistics: change --batch_size or --train_size")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises: gloo's threads end with the group
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
