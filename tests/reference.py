"""DistributedSampler's order rebuilt from what it documents, without it: a permutation seeded with
seed + epoch, padded by repeating its head to a multiple of the world size, rank r taking every
world_size-th index from r. (The single-process reference itself is single_process.py.)"""
import math

import torch


def sampler_order(n: int, world_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Each rank's indices for one epoch, derived without DistributedSampler."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(n, generator=generator).tolist()
    total = math.ceil(n / world_size) * world_size
    order = (order * math.ceil(total / n))[:total]  # pad with the head, repeating if needed
    return [order[rank:total:world_size] for rank in range(world_size)]
