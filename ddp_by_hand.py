"""Data-parallel training with DDP written by hand: gradient buckets all-reduced while backward runs.

`diff singlenode_cpu.py ddp_by_hand.py` is the lesson (docs/by_hand.md): DistributedDataParallel gives way to a
class that broadcasts rank 0's weights and hooks each parameter: a ready gradient joins a bucket of --bucket_mb, a
full bucket is all-reduced at once, asynchronously, while backward goes on; finish_gradient_synchronization() waits.
--grad_accum k: k micro-batches, k - 1 in no_sync(). Tested on CPUs with gloo.

    torchrun --standalone --nproc-per-node 4 ddp_by_hand.py --checkpoint ckpt.pt
    torchrun --standalone --nproc-per-node 2 ddp_by_hand.py --model wide --lr 0.001 --bucket_mb 1 --grad_accum 2
"""
import argparse
import contextlib
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import LOSS_FLOOR, make_datasets
from model import MODELS, build_model


class DDP(nn.Module):
    """DistributedDataParallel by hand: .grad holds the ranks' mean once finish_gradient_synchronization() returns."""

    def __init__(self, module: nn.Module, bucket_mb: float = 25) -> None:
        super().__init__()
        self.module, self.bucket_bytes, self.sync = module, bucket_mb * 2**20, True
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=0)  # every replica starts from rank 0's weights
        self.params = [p for p in module.parameters() if p.requires_grad]  # a tied weight once, a frozen one not
        self.index = {p: i for i, p in enumerate(self.params)}
        self.plan(self.params[::-1])  # a first guess: backward reaches the last layers first
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.ready)

    def plan(self, order: list[nn.Parameter]) -> None:  # buckets of bucket_bytes or a little more, in `order`
        self.buckets, size = [[]], 0
        for p in order:
            if size >= self.bucket_bytes:  # full: the gradient that crossed the limit is in it, as in torch's
                self.buckets, size = [*self.buckets, []], 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.waiting, self.in_flight, self.ready_order = [len(bucket) for bucket in self.buckets], {}, {}

    def ready(self, p: nn.Parameter) -> None:
        """A parameter's gradient is complete for this backward: once its bucket's are, all-reduce it."""
        if not self.sync:
            return  # no_sync(): the gradients only add up in .grad
        if p in self.ready_order:  # its bucket may be on its way already: the new gradient would be lost
            raise RuntimeError("a second backward in one step: run all but the last under no_sync()")
        self.ready_order[p] = None
        self.waiting[self.bucket_of[p]] -= 1
        while len(self.in_flight) < len(self.buckets) and self.waiting[len(self.in_flight)] == 0:
            self.launch(len(self.in_flight))  # in order: every rank must start the same all-reduces in turn

    def launch(self, i: int) -> None:
        flat = torch.cat([p.new_zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) for p in self.buckets[i]])
        self.in_flight[i] = (dist.all_reduce(flat.div_(dist.get_world_size()), async_op=True), flat)  # /N first, as DDP

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket and leave the mean gradient in each .grad."""
        for i in range(len(self.buckets)):
            if i not in self.in_flight:
                self.launch(i)  # a parameter this step did not use: its bucket still goes, with zeros
            work, flat = self.in_flight[i]
            work.wait()
            for p, g in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]]), strict=True):
                p.grad = g.view_as(p)
        order = torch.tensor([self.index[p] for p in dict.fromkeys([*self.ready_order, *self.params[::-1]])])
        dist.broadcast(order, src=0)  # the order rank 0 saw: every rank must cut the same buckets
        self.plan([self.params[i] for i in order])

    @contextlib.contextmanager
    def no_sync(self):  # accumulation: backward passes inside add up; the next one outside all-reduces the sum
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def forward(self, *args, **kwargs):
        if self.in_flight:  # torch's DDP waits by itself; this one needs the call, or replicas drift apart
            raise RuntimeError("call finish_gradient_synchronization() after backward, before the step")
        return self.module(*args, **kwargs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffle")
    parser.add_argument("--train_size", type=int, default=4096, help="training samples")
    parser.add_argument("--val_size", type=int, default=1024, help="validation samples")
    parser.add_argument("--checkpoint", default=None, help="saved after every epoch; resumed from if it exists")
    parser.add_argument("--bucket_mb", type=float, default=25, help="megabytes of gradients per all-reduce")
    parser.add_argument("--grad_accum", type=int, default=1, help="micro-batches per batch (at most its samples)")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS), help="model.py's; wide: 2.1M weights")
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size", "bucket_mb", "grad_accum"):
        if not 0 < getattr(args, name) < 1e7:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e7, got {getattr(args, name)}")
    return args


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)
    return train_loader, val_loader


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, grad_accum: int):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        k = min(grad_accum, len(y))  # a short last batch: no empty micro-batch
        for i, (x_micro, y_micro) in enumerate(zip(x.tensor_split(k), y.tensor_split(k), strict=True)):
            with contextlib.nullcontext() if i == k - 1 else model.no_sync():  # the last backward all-reduces
                loss = F.mse_loss(model(x_micro), y_micro)
                (loss * len(y_micro) / len(y)).backward()  # hooks all-reduce each bucket as it fills
            loss_sum += loss.detach() * len(y_micro)  # stays a tensor: no sync per step
        model.finish_gradient_synchronization()  # every bucket's mean gradient in .grad, before the step
        optimizer.step()
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


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(args.model)
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
    model = DDP(model, args.bucket_mb)  # broadcasts rank 0's weights; each backward averages the gradients
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer, args.grad_accum)
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
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 4 ddp_by_hand.py")
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
