"""The same training under torchrun and under the older torch.distributed.launch.

    torchrun --standalone --nproc-per-node 4 start_with_torchrun.py --max_epochs 2 --batch_size 32
    python -m torch.distributed.launch --use-env --nproc-per-node 4 start_with_torchrun.py --max_epochs 2
    python -m torch.distributed.launch --nproc-per-node 4 start_with_torchrun.py --max_epochs 2
    python start_with_torchrun.py            # no launcher: trains as a single process

Every launcher sets RANK, LOCAL_RANK and WORLD_SIZE in each process's environment, and that is
where this script reads them. The old launcher without --use-env also appends --local-rank=N
to the arguments, so the parser accepts it (and --local_rank, its spelling before torch 2.0).
With CUDA, one process per GPU and nccl; without, CPU processes and gloo.
"""
import argparse
import gc
import os
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


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                        help="set by torch.distributed.launch without --use-env; LOCAL_RANK says the same")
    return parser.parse_args()


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Each rank draws a disjoint 1/world_size of a shuffled epoch. When the size is not divisible,
    # the sampler repeats a few samples so that every rank runs the same number of steps: a rank
    # with an extra step would wait forever in that step's all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # Validation needs no equal steps (no gradients to all-reduce), so take a strided shard with no
    # padding: each validation sample is counted exactly once.
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))
    val_loader = DataLoader(val_shard, batch_size=args.batch_size)
    return train_loader, val_loader


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device):
    """Train on this rank's shard; return (sum of loss × samples, samples) for this rank."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here, bucket by bucket
        optimizer.step()
        loss_sum += loss.detach() * len(y)  # stays on the device: no sync per step
        samples += len(y)
    return loss_sum, samples


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss_sum += F.mse_loss(model(x), y, reduction="sum")
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

    start_epoch = 0
    if args.checkpoint:
        # map_location: without it every rank loads the tensors onto the device they were saved from.
        checkpoint = common.open_checkpoint(args.checkpoint, rank, device, common.run_config(args, world_size), model)
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
            if rank == 0:
                print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    # The shuffle is the run's only randomness after the weights are drawn, and DistributedSampler
    # derives it from seed + epoch, so no random-number state needs saving. (Dropout would change that.)

    # On a GPU this would be DDP(model, device_ids=[local_rank]); on CPUs device_ids stays None.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)

    for epoch in range(start_epoch, args.max_epochs):
        # Reseeds the shuffle with the epoch; without it every epoch sees the same order.
        train_loader.sampler.set_epoch(epoch)
        train_totals = train_one_epoch(model, train_loader, optimizer, device)
        # Evaluate the plain module: ranks may hold different numbers of validation batches, and a
        # forward through the DDP wrapper may wait for the other ranks.
        val_totals = evaluate(model.module, val_loader, device)
        train_loss, val_loss = epoch_means(train_totals, val_totals, device)
        if rank == 0:
            if args.checkpoint:
                # Global rank 0 alone writes: one writer, not one per node. .module unwraps DDP so
                # the keys carry no "module." prefix and load into a plain model.
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch + 1, "config": common.run_config(args, world_size)}
                common.save_checkpoint(state, args.checkpoint)
            # Printed once the epoch is saved: after a crash and restart, no epoch shows up twice.
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)
        # No barrier after the save: no other rank reads the file during the run.

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
    if "RANK" in os.environ:
        # Started by a launcher, which also set MASTER_ADDR and MASTER_PORT for env:// below.
        rank = int(os.environ["RANK"])
        local_rank = int(os.environ["LOCAL_RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        store = None  # env://: the launcher's MASTER_ADDR and MASTER_PORT
    else:
        print("no launcher: training as a single process. For N processes: "
              "torchrun --standalone --nproc-per-node N start_with_torchrun.py", flush=True)
        rank, local_rank, world_size = 0, 0, 1
        store = dist.HashStore()  # a world of one needs no network: an in-memory store will do
    common.check_world_size(world_size, args)

    if torch.cuda.is_available():
        common.check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "--nproc-per-node", "singlenode_cpu.py")
        # local_rank, not rank: on the second node rank 4 is that node's GPU 0.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group, so nccl binds this GPU
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        dist.destroy_process_group()
        # The DDP wrapper sits in a reference cycle that holds the process group. Collected now,
        # not at interpreter shutdown, where gloo's threads can abort the process (SIGABRT).
        gc.collect()


if __name__ == "__main__":
    main()
