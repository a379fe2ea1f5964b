"""The layouts of gpt/train.py: given the model, the mesh and the flags, the model laid out over the ranks.

train.py is the loop; every decision about which rank holds what, and what a backward communicates, is
here (torchtitan's parallelize_llama is the model): make_mesh() builds the DeviceMesh of --parallel,
parallelize_gpt() wraps the model built on `meta` for it, with the same starting weights in every layout,
gradient_sync() says what a backward communicates under gradient accumulation.
"""
import argparse
import contextlib
import os

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_mesh(args: argparse.Namespace, world_size: int, device: torch.device) -> DeviceMesh | None:
    """The ranks as a mesh: fsdp, one dimension ("shard"); hsdp, ("replicate", "shard"), the shard groups
    of --shard_size neighbouring ranks (a node by default); ddp needs none."""
    if args.parallel == "ddp":
        return None
    if args.parallel == "fsdp":
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=("shard",))
    shard = args.shard_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % shard:
        raise ValueError(f"--shard_size {shard} does not divide the {world_size} ranks")
    return init_device_mesh(device.type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def parallelize_gpt(model: GPT, mesh: DeviceMesh | None, args: argparse.Namespace,
                    device: torch.device) -> torch.nn.Module:
    """The model, built on `meta` (no memory), laid out on `mesh` for --parallel and given its starting
    weights: GPT.init_weights(--seed)'s in every layout, each rank drawing the whole values and keeping
    its shard."""
    if args.compile:
        compile_model(model)
    if mesh is None:
        model.to_empty(device=device)
        # From meta, to_empty gives each module a new Parameter (torch/nn/modules/module.py, Module._apply): the
        # tied head would be a matrix of its own. FSDP's DTensors are swapped in place, and stay tied.
        model.lm_head.weight = model.wte.weight
        model.init_weights(args.seed)
        # DDP broadcasts rank 0's weights at construction; every rank drew the same ones anyway.
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.precision], reduce_dtype=torch.float32)  # grads in fp32
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)  # one all-gather per block, freed after use
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the rest: embeddings, final norm, tied head
    model.to_empty(device=device)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # each full value drawn as GPT.init_weights does
            full = model.init_value(name, param.shape, generator).to(device)
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())  # keep this rank's shard
    return model


def compile_model(model: GPT) -> None:
    """torch.compile each block, and the head with its loss (head_loss), before any wrapping: each
    block apart, so that FSDP's hooks stay between them (one all-gather per block); the head and the
    loss apart from the rest, as the root module's forward holds FSDP's hooks for the embeddings and
    the tied head."""
    for block in model.blocks:
        block.compile()
    model.head_loss = torch.compile(model.head_loss)


def gradient_sync(model: torch.nn.Module, last_micro_step: bool):
    """What this backward communicates. DDP: no all-reduce until the last micro-step of an
    accumulation (no_sync), so once per optimizer step. FSDP: a reduce-scatter at every micro-step,
    so that each rank keeps only its shard of the gradients (without it, every rank would hold
    whole gradients until the last micro-step: the memory FSDP is there to save). HSDP: the same,
    and the all-reduce across replica groups only at the last micro-step."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if last_micro_step else model.no_sync()
    model.set_requires_all_reduce(last_micro_step)  # only HSDP's mesh has a replicate dimension to reduce over
    return contextlib.nullcontext()


def settle_buckets(model: DDP, x: torch.Tensor, autocast) -> None:
    """One backward of zeros, so that every real step uses the same gradient buckets. DDP's first
    backward all-reduces one bucket in the order the model defines its parameters, then it
    rebuilds its buckets in the order the gradients became ready; with 3 or more ranks, where a
    number sits in a bucket decides the order in which the ranks' values are added, and so its
    rounding. After this pass a fresh run and a resumed one step alike, bit for bit."""
    with autocast:
        logits = model(x)
    (logits.float().sum() * 0).backward()  # all-reduces zeros; no optimizer step follows
    model.zero_grad(set_to_none=True)
