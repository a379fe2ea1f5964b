"""Tensor parallel by hand, Megatron's way, on gpt/model.py's GPT; then sequence parallel; then torch's own.

docs/tensor_parallel.md. Each block's attention and MLP split among the ranks: q, k, v, fc by rows, o, proj by
columns, then an all-reduce of the partial sums. --sequence_parallel: a slice of the sequence per rank outside them,
the all-reduce a reduce-scatter and an all-gather. One step checked against one process, with its collectives.

    torchrun --standalone --nproc-per-node 2 tensor_parallel.py
    torchrun --standalone --nproc-per-node 4 tensor_parallel.py --sequence_parallel
"""
import argparse
import copy
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later, it holds the group at exit
import torch.distributed.tensor.parallel as tp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from gpt.model import GPT, GPTConfig

TOLERANCE = 1e-5  # fp32: the ranks' partial sums are added in another order than one process's whole sum
VOCAB_SIZE = 96  # token ids drawn at random below it
KINDS = (("scatter", "reduce_scatter"), ("gather", "all_gather"), ("reduce", "all_reduce"))  # in a collective's name


def all_reduce(x: torch.Tensor) -> torch.Tensor:  # the sum of every rank's x, in a new tensor (autograd's own
    dist.all_reduce(x := x.clone())  # are never changed in place)
    return x


def all_gather(x: torch.Tensor) -> torch.Tensor:  # (batch, seq / N, d) → (batch, seq, d): every rank's slice
    out = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype)  # the slices stacked
    dist.all_gather_single(out, x.contiguous())
    return torch.cat(out.chunk(dist.get_world_size()), dim=1)  # ... then laid end to end along the sequence


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:  # (batch, seq, d) → (batch, seq / N, d): summed, this rank's
    out = torch.empty_like(split(x))
    dist.reduce_scatter_single(out, torch.cat(x.chunk(dist.get_world_size(), dim=1)))  # rank r's part: slice r
    return out


def split(x: torch.Tensor) -> torch.Tensor:  # this rank's slice of the sequence, with no communication
    return x.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous()


class Conjugate(torch.autograd.Function):
    """Does `forward` to x and `backward` to its gradient (None: nothing): a pair of ENTRY's or EXIT's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward, backward) -> torch.Tensor:
        ctx.backward = backward
        return x if forward is None else forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad if ctx.backward is None else ctx.backward(grad), None, None


ENTRY = {False: (None, all_reduce), True: (all_gather, reduce_scatter)}  # by sequence_parallel: Megatron's f,
EXIT = {False: (all_reduce, None), True: (reduce_scatter, all_gather)}  # its g, and sequence parallel's pairs


class RowParallelLinear(nn.Module):
    """This rank's columns of the weight: a partial sum of every output, summed across the ranks, then the bias."""

    def __init__(self, linear: nn.Linear, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().chunk(dist.get_world_size(), dim=1)[dist.get_rank()].clone())
        self.bias, self.exit = linear.bias, EXIT[sequence_parallel]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Conjugate.apply(F.linear(x, self.weight), *self.exit) + self.bias  # the bias once, after the sum


def column_parallel(linear: nn.Linear) -> None:
    """This rank's rows of the weight and the bias: its own slice of the outputs (heads, hidden units)."""
    for name in ("weight", "bias"):
        whole = getattr(linear, name).detach()
        setattr(linear, name, nn.Parameter(whole.chunk(dist.get_world_size())[dist.get_rank()].clone()))


def tensor_parallel(model: GPT, sequence_parallel: bool = False) -> GPT:
    """Split each block among the ranks, in place. Every rank must hold the same whole model before."""
    for block in model.blocks:
        for region, first, last in ((block.attn, ("q", "k", "v"), "o"), (block.mlp, ("fc",), "proj")):
            for name in first:
                column_parallel(getattr(region, name))
            setattr(region, last, RowParallelLinear(getattr(region, last), sequence_parallel))
            region.register_forward_pre_hook(lambda region, args: Conjugate.apply(args[0], *ENTRY[sequence_parallel]))
        whole_on_slices = [*block.ln_1.parameters(), *block.ln_2.parameters(), block.attn.o.bias, block.mlp.proj.bias]
        for p in whole_on_slices if sequence_parallel else []:  # used on this rank's slice: a part of the gradient
            p.register_hook(all_reduce)  # this backward's part summed over the ranks, before .grad adds it up
    if sequence_parallel:  # the blocks see one slice of the sequence; the output layer all of it
        model.blocks[0].register_forward_pre_hook(lambda block, args: Conjugate.apply(args[0], split, all_gather))
        model.blocks[-1].register_forward_hook(lambda block, args, out: Conjugate.apply(out, all_gather, split))
    return model


def torch_tensor_parallel(model: GPT, sequence_parallel: bool = False) -> GPT:
    """The same split with torch's parallelize_module: DTensor parameters, and the collectives it inserts."""
    mesh, out = init_device_mesh("cpu", (dist.get_world_size(),)), Shard(1) if sequence_parallel else Replicate()
    plan = {"attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(), "attn.v": tp.ColwiseParallel(),
            "attn.o": tp.RowwiseParallel(output_layouts=out),  # SP: reduce-scattered along the sequence (dim 1)
            "mlp.fc": tp.ColwiseParallel(), "mlp.proj": tp.RowwiseParallel(output_layouts=out)}
    if sequence_parallel:  # the region's input all-gathered, kept a DTensor: q, k, v's input gradients add up first
        whole = tp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
        plan |= {"ln_1": tp.SequenceParallel(), "attn": whole, "ln_2": tp.SequenceParallel(), "mlp": whole}
    for block in model.blocks:
        tp.parallelize_module(block, mesh, plan)
    if sequence_parallel:  # the blocks take this rank's slice of the sequence; the output layer all of it
        for name, (before, after) in {"blocks.0": (Replicate(), Shard(1)), "ln_f": (Shard(1), Replicate())}.items():
            tp.parallelize_module(model, mesh, {name: tp.PrepareModuleInput(
                input_layouts=before, desired_input_layouts=after, use_local_output=True)})
    return model


def loss_of(model: GPT, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens[:, :-1])  # next-token cross-entropy, and the logits
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()), logits


def collectives(comm: CommDebugMode) -> dict[str, int]:  # c10d's ops (by hand), functional ones (DTensor's)
    named = [(next(name for key, name in KINDS if key in str(op)), n) for op, n in comm.get_comm_counts().items()]
    return {name: sum(n for other, n in named if other == name) for name in sorted({name for name, _ in named})}


def check_step(layout: str, model: GPT, reference: GPT, tokens: torch.Tensor, rank: int, world_size: int) -> tuple:
    """One step: print and return the largest difference from one process's (done), and the collectives."""
    with CommDebugMode() as forward:
        loss, logits = loss_of(model, tokens)
    with CommDebugMode() as backward, warnings.catch_warnings(action="ignore", category=UserWarning):
        loss.backward()  # the mode's module tracker hooks the model, and warns that the tokens need no gradient
    with torch.no_grad():
        error, whole = (logits - reference(tokens[:, :-1])).abs().max(), dict(reference.named_parameters())
    for name, p in model.named_parameters():  # torch's gradients can stay partial sums until used: sum them now
        grad = p.grad.redistribute(placements=p.placements).to_local() if isinstance(p, DTensor) else p.grad
        ref, split_dims = whole[name].grad, [d for d in range(p.dim()) if whole[name].shape[d] != grad.shape[d]]
        ref = ref.chunk(world_size, split_dims[0])[rank] if split_dims else ref  # the part this rank holds
        error = torch.maximum(error, (grad - ref).abs().max())  # a NaN stays
    counts = {"forward": collectives(forward), "backward": collectives(backward)}
    held = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())
    print(f"[rank {rank}/{world_size}] {layout}: {error:.1e} from one process | {counts} | {held:,} bytes of "
          "parameters\n", end="", flush=True)
    return error.item(), counts


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequence_parallel", action="store_true", help="norms and residuals on a sequence slice")
    parser.add_argument("--n_layer", type=int, default=2, help="blocks")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads: a multiple of the ranks")
    parser.add_argument("--n_embd", type=int, default=64, help="width: a multiple of n_head")
    parser.add_argument("--seq_len", type=int, default=32, help="tokens a sequence (SP: a multiple of the ranks)")
    parser.add_argument("--batch_size", type=int, default=4, help="sequences per step, the same on every rank")
    args = parser.parse_args()
    for name in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size"):
        if not 0 < getattr(args, name) < 1e5:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e5, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        parser.error(f"--n_head {args.n_head} must divide --n_embd {args.n_embd}")
    return args


def check(args: argparse.Namespace, rank: int, world_size: int) -> None:
    reference = GPT(GPTConfig(VOCAB_SIZE, args.seq_len, args.n_layer, args.n_head, args.n_embd))
    reference.init_weights(seed=0)  # the same weights and batch on every rank, from seeds: no broadcast needed
    models = {name: parallelize(copy.deepcopy(reference), args.sequence_parallel) for name, parallelize in
              (("by hand", tensor_parallel), ("parallelize_module", torch_tensor_parallel))}
    tokens = torch.randint(VOCAB_SIZE, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loss_of(reference, tokens)[0].backward()
    errors = [check_step(name, model, reference, tokens, rank, world_size)[0] for name, model in models.items()]
    if any(not error <= TOLERANCE for error in errors):  # not >: a NaN passes no comparison
        raise SystemExit(f"error: rank {rank} differs from one process by {errors} (tolerance {TOLERANCE:.0e})")


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 tensor_parallel.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.n_head % world_size or args.sequence_parallel and args.seq_len % world_size:
        raise SystemExit(f"error: {world_size} ranks must divide --n_head {args.n_head}"
                         + (f" and --seq_len {args.seq_len}" if args.sequence_parallel else ""))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises (gloo's threads outlive it all the same: see os._exit below)
        check(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown: DTensor's caches keep the mesh, and gloo's threads can abort it
