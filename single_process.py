"""Training in one process, with no torch.distributed: the starting point of every lesson.

Data, model, loop, evaluation and a checkpoint, in plain PyTorch. singlenode_cpu.py is this script
spread over processes with DDP: `diff single_process.py singlenode_cpu.py` shows only what that takes.
Explained in docs/first_training.md.

    python single_process.py
    python single_process.py --checkpoint ckpt.pt  # run it again: it resumes where it stopped

With --batch_size N × B it ends with the weights of singlenode_cpu.py at N ranks of batch B, when N
divides --train_size (tests/test_train.py): the shuffle below draws the permutation DistributedSampler splits.
"""
import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

from data import LOSS_FLOOR, make_datasets
from model import build_model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step")
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


def make_loaders(args: argparse.Namespace, shuffle: torch.Generator) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # A permutation of the samples each epoch, drawn by `shuffle`: seeded with seed + epoch, it is the
    # permutation that DistributedSampler draws in singlenode_cpu.py.
    sampler = RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    return train_loader, val_loader


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer):
    """Return (sum of loss × samples, samples) over the epoch."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(y)  # stays a tensor: no sync per step
    return loss_sum, len(loader.sampler)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader):
    """Return (sum of squared errors, samples) over the validation set."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        loss_sum += F.mse_loss(model(x), y, reduction="sum")
    return loss_sum, len(loader.dataset)


def epoch_means(train_totals: tuple, val_totals: tuple) -> tuple[float, float]:
    """Means over every sample."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace) -> torch.nn.Module:
    shuffle = torch.Generator()
    train_loader, val_loader = make_loaders(args, shuffle)
    print(f"{len(train_loader)} steps per epoch", flush=True)
    torch.manual_seed(args.seed)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        # map_location: onto the CPU whatever device saved it. weights_only: loads tensors, runs no code.
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    for epoch in range(start_epoch, args.max_epochs):
        shuffle.manual_seed(args.seed + epoch)  # the shuffle of this epoch, the same after a restart
        train_totals = train_one_epoch(model, train_loader, optimizer)
        val_totals = evaluate(model, val_loader)
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if args.checkpoint:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}
            torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
            os.replace(args.checkpoint + ".tmp", args.checkpoint)
        print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model


def main() -> None:
    train(parse_args())


if __name__ == "__main__":
    main()
