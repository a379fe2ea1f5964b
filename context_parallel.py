"""Context parallel by hand: attention over a sequence split among ranks, by a ring of keys and values, or by Ulysses.

docs/context_parallel.md, docs/ulysses.md. Each rank holds a slice of the sequence's queries, keys and values. Each
step of the ring it starts sending the keys and values it holds to the next rank, and receiving the previous rank's,
while it attends to the ones it has; the partial results merge by the log-sum-exp rule. The backward is written by
hand (as FlashAttention's: recomputed from the saved log-sum-exp), the keys' and values' gradients travelling round the
ring with them.
--zigzag: rank i holds chunks i and 2N-1-i, so that each rank has as much of the causal triangle as the others.
--method ulysses (DeepSpeed-Ulysses): two all-to-alls swap the split instead, from the sequence to the heads, so that
each rank attends over the whole sequence for heads/N heads, then back.

    torchrun --standalone --nproc-per-node 4 context_parallel.py
    torchrun --standalone --nproc-per-node 4 context_parallel.py --zigzag --seq_len 30
    torchrun --standalone --nproc-per-node 4 context_parallel.py --method ulysses --n_head 8
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later, it holds the group at exit
import torch.nn.functional as F

TOLERANCE = 1e-5  # fp32: the softmax is summed block by block, in another order than one process's


def chunk_starts(rank: int, world_size: int, seq_len: int, zigzag: bool) -> list[int]:
    """Where each of this rank's chunks starts in the (padded) sequence: chunk `rank` of N, or of 2N with its
    mirror image 2N-1-rank."""
    if zigzag:
        size = seq_len // (2 * world_size)
        return [rank * size, (2 * world_size - 1 - rank) * size]
    return [rank * seq_len // world_size]


def pairs(q_starts: list[int], k_starts: list[int], causal: bool = True):
    """The (query chunk, key chunk) pairs that causal attention needs: keys at or before the queries. Chunks
    are equal and aligned, so a pair is all before (no mask), the diagonal (a triangle), or all after (skipped).
    Not causal: every pair, none masked."""
    for i, q_start in enumerate(q_starts):
        for j, k_start in enumerate(k_starts):
            if k_start <= q_start or not causal:
                yield i, j, k_start == q_start and causal


def scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (batch, heads, chunk, chunk)
    return s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf")) if diagonal else s


def ring_pass(tensors: list[torch.Tensor]) -> tuple[list[dist.Work], list[torch.Tensor]]:
    """Start sending these to the next rank and receiving the previous rank's into new buffers."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size == 1:  # the ring is this rank alone
        return [], list(tensors)
    received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), (rank + 1) % world_size) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, (rank - 1) % world_size) for t in received]
    return dist.batch_isend_irecv(ops), received


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries to every rank's keys and values; tensors (batch, heads, seq, dim)
    with this rank's chunks laid end to end; starts[r]: where rank r's chunks start in the whole sequence."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[list[int]],
                causal: bool = True) -> torch.Tensor:
        rank, world_size, size = dist.get_rank(), dist.get_world_size(), q.shape[2] // len(starts[0])
        q, k, v = (t.contiguous() for t in (q, k, v))  # e.g. gpt/model.py's, transposed: sent and received whole
        out, lse = torch.zeros_like(q), torch.full_like(q[..., 0], float("-inf"))  # lse: (batch, heads, seq)
        qs, held = q.split(size, dim=2), [k, v]
        for step in range(world_size):
            if step < world_size - 1:  # the next block travels while this one is computed
                works, incoming = ring_pass(held)
            ks, vs = held[0].split(size, dim=2), held[1].split(size, dim=2)
            for i, j, diagonal in pairs(starts[rank], starts[(rank - step) % world_size], causal):
                s = scores(qs[i], ks[j], diagonal)
                block_lse, rows = s.logsumexp(-1), slice(i * size, (i + 1) * size)
                new = torch.logaddexp(lse[..., rows], block_lse)  # merge: each part weighted by its share
                out[..., rows, :] = (out[..., rows, :] * (lse[..., rows] - new).exp().unsqueeze(-1)
                                     + (s - new.unsqueeze(-1)).exp() @ vs[j])
                lse[..., rows] = new
            if step < world_size - 1:
                for work in works:
                    work.wait()
                held = incoming
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.starts, ctx.causal = starts, causal
        return out

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world_size, size = dist.get_rank(), dist.get_world_size(), q.shape[2] // len(ctx.starts[0])
        delta = (d_out * out).sum(-1)  # rowsum(dO · O): the softmax's backward, per query
        d_q, held = torch.zeros_like(q), [k, v, torch.zeros_like(k), torch.zeros_like(v)]
        for step in range(world_size):  # the same ring; each block's dK, dV travel with it and come home last
            k_b, v_b, d_k, d_v = held
            for i, j, diagonal in pairs(ctx.starts[rank], ctx.starts[(rank - step) % world_size], ctx.causal):
                rows, cols = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
                p = (scores(q[..., rows, :], k_b[..., cols, :], diagonal) - lse[..., rows].unsqueeze(-1)).exp()
                d_v[..., cols, :] += p.transpose(-2, -1) @ d_out[..., rows, :]
                d_s = p * (d_out[..., rows, :] @ v_b[..., cols, :].transpose(-2, -1) - delta[..., rows].unsqueeze(-1))
                d_q[..., rows, :] += d_s @ k_b[..., cols, :] / q.shape[-1] ** 0.5
                d_k[..., cols, :] += d_s.transpose(-2, -1) @ q[..., rows, :] / q.shape[-1] ** 0.5
            works, held = ring_pass(held)  # after N passes a block, with its gradients, is back at its rank
            for work in works:
                work.wait()
        return d_q, held[2], held[3], None, None


def all_to_all(x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
    """Cut x into N parts along dim `scatter`, send part j to rank j, and lay the N parts received end to end
    along dim `gather`, rank 0's first."""
    parts = torch.stack(x.chunk(dist.get_world_size(), scatter))  # (N, ...): part j for rank j, contiguous
    received = torch.empty_like(parts)
    dist.all_to_all_single(received, parts)  # received[j]: what rank j cut out for this rank
    return torch.cat(received.unbind(), gather)


class AllToAll(torch.autograd.Function):
    """all_to_all with a gradient: the backward is the same exchange the other way, gather and scatter swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter: int, gather: int) -> torch.Tensor:
        ctx.dims = scatter, gather
        return all_to_all(x, scatter, gather)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_to_all(grad, ctx.dims[1], ctx.dims[0]), None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """DeepSpeed-Ulysses: this rank's contiguous chunk of tokens, every head, (batch, heads, seq/N, dim), swapped
    for every token of heads/N heads, (batch, heads/N, seq, dim); attention as in one process; swapped back."""
    q, k, v = (AllToAll.apply(t, 1, 2) for t in (q, k, v))  # scatter the heads, gather the sequence
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return AllToAll.apply(out, 2, 1)  # scatter the sequence, gather the heads: this rank's tokens again


def sent_per_rank(method: str, world_size: int, local: torch.Tensor) -> int:
    """Bytes each rank sends for one attention's forward and backward, `local` its (batch, heads, seq/N, dim) q.
    The ring: k and v N - 1 times forward, k, v, dk and dv N times backward. Ulysses: of q, k, v and the output
    forward, and of their gradients backward, all but the part it keeps, (N - 1)/N."""
    if method == "ring":
        return (2 * (world_size - 1) + 4 * world_size) * local.nbytes if world_size > 1 else 0
    return 8 * (world_size - 1) * local.nbytes // world_size


def work(rank: int, world_size: int, seq_len: int, zigzag: bool, causal: bool = True) -> int:
    """Attention scores this rank computes: its pairs of chunks with every rank's, chunk × chunk each."""
    size = seq_len // (2 * world_size if zigzag else world_size)
    mine = chunk_starts(rank, world_size, seq_len, zigzag)
    return sum(size * size for r in range(world_size)
               for _ in pairs(mine, chunk_starts(r, world_size, seq_len, zigzag), causal))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ring", choices=["ring", "ulysses"], help="how the ranks meet")
    parser.add_argument("--zigzag", action="store_true", help="chunks i and 2N-1-i on rank i: balanced work (ring)")
    parser.add_argument("--full_attention", action="store_true", help="every query to every key (not causal)")
    parser.add_argument("--seq_len", type=int, default=32, help="tokens; padded at the end to whole chunks")
    parser.add_argument("--batch_size", type=int, default=2, help="sequences")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads (ulysses: a multiple of the ranks)")
    parser.add_argument("--head_dim", type=int, default=8, help="width of a head")
    parser.add_argument("--seed", type=int, default=0, help="seed of q, k, v and of the output's gradient")
    args = parser.parse_args()
    for name in ("seq_len", "batch_size", "n_head", "head_dim"):
        if not 0 < getattr(args, name) < 1e5:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e5, got {getattr(args, name)}")
    if args.zigzag and args.method == "ulysses":
        parser.error("--zigzag is the ring's layout: under Ulysses every rank attends over the whole sequence")
    return args


def check(args: argparse.Namespace, rank: int, world_size: int) -> float:
    """The output and q, k, v gradients of ring or Ulysses attention against attention over the whole sequence."""
    generator = torch.Generator().manual_seed(args.seed)  # the same tensors on every rank: no broadcast needed
    q, k, v, d_out = (torch.randn(args.batch_size, args.n_head, args.seq_len, args.head_dim, generator=generator)
                      for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    causal = not args.full_attention
    F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(d_out)  # the reference, in this process
    chunks = 2 * world_size if args.zigzag else world_size
    padded = -(-args.seq_len // chunks) * chunks  # padding at the end: keys after every real query (causal)
    starts = [chunk_starts(r, world_size, padded, args.zigzag) for r in range(world_size)]
    index = torch.cat([torch.arange(s, s + padded // chunks) for s in starts[rank]])  # this rank's positions

    def mine(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.detach(), (0, 0, 0, padded - args.seq_len))[:, :, index]
    local = [mine(t).requires_grad_() for t in (q, k, v)]
    if args.method == "ring":
        out = RingAttention.apply(*local, starts, causal)
    else:
        out = ulysses_attention(*local, causal)
    out.backward(mine(d_out))
    real = index < args.seq_len  # padded queries' rows are dropped
    with torch.no_grad():
        compared = [(out, mine(F.scaled_dot_product_attention(q, k, v, is_causal=causal)))]
        compared += [(t.grad, mine(whole.grad)) for t, whole in zip(local, (q, k, v), strict=True)]
        error = torch.stack([(a[:, :, real] - b[:, :, real]).abs().max() for a, b in compared]).max().item()
    works = [work(rank, world_size, -(-args.seq_len // n) * n, n > world_size, causal)
             for n in (world_size, 2 * world_size)]
    heads = args.n_head // world_size  # under Ulysses, this rank's heads between the two all-to-alls
    layout = (f"ulysses, heads {list(range(rank * heads, (rank + 1) * heads))} over every token"
              if args.method == "ulysses"
              else f"{'zigzag' if args.zigzag else 'contiguous'}, chunks at {starts[rank]}")
    print(f"[rank {rank}/{world_size}] {layout}: out, dq, dk, dv {error:.1e} from one process's | "
          + (f"scores computed: {works[0]:,} contiguous, {works[1]:,} zigzag | " if args.method == "ring" else "")
          + f"bytes sent: ring {sent_per_rank('ring', world_size, local[0]):,}, ulysses "
          + (f"{sent_per_rank('ulysses', world_size, local[0]):,}" if args.n_head % world_size == 0 else "(heads)")
          + "\n", end="", flush=True)
    if not error <= TOLERANCE:  # not >: a NaN passes no comparison
        raise SystemExit(f"error: rank {rank} differs from one process by {error:.1e} (tolerance {TOLERANCE:.0e})")
    return error


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 4 context_parallel.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    chunks = 2 * world_size if args.zigzag else world_size
    padded = -(-args.seq_len // chunks) * chunks
    if max(min(chunk_starts(r, world_size, padded, args.zigzag)) for r in range(world_size)) >= args.seq_len:
        raise SystemExit(f"error: --seq_len {args.seq_len} is too short for the {chunks} chunks of {world_size} ranks"
                         + (" with --zigzag" if args.zigzag else "") + ": a rank would hold padding only")
    if args.full_attention and args.seq_len % chunks:
        raise SystemExit(f"error: --full_attention needs --seq_len a multiple of the {chunks} chunks: every query "
                         "would see the padding")
    if args.method == "ulysses" and args.n_head % world_size:
        raise SystemExit(f"error: Ulysses gives each rank heads/N heads: --n_head {args.n_head} is not a multiple of "
                         f"the {world_size} ranks")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when the check fails
        check(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
