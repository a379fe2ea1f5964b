"""FSDP2: each rank holds a shard of every layer's parameters, gradients and Adam state (ZeRO stage 3).

`diff singlenode_cpu.py fsdp2.py` is the lesson (docs/sharding.md): fully_shard, in DDP's place, shards along
dim 0; the checkpoint is the whole state, gathered on rank 0. A job with sharded checkpoints: gpt/.

    torchrun --standalone --nproc-per-node 3 fsdp2.py --checkpoint fsdp.pt  # again, on any number of ranks: resumes
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
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
    # A strided shard, no repeats, in one batch: each forward all-gathers every layer, so every rank runs one.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=len(val_set))
    return train_loader, val_loader


def bytes_held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Bytes of this rank's shards of the parameters, gradients and Adam's state (and its step counts)."""
    params, state = list(model.parameters()), [t for entry in optimizer.state.values() for t in entry.values()]
    sizes = [sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in ts if t is not None)
             for ts in (params, [p.grad for p in params], state)]
    return "parameters {:,} | gradients {:,} | optimizer state {:,}".format(*sizes)


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # gathers each layer again, then reduce-scatters its gradient: each rank gets its piece
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
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` it would hang."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same whole weights on every rank: each keeps its own piece of them
    model = build_model(args.model)
    for layer in [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model]:
        fully_shard(layer)  # one group per layer: all-gathered just before its forward, freed after it
    fully_shard(model)  # the root too, else each layer is a root, which keeps its gathered weights until backward
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)  # after fully_shard: of this rank's pieces
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # Every rank loads the whole state; map_location: not onto the saver's device. weights_only: no code runs.
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        set_state_dict(model, optimizer, model_state_dict=checkpoint["model"], optim_state_dict=checkpoint["optimizer"],
                       options=StateDictOptions(full_state_dict=True))  # whole tensors: each rank keeps its pieces
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    step_time = 0.0
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        started = time.perf_counter()
        train_totals = train_one_epoch(model, train_loader, optimizer)
        step_time += (time.perf_counter() - started) / len(train_loader)
        if epoch == start_epoch:  # after a step: Adam's state exists
            print(f"[rank {rank}/{world_size}] bytes held: {bytes_held(model, optimizer)}\n", end="", flush=True)
        val_totals = evaluate(model, val_loader)  # the sharded model: a plain one does not exist
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if args.checkpoint:  # a collective: every rank gathers every layer; cpu_offload: rank 0 alone keeps them
            whole = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # one writer; no barrier after it, as no rank reads the file during the run
            if args.checkpoint:  # whole tensors under the plain model's names: a plain model loads "model"
                state = {"model": whole[0], "optimizer": whole[1], "epoch": epoch + 1}
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"step time: {1e3 * step_time / (args.max_epochs - start_epoch):.2f} ms\ndone | val_loss:{val_loss:.6f} "
              f"floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)", flush=True)
    return model


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 fsdp2.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > min(args.train_size, args.val_size):  # each rank needs a training and a validation sample
        raise SystemExit(f"error: {world_size} ranks: --train_size and --val_size must be at least that")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises (FSDP2's gloo threads outlive it: see os._exit below)
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown, which gloo's threads, kept alive by FSDP2's cached mesh, can abort
