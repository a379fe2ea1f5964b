"""Two dimensions at once: tensor parallel along the rows of a device mesh, FSDP2 down its columns.

docs/mesh_2d.md. Four ranks make a 2 × 2 mesh: ranks in one row ("tp") split each block's matrices among
themselves (parallelize_module, as tensor_parallel.py does), ranks in one column ("dp") see different data and
shard what they hold again (fully_shard), so each weight is a DTensor cut both ways. Each rank prints its place
on the mesh and the bytes it holds; rank 0 the loss, and at the end how far the weights are from one process's.

    torchrun --standalone --nproc-per-node 4 mesh_2d.py
    torchrun --standalone --nproc-per-node 4 mesh_2d.py --tp 4
"""
import argparse
import copy
import logging
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later, it holds the group at exit
import torch.distributed.tensor.parallel as tp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from gpt.model import GPT, GPTConfig

TOLERANCE = 1e-4  # after AdamW steps: see docs/mesh_2d.md
VOCAB_SIZE = 96  # token ids drawn at random below it


def parallelize(model: GPT, mesh: DeviceMesh) -> GPT:
    """Tensor parallel on mesh["tp"] first, then FSDP2 on mesh["dp"]: each block its own FSDP group."""
    plan = {"attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(), "attn.v": tp.ColwiseParallel(),
            "attn.o": tp.RowwiseParallel(), "mlp.fc": tp.ColwiseParallel(), "mlp.proj": tp.RowwiseParallel()}
    for block in model.blocks:
        tp.parallelize_module(block, mesh["tp"], plan)  # these weights: DTensors sharded along the row
        fully_shard(block, mesh=mesh["dp"])  # every weight of the block sharded again, down the column
    fully_shard(model, mesh=mesh["dp"])  # the rest (embeddings, tied output layer, final norm): dp only
    return model


def loss_of(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks per row: tensor parallel degree")
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per step, over all data-parallel ranks")
    parser.add_argument("--n_layer", type=int, default=2, help="blocks")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads: a multiple of --tp")
    parser.add_argument("--n_embd", type=int, default=64, help="width: a multiple of --n_head")
    parser.add_argument("--seq_len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    args = parser.parse_args()
    for name in ("tp", "steps", "batch_size", "n_layer", "n_head", "n_embd", "seq_len", "lr"):
        if not 0 < getattr(args, name) < 1e5:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e5, got {getattr(args, name)}")
    if args.n_embd % args.n_head or args.steps > 10:
        parser.error(f"--n_head {args.n_head} must divide --n_embd {args.n_embd}" if args.steps <= 10 else
                     f"--steps {args.steps}: at most 10 (the check's {TOLERANCE:.0e} is for 10 AdamW steps)")
    return args


def train(args: argparse.Namespace, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Train on the mesh, and one process beside it on the whole batch; return the whole weights."""
    mesh = init_device_mesh("cpu", (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    reference = GPT(GPTConfig(VOCAB_SIZE, args.seq_len, args.n_layer, args.n_head, args.n_embd))
    reference.init_weights(seed=0)  # the same weights on every rank, drawn from the seed: no broadcast needed
    model = parallelize(copy.deepcopy(reference), mesh)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (model, reference)]
    tokens = torch.randint(VOCAB_SIZE, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(0))  # the whole batch, the same on every rank
    for step in range(args.steps):
        loss = loss_of(model, tokens.chunk(dp_size)[dp_rank])  # a row's ranks share its part of the batch
        loss.backward()  # FSDP2 reduce-scatters the gradients down the column, averaged over the rows' batches
        reference_loss = loss_of(reference, tokens)
        reference_loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)  # every rank: the mean of the rows' losses
        if rank == 0:
            print(f"step {step} | loss {loss.item():.6f} (one process: {reference_loss.item():.6f})", flush=True)
    held = {what: sum(t.to_local().nbytes for t in tensors) for what, tensors in (
        ("parameters", list(model.parameters())),
        ("optimizer state", [t for s in optimizers[0].state.values() for t in s.values() if t.dim()]))}
    print(f"[rank {rank}/{world_size}] mesh (dp {dp_rank}, tp {mesh['tp'].get_local_rank()}) | "
          + " | ".join(f"{k} {v:,} bytes" for k, v in held.items()) + "\n", end="", flush=True)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # "2 sequential all_gather"
    weights = {name: p.full_tensor() for name, p in model.named_parameters()}  # a collective: every rank
    error = torch.stack([(weights[name] - p).abs().max() for name, p in reference.named_parameters()]).max().item()
    if rank == 0:
        print(f"weights {error:.1e} from one process's (tolerance {TOLERANCE:.0e})", flush=True)
    if not error <= TOLERANCE:  # not >: a NaN passes no comparison
        raise SystemExit(f"error: rank {rank}'s weights differ from one process's by {error:.1e}")
    return weights


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 4 mesh_2d.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size % args.tp or args.n_head % args.tp:
        raise SystemExit(f"error: --tp {args.tp} must divide the {world_size} ranks and --n_head {args.n_head}")
    if args.batch_size % (world_size // args.tp):
        raise SystemExit(f"error: the {world_size // args.tp} rows must divide --batch_size {args.batch_size}")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises (gloo's threads outlive it all the same: see os._exit below)
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # skip the interpreter's teardown: DTensor's caches keep the mesh, and gloo's threads can abort it
