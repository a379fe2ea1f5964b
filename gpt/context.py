"""Context parallel, train.py --cp N: each sequence split over N ranks, which read the same batch and join FSDP's
shard group (the weights are sharded over them, not replicated); only attention sees the other ranks' tokens.

The split is head-tail balanced: the sequence cut into 2N chunks, rank i holds chunks i and 2N - 1 - i, so that
under the causal mask every rank attends over as many (query, key) pairs as the others (rank 0's first chunk has
the fewest keys, its last the most). Every token keeps its true position, for the rotary tables and for GPT-2's
learned positions. Each rank's loss is its tokens' mean; FSDP averages the gradients over its shard group, cp ranks
included, so the step is the whole sequences' mean, as one process takes it.

--cp_method allgather (Llama 3's, torchtitan's): k and v gathered from the cp ranks after the rotary embedding,
each rank's queries attending over all of them under the mask of the true positions; in the backward each rank's
k and v get the gradients of every rank's queries, summed (a reduce-scatter).
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

METHODS = ("allgather",)
# torch 2.13 names them all_gather_single and reduce_scatter_single, and warns that the older names will go
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def positions(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The places in its sequence of the tokens cp rank `rank` of `cp` holds: chunks rank and 2·cp - 1 - rank
    of the 2·cp chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in (rank, 2 * cp - 1 - rank)])


def split_sequences(group: dist.ProcessGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook of the model: its inputs (idx, targets), whole sequences, cut to this rank's tokens, and
    their positions passed on."""
    where = positions(args[0].shape[1], group.size(), group.rank(), args[0].device)
    return tuple(t[:, where] for t in args), {**kwargs, "positions": where}


class Gather(torch.autograd.Function):
    """x from every rank of `group`, stacked in rank order on a new first dimension; the gradient of each rank's
    x summed over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty(group.size() * x.shape[0], *x.shape[1:])  # the ranks' x, one after the other
        ALL_GATHER(out, x.contiguous(), group=group)
        return out.view(group.size(), *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        REDUCE_SCATTER(out, grad.flatten(0, 1), group=ctx.group)
        return out, None


def allgather_attention(group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        dropout_p: float) -> torch.Tensor:
    """model.causal_attention under --cp_method allgather: q, k and v (batch, heads, this rank's tokens, head_dim),
    the keys and values of the whole sequence gathered (in the ranks' order, not the sequence's: the mask says which
    a query sees), each query attending over those at its place or before."""
    cp, rank = group.size(), group.rank()
    seq_len = q.shape[2] * cp
    mine = positions(seq_len, cp, rank, q.device)
    theirs = torch.cat([positions(seq_len, cp, r, q.device) for r in range(cp)])
    k, v = (Gather.apply(t, group).permute(1, 2, 0, 3, 4).flatten(2, 3) for t in (k, v))  # (batch, heads, seq, dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=theirs[None, :] <= mine[:, None], dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


def context_parallel(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """--cp: the model's inputs cut to this rank's tokens, and every block's attention the method's."""
    model.register_forward_pre_hook(functools.partial(split_sequences, group), with_kwargs=True)
    for block in model.blocks:
        block.attn.attend = functools.partial(allgather_attention, group)
