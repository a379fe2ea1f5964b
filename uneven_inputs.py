"""Uneven inputs: ranks that hold different numbers of batches, and Join, which lets them finish.

Each rank reads a file of its own here: a contiguous chunk of the training set, r + 1 parts of
world_size × (world_size + 1) / 2 for rank r, so the ranks hold different numbers of samples (and of
batches, unless a batch is as large as a file), and nothing pads them to one length as
DistributedSampler does. Every backward all-reduces the
gradients with every rank, so once one rank has run out, the others wait for it in vain.
`with Join([model]):` stands in for the ranks that ran out: until the last rank is done, they
answer each of DDP's all-reduces with zeros, so a step's gradient is the sum of the gradients of
the ranks that still had a batch, divided by the world size (--divide_by_active: by the number of
those ranks). On leaving the block every rank takes the weights of the last rank to finish; this
script copies that rank's optimizer state as well, which Join does not.

    torchrun --standalone --nproc-per-node 2 uneven_inputs.py
    torchrun --standalone --nproc-per-node 2 uneven_inputs.py --no_join --timeout 3

Without Join (--no_join) the ranks with batches left wait in their gradient all-reduce until
--timeout, and the run stops with one line that says so. The other way out is the same number of
batches on every rank: drop the extra ones, or pad as DistributedSampler does. The validation and
the exact epoch means are singlenode_cpu.py's; tests/test_uneven_inputs.py holds the weights
against one process, without torch.distributed, that computes what Join does.
Explained in docs/past_the_basics.md.
"""
import argparse
import contextlib
import math
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset

import common
from data import LOSS_FLOOR, make_datasets
from model import build_model
from singlenode_cpu import epoch_means, evaluate


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    parser.add_argument("--no_join", action="store_true",
                        help="leave Join out, to see the job wait in an all-reduce until --timeout and stop")
    parser.add_argument("--divide_by_active", action="store_true",
                        help="divide a step's summed gradient by the ranks that still had a batch, not by the world "
                             "size (Join's divide_by_initial_world_size=False)")
    common.reject_old_launcher_flag(parser)
    return parser.parse_args()


def file_of(rank: int, world_size: int, train_size: int) -> range:
    """The indices of this rank's file: r + 1 of world_size × (world_size + 1) / 2 parts."""
    parts = world_size * (world_size + 1) // 2
    return range(train_size * (rank * (rank + 1) // 2) // parts, train_size * ((rank + 1) * (rank + 2) // 2) // parts)


def epoch_loader(train_set: TensorDataset, indices: range, batch_size: int, seed: int, epoch: int) -> DataLoader:
    """This rank's file in batches, in a new order every epoch: seeded with seed + epoch, so reproducible."""
    order = indices.start + torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed + epoch))
    return DataLoader(Subset(train_set, order.tolist()), batch_size=batch_size)


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device):
    """Train on this rank's file; return (sum of loss × samples, samples) for this rank."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # all-reduces with every rank: those that ran out answer through Join
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples


def copy_optimizer_state(optimizer: torch.optim.Optimizer, src: int) -> None:
    """Give every rank the optimizer state of rank src. Join copies the last rank's weights to every
    rank, but not its optimizer state: a rank that ran out skipped optimizer.step() while Join stood
    in for it, so its Adam moments and step count lag, and next epoch its replica would drift."""
    state = [optimizer.state_dict()]
    dist.broadcast_object_list(state, src=src)
    optimizer.load_state_dict(state[0])


def explain_the_wait(counts: list[int], timeout: float) -> str:
    """The --no_join failure in one line: who ran out, who waited for whom, and what to do."""
    def ranks(chosen: list[int]) -> str:
        return f"rank{'s' if len(chosen) > 1 else ''} {', '.join(map(str, chosen))}"
    ran_out = [r for r, n in enumerate(counts) if n == min(counts)]
    waited = [r for r, n in enumerate(counts) if n > min(counts)]
    return (f"the ranks hold {', '.join(map(str, counts))} batches: after step {min(counts)} {ranks(ran_out)} had "
            f"none left, and the gradient all-reduce of {ranks(waited)} waited for "
            f"{'them' if len(ran_out) > 1 else 'it'} until --timeout ({timeout:g} s); wrap the training loop in Join, "
            "or give every rank the same number of batches")


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Validation as in singlenode_cpu.py: a strided shard, so each sample is counted exactly once.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)
    mine = file_of(rank, world_size, args.train_size)
    # A rank knows only its own file, so every rank tells every other how many batches it holds: to
    # say what went wrong, and whose optimizer state to copy (the last rank to run out; of several,
    # the highest, the rank whose weights Join copies).
    counts = [None] * world_size
    dist.all_gather_object(counts, math.ceil(len(mine) / args.batch_size))
    last = max(r for r, n in enumerate(counts) if n == max(counts))
    common.print_line(f"[rank {rank}/{world_size}] samples {mine.start} to {mine.stop - 1}: {counts[rank]} batches")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = DDP(build_model(args.model).to(device))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0 and not args.no_join:
        print(f"{max(counts)} steps per epoch: Join stands in for each rank in the steps after its last batch",
              flush=True)

    for epoch in range(args.max_epochs):
        loader = epoch_loader(train_set, mine, args.batch_size, args.seed, epoch)
        # Join answers DDP's collectives for the ranks that ran out, until the last rank leaves the
        # block. One block per epoch: Join knows nothing of the collectives below, so they stay outside.
        join = contextlib.nullcontext() if args.no_join else Join(
            [model], divide_by_initial_world_size=not args.divide_by_active)
        try:
            with join:
                loss_sum, samples = train_one_epoch(model, loader, optimizer, device)
            # Every rank, every epoch. Without Join a rank that ran out waits here, in a broadcast, while
            # the others wait in their gradient all-reduce: gloo never pairs collectives of two kinds, so
            # all of them give up at --timeout. (An all-reduce here would be paired with theirs: gloo
            # aborts the process when the sizes differ, and adds unrelated numbers when they match.)
            copy_optimizer_state(optimizer, last)
        except RuntimeError:
            if not args.no_join or len(set(counts)) == 1:  # not the wait that this flag is there to show
                raise
            if rank == 0:
                common.die(explain_the_wait(counts, args.timeout), code=1)
            time.sleep(1)  # torchrun stops every worker once one fails: leave rank 0 the time to say why
            sys.exit(1)
        # Evaluate the plain module: a forward through the wrapper may wait for the other ranks.
        train_loss, val_loss = epoch_means((loss_sum, samples), evaluate(model.module, val_loader, device), device)
        if rank == 0:
            common.print_line(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}")
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
              flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("uneven_inputs.py", args)  # as singlenode_cpu.py
    if not file_of(0, world_size, args.train_size):
        common.die(f"--train_size {args.train_size} leaves rank 0 no sample: with {world_size} ranks it needs at least "
                   f"{world_size * (world_size + 1) // 2}")
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
