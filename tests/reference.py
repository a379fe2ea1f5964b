"""Single-process training written without torch.distributed, to hold the DDP runs against.

It rebuilds each epoch's global sample order from what DistributedSampler documents (a
permutation seeded with seed + epoch, padded by repeating its head to a multiple of the world
size, rank r taking every world_size-th index from r) and takes one step per global batch: the
concatenation of every rank's batch at that step. DDP with per-rank batch b must match it. Unlike
single_process.py, it follows the sampler's padding and takes --model (zero_optimizer.py, fsdp2.py).
"""
import argparse
import math

import torch
import torch.nn.functional as F

from data import make_datasets
from model import build_model


def sampler_order(n: int, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Each rank's indices for one epoch, derived without DistributedSampler."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    total = math.ceil(n / world_size) * world_size
    order = (order * math.ceil(total / n))[:total]  # pad with the head, repeating if needed
    return [order[rank:total:world_size] for rank in range(world_size)]


def train_reference(args: argparse.Namespace, world_size: int) -> tuple[dict, list[tuple[float, float]]]:
    """Return the final state_dict and the (train_loss, val_loss) of every epoch."""
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    x_train, y_train = train_set.tensors
    x_val, y_val = val_set.tensors
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for epoch in range(args.max_epochs):
        shards = sampler_order(len(x_train), world_size, args.seed, epoch)
        loss_sum, samples = 0.0, 0
        for start in range(0, len(shards[0]), args.batch_size):
            batch = [i for shard in shards for i in shard[start:start + args.batch_size]]
            optimizer.zero_grad()
            loss = F.mse_loss(model(x_train[batch]), y_train[batch])
            loss.backward()
            if getattr(args, "clip_grad_norm", None):  # the gradient of the global batch, as DDP's average
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()
            loss_sum += loss.item() * len(batch)
            samples += len(batch)
        with torch.no_grad():
            val_loss = F.mse_loss(model(x_val), y_val).item()
        losses.append((loss_sum / samples, val_loss))
    return model.state_dict(), losses
