"""The end of gpt/train.py's step, on what each rank holds: the gradient's global norm, its clipping (--grad_clip),
and AdamW's update. Under FSDP and tp the parameters, their gradients and Adam's moments are DTensors, and each
operation on a DTensor costs the host a decision of how its result is sharded; these work on the local tensors
that the DTensors wrap, where that decision is known: the same numbers, at a plain tensor's cost."""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()  # to_local() with grad enabled is an autograd Function's call, per gradient
def grad_norm(grads: list[torch.Tensor], sharded: bool, device: torch.device,
              across: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of the whole gradient. DDP: every rank holds all of it, the same. Sharded (DTensors, on one
    mesh or, under --ep, the experts' on another: FSDP's shards, tp's, ep's; on each dimension sharded or
    replicated once FSDP has reduced them): for each mesh, each
    parameter's squared norm on its local tensor, then over each dimension that shards some parameter one
    all-reduce of the vector (a parameter that dimension replicates counted by its first rank alone); `across`,
    a pipeline's group, adds the stages' sums. The collectives DTensor's own clip_grad_norm_ makes, without its
    host cost: it decides how each norm is sharded at every step (on a CPU, one parameter at a time)."""
    if not sharded:
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=device)
    total = torch.zeros((), device=device)
    meshes = {}  # --ep: the experts' DTensors are on a mesh of their own
    for g in grads:  # none when FSDP was told not to reduce: on every rank alike
        meshes.setdefault(g.device_mesh, []).append(g)
    for mesh, some in meshes.items():
        squares = torch.stack(torch._foreach_norm([g.to_local() for g in some])).square()
        for dim in range(mesh.ndim):
            shard = [not g.placements[dim].is_replicate() for g in some]  # Shard, or FSDP's _StridedShard under tp
            if not any(shard) or mesh.size(dim) == 1:
                continue
            if not all(shard) and mesh.get_local_rank(dim) != 0:
                squares = squares * torch.tensor(shard, device=device)
            dist.all_reduce(squares, group=mesh.get_group(dim))
        total = total + squares.sum()
    if across is not None:
        dist.all_reduce(total, group=across)
    return total.sqrt()


@torch.no_grad()
def clip(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Every gradient times min(1, max_norm / norm), as clip_grads_with_norm_ does, on the local tensors."""
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], scale)


class AdamW(torch.optim.AdamW):
    """torch's AdamW, fused (one operation per group updates every parameter, on the CPU and the GPU), stepped on
    the local tensors of DTensor parameters: an update is elementwise, and a parameter, its gradient and its
    moments are sharded alike (FSDP gives a gradient its parameter's placements), so each rank updates its own
    shards, as DTensor would after deciding so at every call (on 2 CPU cores, the tiny model's update took 2.3 ms of
    a 25 ms step under fsdp, 0.8 ms on plain tensors). The state stays DTensors: checkpoints see what they did."""

    def _init_group(self, group, params, grads, *state):  # torch.optim.Adam's: the lists step() updates
        has_complex = super()._init_group(group, params, grads, *state)
        for param, grad in zip(params, grads, strict=True):
            if isinstance(param, DTensor) and param.placements != grad.placements:
                raise ValueError(f"a gradient sharded as {grad.placements}, its parameter as {param.placements}")
        for tensors in (params, grads, *state):  # step() runs under no_grad: to_local() is the local tensor itself
            tensors[:] = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return has_complex


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices only, GPT-2's betas (0.9, 0.95)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},  # matrices
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # biases, norms
    return AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
