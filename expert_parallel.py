"""Expert parallel by hand: a top-k routed mixture of experts in gpt/model.py's blocks, the experts spread over ranks.

docs/expert_parallel.md. Each rank trains on its own part of the batch (data parallel) but holds n_experts / N of
each block's experts. A router picks k experts per token; an expert takes at most a capacity of tokens per rank,
the rest are dropped. Tokens go to their experts' ranks and back with all_to_all_single, after the counts; a
load-balancing loss keeps the router from favouring few. One step is checked against one process, then it trains.

    torchrun --standalone --nproc-per-node 2 expert_parallel.py
    torchrun --standalone --nproc-per-node 4 expert_parallel.py --n_experts 8 --top_k 2 --capacity_factor 1.0
"""
import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later, it holds the group at exit
import torch.nn.functional as F
from torch import nn

from gpt.model import GPT, MLP, GPTConfig

TOLERANCE = 1e-5  # fp32: the same sums, some taken on other ranks, in another order
VOCAB_SIZE = 96  # token ids drawn at random below it


class AllToAll(torch.autograd.Function):
    """all_to_all_single: counts_in[r] rows of x to rank r, counts_out[r] from it; gradients go back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, counts_out: list[int], counts_in: list[int]) -> torch.Tensor:
        ctx.counts = counts_out, counts_in
        out = x.new_empty(sum(counts_out), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), counts_out, counts_in)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, *reversed(ctx.counts)), None, None


class MoE(nn.Module):
    """In place of a block's MLP: a router, and this rank's experts (all of them in one process)."""

    def __init__(self, config: GPTConfig, n_experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        self.router = nn.Linear(config.n_embd, n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(config) for e in range(n_experts)})  # build() keeps this rank's
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.world_size, self.per_rank = 1, n_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, d)
        tokens = x.reshape(-1, x.shape[-1])  # (T, d)
        probs = self.router(tokens).softmax(-1)  # (T, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (T, k): each token's k experts
        weights = weights / weights.sum(-1, keepdim=True) if self.top_k > 1 else weights  # k = 1: w/w would be 1
        # Assignments, first choices before second ones: a token's second choice is the first to be dropped
        expert, weight = experts.t().reshape(-1), weights.t().reshape(-1)  # (k·T)
        token = torch.arange(len(tokens)).repeat(self.top_k)
        capacity = math.ceil(self.capacity_factor * len(tokens) * self.top_k / self.n_experts)
        place = (F.one_hot(expert, self.n_experts).cumsum(0) * F.one_hot(expert, self.n_experts)).sum(-1) - 1
        kept = place < capacity  # an expert's first `capacity` assignments on this rank; the rest dropped
        self.dropped, self.routed = int((~kept).sum()), torch.bincount(expert[kept], minlength=self.n_experts)
        order = expert[kept].argsort(stable=True)  # by expert, so by the rank that holds it
        expert, weight, token = expert[kept][order], weight[kept][order], token[kept][order]
        send = torch.bincount(expert // self.per_rank, minlength=self.world_size)  # rows for each rank
        if self.world_size > 1:  # the counts first: each rank learns how many rows it will receive from each
            receive = torch.empty_like(send)
            dist.all_to_all_single(receive, send)
            send, receive = send.tolist(), receive.tolist()
            rows = AllToAll.apply(tokens[token], receive, send)
            ids = torch.empty(sum(receive), dtype=expert.dtype)
            dist.all_to_all_single(ids, expert, receive, send)  # which expert each received row is for
        else:
            rows, ids = tokens[token], expert
        out = torch.zeros_like(rows)
        for name, mlp in self.experts.items():
            mine = ids == int(name)
            out[mine] = mlp(rows[mine])
        self.received = {int(name): int((ids == int(name)).sum()) for name in self.experts}
        if self.world_size > 1:
            out = AllToAll.apply(out, send, receive)  # back to the rank the token came from
        combined = torch.zeros_like(tokens).index_add(0, token, out * weight.unsqueeze(-1))
        # Switch Transformer's balance loss: E · Σ_e (share of assignments to e) · (mean router probability of e)
        share = torch.bincount(experts.reshape(-1), minlength=self.n_experts) / experts.numel()
        self.aux_loss = self.n_experts * (share * probs.mean(0)).sum()
        return combined.view_as(x)


def build(args: argparse.Namespace, world_size: int, rank: int) -> GPT:
    """The GPT with a MoE in each block: every rank draws every weight from one seed, then keeps its experts."""
    model = GPT(GPTConfig(VOCAB_SIZE, args.seq_len, args.n_layer, args.n_head, args.n_embd))
    for block in model.blocks:
        block.mlp = MoE(model.config, args.n_experts, args.top_k, args.capacity_factor)
    model.init_weights(args.seed)  # GPT-2's rule, by name (an expert's fc and proj as an MLP's)
    for block in model.blocks:
        moe, moe.world_size, moe.per_rank = block.mlp, world_size, args.n_experts // world_size
        for e in [e for e in range(args.n_experts) if e // moe.per_rank != rank]:
            del moe.experts[str(e)]  # rank r holds experts r·E/N to (r + 1)·E/N - 1
    return model


def loss_of(model: GPT, tokens: torch.Tensor, aux_weight: float) -> torch.Tensor:
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())  # next token, and balance
    return loss + aux_weight * sum(block.mlp.aux_loss for block in model.blocks)


def average_gradients(model: GPT, world_size: int) -> None:
    """The loss is the mean of the ranks' losses. Shared weights: all-reduce their gradients, divide by N.
    Experts: the all-to-all's backward already brought every rank's part home; divide by N."""
    for name, p in model.named_parameters():
        if ".experts." not in name:
            dist.all_reduce(p.grad)
        p.grad /= world_size


def one_process_step(reference: GPT, tokens: torch.Tensor, world_size: int, aux_weight: float) -> float:
    """The same step in one process: each rank's part of the batch run alone (its own capacities and balance
    loss), the mean of the parts' losses."""
    loss = sum(loss_of(reference, part, aux_weight) for part in tokens.chunk(world_size)) / world_size
    loss.backward()
    return loss.item()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_experts", type=int, default=4, help="experts per block: a multiple of the ranks")
    parser.add_argument("--top_k", type=int, default=2, help="experts per token")
    parser.add_argument("--capacity_factor", type=float, default=1.25, help="an expert's tokens per rank, at most "
                        "this × its fair share (tokens × k / experts); the rest are dropped")
    parser.add_argument("--aux_weight", type=float, default=0.01, help="weight of the load-balancing loss")
    parser.add_argument("--steps", type=int, default=5, help="training steps after the check")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--n_layer", type=int, default=2, help="blocks")
    parser.add_argument("--n_head", type=int, default=2, help="attention heads")
    parser.add_argument("--n_embd", type=int, default=32, help="width: a multiple of n_head")
    parser.add_argument("--seq_len", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the tokens")
    args = parser.parse_args()
    for name in ("n_experts", "top_k", "capacity_factor", "batch_size", "n_layer", "n_head", "n_embd", "seq_len",
                 "lr"):
        if not 0 < getattr(args, name) < 1e5:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e5, got {getattr(args, name)}")
    for wrong, message in ((args.top_k > args.n_experts, "--top_k must be at most --n_experts"),
                           (args.n_embd % args.n_head, "--n_head must divide --n_embd"),
                           (not (0 <= args.aux_weight < 1e5 and 0 <= args.steps < 1e5), "--aux_weight and --steps "
                            "must be 0 or more, below 1e5")):
        if wrong:
            parser.error(message)
    return args


def train(args: argparse.Namespace, rank: int, world_size: int) -> GPT:
    """Check one step against one process, then train beside it."""
    model, reference = build(args, world_size, rank), build(args, 1, 0)  # the same weights, drawn from one seed
    tokens = torch.randint(VOCAB_SIZE, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(args.seed))  # the whole batch, on every rank
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (model, reference)]
    for step in range(args.steps + 1):
        loss = loss_of(model, tokens.chunk(world_size)[rank], args.aux_weight)  # this rank's part of the batch
        loss.backward()
        average_gradients(model, world_size)
        reference_loss = one_process_step(reference, tokens, world_size, args.aux_weight)
        if step == 0:  # the check: every gradient this rank holds against the one of the same name
            whole = dict(reference.named_parameters())
            error = torch.stack([(p.grad - whole[name].grad).abs().max() for name, p in model.named_parameters()]).max()
            moe = [block.mlp for block in model.blocks]
            print(f"[rank {rank}/{world_size}] experts {sorted(moe[0].received)}: tokens received per block "
                  f"{[m.received for m in moe]} | dropped {sum(m.dropped for m in moe)} of "
                  f"{sum(m.top_k * tokens[:, 1:].numel() // world_size for m in moe)} | gradients {error:.1e} from "
                  "one process's\n", end="", flush=True)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)  # every rank: the mean of the ranks' losses
        if rank == 0 and step:
            print(f"step {step} | loss {loss.item():.6f} (one process: {reference_loss:.6f})", flush=True)
    if not error <= TOLERANCE:  # not >: a NaN passes no comparison
        raise SystemExit(f"error: rank {rank} differs from one process by {error:.1e} (tolerance {TOLERANCE:.0e})")
    return model


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 expert_parallel.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.n_experts % world_size or args.batch_size % world_size:
        raise SystemExit(f"error: {world_size} ranks must divide --n_experts {args.n_experts} and --batch_size "
                         f"{args.batch_size}")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
