"""Context parallel, train.py --cp N: each sequence split over N ranks, which read the same batch and join FSDP's
shard group (the weights are sharded over them, not replicated); only attention sees the other ranks' tokens.

The split is head-tail balanced: the sequence cut into 2N chunks, rank i holds chunks i and 2N - 1 - i, so that
under the causal mask every rank attends over as many (query, key) pairs as the others (rank 0's first chunk has
the fewest keys, its last the most). Every token keeps its true position, for the rotary tables and for GPT-2's
learned positions. Each rank's loss is its tokens' mean; FSDP averages the gradients over its shard group, cp ranks
included, so the step is the whole sequences' mean, as one process takes it.

--cp_method allgather (Llama 3's, torchtitan's): k and v gathered from the cp ranks after the rotary embedding and
put in the sequence's order, each rank's queries attending over all of them under the mask of their positions; in
the backward each rank's k and v get the gradients of every rank's queries, summed (a reduce-scatter).
--cp_method ulysses (DeepSpeed-Ulysses): an all-to-all each for q, k and v trades the sequence split for a head
split (each rank all the tokens of n_head / N heads), attention runs whole on those heads, and one all-to-all
trades back; n_head must divide by N, and k's and v's heads are repeated up to n_head where n_kv_head does not.
--cp_method ring (ring attention): k and v passed from rank to rank, N - 1 times, while each rank attends to what
it holds (each pass in flight during that step's attention); the N partial results merged by their log-sum-exp.
Its backward is written out (RingAttention), flash attention's: nothing of the sequence's length squared is kept
for it.
"""
import functools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model import MoE

METHODS = ("allgather", "ulysses", "ring")
# torch 2.13 names them all_gather_single and reduce_scatter_single, and warns that the older names will go
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
# Seconds this rank has waited in ring_pass for k and v (the ring's sends and receives), since train.py last read
# it: its log's cp_wait. The host's time: on CUDA, wait() only makes the stream wait (a profiler sees the rest).
WAITED = [0.0]


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
    the keys and values of the whole sequence gathered and put in the sequence's order (they come in the ranks'),
    each query attending over those at its place or before: one process's keys, in one process's order."""
    cp, rank = group.size(), group.rank()
    seq_len = q.shape[2] * cp
    mine = positions(seq_len, cp, rank, q.device)
    order = torch.cat([positions(seq_len, cp, r, q.device) for r in range(cp)]).argsort()
    k, v = (Gather.apply(t, group).permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, order] for t in (k, v))
    seen = torch.arange(seq_len, device=q.device)[None, :] <= mine[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, dropout_p=dropout_p,
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
    n_head / cp heads attended (put in the sequence's order: one process's causal attention, no mask to make), this
    rank's tokens of every head out."""
    cp, tokens = group.size(), q.shape[2]
    if k.shape[1] % cp:  # q head h attends with k and v head h // (n_head / n_kv_head): repeated, they split as q's
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))

    def to_heads(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, tokens) -> (batch, heads / cp, cp · tokens)
        parts = AllToAll.apply(t.unflatten(1, (cp, -1)).movedim(1, 0), group)  # part r: rank r's tokens, my heads
        return parts.permute(1, 2, 0, 3, 4).flatten(2, 3)

    where = torch.cat([positions(cp * tokens, cp, r, q.device) for r in range(cp)])  # the ranks' tokens, in order
    q, k, v = (to_heads(t)[:, :, where.argsort()] for t in (q, k, v))  # the sequence's order: plain causal attention
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                       enable_gqa=k.shape[1] != q.shape[1])[:, :, where]  # the ranks' order again
    back = AllToAll.apply(y.unflatten(2, (cp, tokens)).permute(2, 0, 1, 3, 4), group)  # part r: my tokens, r's heads
    return back.movedim(0, 1).flatten(1, 2)


def ring_pass(tensors: tuple[torch.Tensor, ...], group: dist.ProcessGroup, tag: int = 0):
    """Start sending each tensor to the next rank of `group` and receiving the previous rank's: one
    batch_isend_irecv, all in flight together, while the caller computes. Returns a function that waits for them
    (the time counted in WAITED) and gives what was received. `tag` keeps the backward's two rings apart."""
    cp, rank = group.size(), group.rank()
    to, source = (dist.get_global_rank(group, (rank + step) % cp) for step in (1, -1))
    outs = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)
    works = dist.batch_isend_irecv([op for t, out in zip(tensors, outs, strict=True) for op in (
        dist.P2POp(dist.isend, t.contiguous(), to, group, tag), dist.P2POp(dist.irecv, out, source, group, tag))])

    def received() -> tuple[torch.Tensor, ...]:
        start = time.perf_counter()
        for work in works:
            work.wait()
        WAITED[0] += time.perf_counter() - start
        return outs
    return received


def ring_block(rank: int, source: int, tokens: int) -> tuple[slice, slice, bool]:
    """Which of this rank's queries see which of rank `source`'s keys, head-tail: (query rows, key columns, causal).
    Its own: all of them, causally (its two chunks are in the sequence's order). An earlier rank's: all the queries
    see its first chunk (before both of this rank's), none its last (after both). A later rank's: only this rank's
    last chunk sees it, all of it. Half the scores a step, but for its own: the head-tail balance, paid."""
    half = tokens // 2
    if source == rank:
        return slice(None), slice(None), True
    return (slice(None), slice(0, half), False) if source < rank else (slice(half, None), slice(None), False)


def scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """q · k, fp32 (q already scaled), k's heads repeated to q's (as enable_gqa pairs them); causal: a query sees
    the keys up to its own place (the diagonal: never a row of none)."""
    s = q @ k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-2, -1)
    return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf")) if causal else s


def merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor):
    """Attention over the keys of both, from attention over each: each result weighted by its share of the
    softmax's denominator, exp(its log-sum-exp - the whole's); and the whole's log-sum-exp."""
    whole = torch.logaddexp(lse, part_lse)
    return out * (lse - whole).exp() + part * (part_lse - whole).exp(), whole


class RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence, k and v passed round the cp ranks: at step t this rank holds rank
    (rank - t)'s and attends to them (ring_block), the steps' results merged by their log-sum-exp. In fp32 whatever
    the compute dtype. Flash attention's way: each step's scores made, used and dropped, the backward making them
    again from the output and its log-sum-exp; so a rank keeps q, its own k and v, the output and the log-sum-exp,
    nothing of the length squared. The backward passes k and v round again, with the sums of their gradients beside
    them, and the sums one step more, home. Each pass is in flight while the block held is computed."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        cp, rank, scale = group.size(), group.rank(), q.shape[-1] ** -0.5
        q32, kv = q.float() * scale, (k, v)
        out, lse = None, None
        for step in range(cp):
            incoming = ring_pass(kv, group) if step < cp - 1 else None  # the next block travels meanwhile
            rows, cols, causal = ring_block(rank, (rank - step) % cp, q.shape[2])
            s = scores(q32[:, :, rows], kv[0][:, :, cols], causal)
            part_lse = s.logsumexp(-1, keepdim=True)
            values = kv[1][:, :, cols].float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            part = (s - part_lse).exp() @ values
            if out is None:  # its own keys: every query's first; copies, as the merges below write into them in
                out, lse = part.clone(), part_lse.clone()  # place, and selective checkpointing keeps the products
            else:
                out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], part, part_lse)
            if incoming:
                kv = incoming()
        ctx.group = group
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, repeat = ctx.group, q.shape[1] // k.shape[1]
        cp, rank, scale = group.size(), group.rank(), q.shape[-1] ** -0.5
        q32, grad = q.float() * scale, grad.float()
        dot = (grad * out).sum(-1, keepdim=True)  # softmax's backward: each row's sum of grad · out
        dq, kv, sums = torch.zeros_like(q32), (k, v), None
        dkv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(cp):
            incoming = ring_pass(kv, group) if step < cp - 1 else None  # the next block travels meanwhile
            rows, cols, causal = ring_block(rank, (rank - step) % cp, q.shape[2])
            p = (scores(q32[:, :, rows], kv[0][:, :, cols], causal) - lse[:, :, rows]).exp()  # the softmax's weights
            keys, values = (t[:, :, cols].float().repeat_interleave(repeat, dim=1) for t in kv)
            ds = p * (grad[:, :, rows] @ values.transpose(-2, -1) - dot[:, :, rows])  # the scores' gradient
            dq[:, :, rows] += ds @ keys * scale
            parts = ds.transpose(-2, -1) @ q32[:, :, rows], p.transpose(-2, -1) @ grad[:, :, rows]
            if sums:  # the sums for the block held, from the previous rank, which held it a step ago
                dkv = sums()
            for acc, d in zip(dkv, parts, strict=True):  # a q head's share summed into its k and v head's
                acc[:, :, cols] += d.unflatten(1, (k.shape[1], repeat)).sum(2)
            sums = ring_pass(dkv, group, tag=1)  # on, with the block: after the last step, one step more, home
            if incoming:
                kv = incoming()
        dk, dv = sums()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(group: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   dropout_p: float) -> torch.Tensor:
    """model.causal_attention under --cp_method ring (RingAttention). No attention dropout (train.py's models have
    none)."""
    if dropout_p:
        raise ValueError(f"ring attention has no attention dropout (the model's: {dropout_p}): use allgather or "
                         "ulysses")
    return RingAttention.apply(q, k, v, group)


def wait_metrics(record: dict, line: str, interval: float, device: torch.device) -> tuple[dict, str]:
    """The log's record and line with the ring's cp_wait: the largest share of the `interval` seconds that a rank
    waited for k and v (WAITED, then zeroed). One all-reduce (max): every rank calls it."""
    waited = torch.tensor(WAITED[0] / interval, device=device)
    dist.all_reduce(waited, op=dist.ReduceOp.MAX)
    WAITED[0], record["cp_wait"] = 0.0, round(waited.item(), 4)
    return record, f"{line} | cp wait {record['cp_wait']:.0%}"


def repeated_heads(args, config) -> str:
    """train.py's line under ulysses where a tp rank's k and v heads do not split over the cp ranks."""
    return (f"--cp {args.cp} --cp_method ulysses: the model's {config.n_kv_head // args.tp} k and v heads"
            f"{' a tp rank' if args.tp > 1 else ''} do not split over {args.cp} ranks: repeated to its "
            f"{config.n_head // args.tp} q heads before the all-to-all (more bytes sent)")


ATTENTION = {"allgather": allgather_attention, "ulysses": ulysses_attention, "ring": ring_attention}


class SumOver(torch.autograd.Function):
    """x summed over `group`'s ranks, and so is its gradient: each cp rank's loss adds the one auxiliary loss of the
    summed routing, and FSDP then averages the gradients over the cp ranks, so each rank's share of the auxiliary
    loss's gradient must be all of theirs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, x = group, x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def moe_forward(layer: MoE, group: dist.ProcessGroup, forward, x: torch.Tensor) -> torch.Tensor:
    """A mixture of experts' forward (`forward`: MoE.forward, or tensor parallel's) on this rank's tokens, its
    routing's sums then the cp group's: those of the whole sequences, for the auxiliary loss (GPT.forward counts
    the cp group's tokens) and DeepSeek's bias, as one process routes them."""
    y = forward(x)
    counts, probs, dropped = layer.routed
    dist.all_reduce(counts, group=group)
    dist.all_reduce(dropped, group=group)
    layer.routed = (counts, SumOver.apply(probs, group), dropped)
    return y


def context_parallel(model: nn.Module, group: dist.ProcessGroup, method: str) -> None:
    """--cp: the model's inputs cut to this rank's tokens, every block's attention the method's, and a mixture of
    experts' routing summed over the cp ranks (moe_forward). A pipeline's
    stage (its blocks a ModuleDict) takes the cp group instead: its Pipeline cuts each batch, and each stage makes
    its tokens' positions (gpt/pipeline.py)."""
    if isinstance(model.blocks, nn.ModuleDict):
        model.cp_group = group
    else:
        model.register_forward_pre_hook(functools.partial(split_sequences, group), with_kwargs=True)
    model.cp_size = group.size()  # GPT.forward's and the Pipeline's count of the routed tokens
    for block in getattr(model.blocks, "values", lambda: model.blocks)():
        block.attn.attend = functools.partial(ATTENTION[method], group)
        if isinstance(block.mlp, MoE):
            block.mlp.forward = functools.partial(moe_forward, block.mlp, group, block.mlp.forward)
