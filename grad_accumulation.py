"""Gradient accumulation under DDP: k micro-batches per optimizer step, and one all-reduce, not k.

A batch too large for memory is split into k micro-batches: k forward and backward passes add
their gradients up in .grad, then one optimizer step. Under DDP every backward all-reduces the
gradients, so k micro-batches would cost k all-reduces where one is enough. `model.no_sync()`
turns DDP's all-reduce off for the backward passes inside it: gradients pile up locally, and the
last micro-batch's backward, outside no_sync(), all-reduces the sum. A hook on DDP's
communication counts the all-reduces, so the output shows the difference.

    torchrun --standalone --nproc-per-node 2 grad_accumulation.py --accum_steps 4
    torchrun --standalone --nproc-per-node 2 grad_accumulation.py --accum_steps 4 --always_sync

The data, the validation and the exact epoch means are singlenode_cpu.py's. Training with
--batch_size b and --accum_steps k takes the steps that singlenode_cpu.py takes with
--batch_size k×b, to float rounding (tests/test_grad_accumulation.py checks it).
Explained in docs/past_the_basics.md.
"""
import argparse
import contextlib
import math
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import common
from data import LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    parser.add_argument("--accum_steps", type=common.number_in(1, 10**6, int), default=4,
                        help="micro-batches of --batch_size per optimizer step (1 to 1e6)")
    parser.add_argument("--always_sync", action="store_true",
                        help="leave no_sync() out: all-reduce after every micro-batch, to see what that costs")
    common.reject_old_launcher_flag(parser)
    return parser.parse_args()


def count_all_reduces(counter: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: count the bucket, then all-reduce it as DDP would (the average)."""
    counter[0] += 1
    return allreduce_hook(None, bucket)


def micro_batches(loader: DataLoader, accum_steps: int):
    """The loader's batches in groups of accum_steps (the last group may be shorter)."""
    group = []
    for batch in loader:
        group.append(batch)
        if len(group) == accum_steps:
            yield group
            group = []
    if group:
        yield group


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                    accum_steps: int, always_sync: bool):
    """Train on this rank's shard; return (sum of loss × samples, samples, optimizer steps)."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = steps = 0
    for group in micro_batches(loader, accum_steps):
        group_samples = sum(len(y) for _, y in group)
        optimizer.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(group):
            x, y = x.to(device), y.to(device)
            # Inside no_sync() backward only adds into .grad; the last micro-batch's backward runs
            # outside it and all-reduces the accumulated sum. The forward belongs inside too: DDP
            # decides there whether the coming backward all-reduces. Every rank must agree on which
            # backward is the last (here: equal batch counts from DistributedSampler), or one rank
            # waits in an all-reduce that another never starts.
            last = i == len(group) - 1
            with contextlib.nullcontext() if last or always_sync else model.no_sync():
                loss = F.mse_loss(model(x), y)
                # Each micro-batch's mean loss weighed by its share of the group's samples: 1/k
                # when the k micro-batches are full, so the summed gradient is that of the mean
                # over the whole group, as one batch of k×b samples would give.
                (loss * len(y) / group_samples).backward()
            loss_sum += loss.detach() * len(y)
            samples += len(y)
        optimizer.step()
        steps += 1
    return loss_sum, samples, steps


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DDP(build_model(args.model).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    all_reduces = [0]
    model.register_comm_hook(all_reduces, count_all_reduces)
    if rank == 0:
        micro = f"{args.accum_steps} micro-batch{'es' if args.accum_steps > 1 else ''} of {args.batch_size}"
        print(f"{world_size} ranks × {micro} = {world_size * args.accum_steps * args.batch_size} samples per "
              "optimizer step", flush=True)

    for epoch in range(args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        all_reduces[0] = 0
        loss_sum, samples, steps = train_one_epoch(model, train_loader, optimizer, device, args.accum_steps,
                                                   args.always_sync)
        # Evaluate the plain module: a forward through the wrapper may wait for the other ranks.
        train_loss, val_loss = epoch_means((loss_sum, samples), evaluate(model.module, val_loader, device), device)
        if rank == 0:
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f} | "
                  f"{all_reduces[0]} all-reduces of gradient buckets in {steps} optimizer steps", flush=True)
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
              flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("grad_accumulation.py", args)  # as singlenode_cpu.py
    batches = math.ceil(math.ceil(args.train_size / world_size) / args.batch_size)  # a rank's, per epoch
    if args.accum_steps > batches:
        common.die(f"--accum_steps {args.accum_steps} is more than the {batches} micro-batches of --batch_size "
                   f"{args.batch_size} that a rank holds in an epoch: lower either")
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        train(args, rank, local_rank, world_size, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
