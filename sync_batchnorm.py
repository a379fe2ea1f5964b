"""BatchNorm under DDP: each rank's own statistics, the global batch's, and the running statistics.

Plain BatchNorm normalises with the mean and variance of the batch it sees: under DDP, of each rank's
own b samples, not of the global batch of world_size × b as in one process. Synchronised BatchNorm
uses the global batch's. By hand, on CPUs, this script all-reduces three numbers per feature (the
count, the sum, the sum of squares); on GPUs nn.SyncBatchNorm.convert_sync_batchnorm does it (its
kernels all-gather each rank's mean, inverse standard deviation and count instead: the same
statistics, and steadier in floating point than a sum of squares). torch 2.13's nn.SyncBatchNorm
refuses CPU tensors in training (ValueError), hence the hand-written one. Each rank first prints
how far BatchNorm on its first batch is from BatchNorm over the global batch in one process.

    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py
    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py --bn local
    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py --bn local --no_buffer_sync
    torchrun --standalone --nproc-per-node 2 sync_batchnorm.py --backend nccl  # GPUs: nn.SyncBatchNorm

The running statistics that eval mode normalises with are buffers, and at the start of every forward
DDP copies rank 0's over every rank's (forward_sync_buffers=True, the default; its old name
broadcast_buffers is deprecated in 2.13). Per rank, they are then an average over rank 0's batches
plus each rank's own last batch; with --no_buffer_sync each rank's own. Synchronised, all the same.
Explained in docs/past_the_basics.md.
"""
import argparse
import copy
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import common
from data import LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    parser.add_argument("--bn", choices=["sync", "local"], default="sync",
                        help="sync: statistics of the global batch; local: of each rank's own batch")
    parser.add_argument("--no_buffer_sync", action="store_true",
                        help="DDP(forward_sync_buffers=False): each rank keeps running statistics of its own")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                        help="gloo: CPUs, synchronised by hand; nccl: one GPU per process, nn.SyncBatchNorm")
    common.reject_old_launcher_flag(parser)
    args = parser.parse_args()
    if args.model == "linear":
        parser.error("--model linear has no hidden layer for BatchNorm to normalise: use mlp or wide")
    return args


class AllReduceSum(torch.autograd.Function):
    """dist.all_reduce (sum) that gradients flow through: every rank's loss depends on every rank's
    input, so backward all-reduces the gradients too (as nn.SyncBatchNorm's backward does)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)  # every rank calls it, in the same order: the forward is the same code
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)  # every rank runs this backward, at the same point of its own
        return grad


def global_batch_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, count) per feature over every rank's x: (batch, features)."""
    count = torch.full_like(x[0], len(x))
    count, total, total_of_squares = AllReduceSum.apply(torch.stack([count, x.sum(0), (x * x).sum(0)]))
    mean = total / count
    return mean, total_of_squares / count - mean * mean, count


class HandSyncBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d that normalises with the global batch's statistics in training, as
    nn.SyncBatchNorm does on GPUs. In eval mode it uses its running statistics, as BatchNorm1d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        mean, var, count = global_batch_stats(x)
        with torch.no_grad():  # as BatchNorm1d: the running variance is unbiased, over the global count
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * count / (count - 1), self.momentum)
            self.num_batches_tracked += 1
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


def build(model: str, norm: type[nn.Module]) -> nn.Module:
    """model.py's model with a BatchNorm after its first layer: Linear, BatchNorm1d, activation, ..."""
    net = build_model(model)
    # As Linear(..., bias=False): BatchNorm cancels a bias, whose rounding-noise gradient Adam would amplify.
    net.net[0].bias = None
    net.net.insert(1, norm(net.net[0].out_features))
    return net


@torch.no_grad()
def check_first_batch(model: DDP, loader: DataLoader, rank: int, world_size: int, device: torch.device, bn: str):
    """Print how far BatchNorm outputs on this rank's first batch are from one process's over the global batch."""
    x, _ = next(iter(loader))
    h = model.module.net[0](x.to(device))  # the BatchNorm's input: (batch, features)
    layer = model.module.net[1]
    everyone = [torch.empty_like(h) for _ in range(world_size)]
    dist.all_gather(everyone, h)  # the global batch; DistributedSampler gives every rank as many samples
    one_process = F.batch_norm(torch.cat(everyone), None, None, layer.weight, layer.bias, training=True,
                               eps=layer.eps)[rank * len(h):(rank + 1) * len(h)]
    mean, var, _ = global_batch_stats(h)
    outputs = {"synchronised by hand": (h - mean) * torch.rsqrt(var + layer.eps) * layer.weight + layer.bias,
               "per rank": F.batch_norm(h, None, None, layer.weight, layer.bias, training=True, eps=layer.eps),
               # a copy, so that this check moves no running statistics
               f"the model's {type(layer).__name__}": copy.deepcopy(layer)(h)}
    gaps = torch.stack([(out - one_process).abs().max() for out in outputs.values()])
    common.print_line(f"[rank {rank}/{world_size}] first batch, largest difference from BatchNorm over the global "
                      f"batch of {world_size * len(h)} in one process: "
                      + " | ".join(f"{name} {gap:.1e}" for name, gap in zip(outputs, gaps.tolist(), strict=True)))
    dist.all_reduce(gaps, op=dist.ReduceOp.MAX)  # every rank then takes the same decision below
    if gaps[0] > 1e-5 or (bn == "sync" and gaps[2] > 1e-5):  # float rounding at most
        common.die(f"synchronised statistics differ from one process's by {max(gaps[0], gaps[2]):.1e}", code=1)


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    norm = HandSyncBatchNorm1d if args.bn == "sync" and device.type == "cpu" else nn.BatchNorm1d
    model = build(args.model, norm).to(device)
    if args.bn == "sync" and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # before DDP: DDP must wrap the final module
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                forward_sync_buffers=not args.no_buffer_sync)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    check_first_batch(model, train_loader, rank, world_size, device, args.bn)

    for epoch in range(args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        samples = 0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)  # DDP broadcasts rank 0's buffers first, unless --no_buffer_sync
            loss.backward()  # all-reduces the gradients (and, synchronised, the statistics' gradients)
            optimizer.step()
            loss_sum += loss.detach() * len(y)
            samples += len(y)
        stats = torch.cat([model.module.net[1].running_mean, model.module.net[1].running_var])
        extremes = torch.stack([stats, -stats])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # on every rank: each value's largest and -smallest
        spread = extremes.sum(0).max().item()  # how far apart the ranks' running statistics are
        # Each rank evaluates with its own running statistics, which per-rank BatchNorm leaves apart.
        train_loss, val_loss = epoch_means((loss_sum, samples), evaluate(model.module, val_loader, device), device)
        if rank == 0:
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f} | running statistics "
                  f"of the ranks differ by up to {spread:.1e}", flush=True)
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
              flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("sync_batchnorm.py", args)  # as singlenode_cpu.py
    # DistributedSampler gives every rank ceil(train_size / world_size) samples; a batch of one of
    # them has no per-rank statistics (BatchNorm raises in training), and this script computes them.
    last = math.ceil(args.train_size / world_size) % args.batch_size
    if 1 in (args.batch_size, last):
        common.die(f"--batch_size {args.batch_size} and --train_size {args.train_size} on {world_size} rank"
                   f"{'s' if world_size > 1 else ''} leave a batch of 1 sample, whose per-rank BatchNorm statistics "
                   "do not exist: change either (a real job would drop the short last batch: "
                   "DataLoader(drop_last=True))")
    device = torch.device("cpu")
    if args.backend == "nccl":
        common.check_gpus(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc-per-node", "sync_batchnorm.py --backend gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group: otherwise every process allocates on GPU 0
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(args.backend, store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
