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
--cp_method ulysses (DeepSpeed-Ulysses): an all-to-all each for q, k and v trades the sequence split for a head
split (each rank all the tokens of n_head / N heads), attention runs whole on those heads, and one all-to-all
trades back; n_head must divide by N, and k's and v's heads are repeated up to n_head where n_kv_head does not.
--cp_method ring (ring attention): k and v passed from rank to rank, N - 1 times, while each rank attends to what
it holds; the N partial results merged by their log-sum-exp. autograd runs the ring backward (the gradients of k
and v travel the other way), and it keeps each step's scores for it.
"""
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

METHODS = ("allgather", "ulysses", "ring")
# torch 2.13 names them all_gather_single and reduce_scatter_single, and warns that the older names will go
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def positions(seq_len: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """The places in its sequence of the tokens cp rank `rank` of `cp` holds: chunks rank and 2·cp - 1 - rank
    of the 2·cp chunks."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in (rank, 2 * cp - 1 - rank)])


def split_sequences(group: dist.ProcessGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook of the model: its inputs (idx, and targets, by place or by name), whole sequences, cut to
    this rank's tokens, and their positions passed on."""
    where = positions(args[0].shape[1], group.size(), group.rank(), args[0].device)
    if kwargs.get("targets") is not None:
        kwargs = {**kwargs, "targets": kwargs["targets"][:, where]}
    return tuple(None if t is None else t[:, where] for t in args), {**kwargs, "positions": where}


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


class AllToAll(torch.autograd.Function):
    """x's first dimension in group.size() equal parts, part r sent to rank r; the parts received, in rank order. Its
    own inverse: the gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, ctx.group), None


def ulysses_attention(group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dropout_p: float) -> torch.Tensor:
    """model.causal_attention under --cp_method ulysses: this rank's tokens of every head in, all the tokens of
    n_head / cp heads attended, this rank's tokens of every head out."""
    cp, tokens = group.size(), q.shape[2]
    if k.shape[1] % cp:  # q head h attends with k and v head h // (n_head / n_kv_head): repeated, they split as q's
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, tokens) -> (batch, heads / cp, cp · tokens)
        parts = AllToAll.apply(t.unflatten(1, (cp, -1)).movedim(1, 0), group)  # part r: rank r's tokens, my heads
        return parts.permute(1, 2, 0, 3, 4).flatten(2, 3)

    q, k, v = (to_heads(t) for t in (q, k, v))
    where = torch.cat([positions(cp * tokens, cp, r, q.device) for r in range(cp)])  # the ranks' tokens, in order
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=where[None, :] <= where[:, None], dropout_p=dropout_p,
                                       enable_gqa=k.shape[1] != q.shape[1])
    back = AllToAll.apply(y.unflatten(2, (cp, tokens)).permute(2, 0, 1, 3, 4), group)  # part r: my tokens, r's heads
    return back.movedim(0, 1).flatten(1, 2)


class RingPass(torch.autograd.Function):
    """x sent to the next rank of `group`, the previous rank's received; the gradient passed the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
        ctx.group, ctx.step = group, -step
        return ring_pass(x, group, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ring_pass(grad, ctx.group, ctx.step), None, None


def ring_pass(x: torch.Tensor, group: dist.ProcessGroup, step: int) -> torch.Tensor:
    """x to the rank `step` places on in `group`, and what the rank `step` places back sent."""
    cp, rank = group.size(), group.rank()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + step) % cp), group),
        dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % cp), group)])
    for work in works:
        work.wait()
    return out


def ring_attention(group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: float) -> torch.Tensor:
    """model.causal_attention under --cp_method ring: at step t this rank holds rank (rank - t)'s k and v, and
    attends to them under the mask of the positions; the steps' results merged. In fp32 whatever the compute dtype.
    No dropout (refused)."""
    cp, rank, tokens, group_size = group.size(), group.rank(), q.shape[2], q.shape[1] // k.shape[1]
    mine = positions(cp * tokens, cp, rank, q.device)
    q32 = q.float() * q.shape[-1] ** -0.5
    outs, lses = [], []
    for step in range(cp):
        if step:  # k's and v's own heads travel (grouped-query: the few), repeated for q's heads where they arrive
            k, v = RingPass.apply(k, group, 1), RingPass.apply(v, group, 1)
        keys, values = (t.float().repeat_interleave(group_size, dim=1) for t in (k, v))  # as enable_gqa pairs them
        scores = q32 @ keys.transpose(-2, -1)
        seen = positions(cp * tokens, cp, (rank - step) % cp, q.device)[None, :] <= mine[:, None]
        # a large finite number, not -inf: a row with no key here (a later chunk's) gets weight exp(-1e30) = 0, not
        # the nan of -inf - (-inf), in the forward and in the backward
        scores = scores.masked_fill(~seen, -1e30)
        lses.append(scores.logsumexp(-1, keepdim=True))
        outs.append((scores - lses[-1]).exp() @ values)
    return merge(outs, lses).to(q.dtype)


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Attention over all the keys, from its parts over some: each part's result weighted by its share of the
    softmax's denominator, exp(its log-sum-exp - the whole's)."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    return sum(out * (part - lse).exp() for out, part in zip(outs, lses, strict=True))


ATTENTION = {"allgather": allgather_attention, "ulysses": ulysses_attention, "ring": ring_attention}


def context_parallel(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """--cp: the model's inputs cut to this rank's tokens, and every block's attention the method's."""
    model.register_forward_pre_hook(functools.partial(split_sequences, group), with_kwargs=True)
    for block in model.blocks:
        block.attn.attend = functools.partial(ATTENTION[method], group)
