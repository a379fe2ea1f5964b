"""ZeRO stage 1 under DDP: each rank keeps the optimizer state of its own share of the parameters.

DDP keeps everything on every rank: the parameters, their gradients and the optimizer's state, for
Adam in fp32 16 bytes per parameter (4 + 4 + 8 for its two moments). ZeroRedundancyOptimizer
(ZeRO stage 1) assigns each parameter to one rank; a rank keeps Adam's state for, and updates,
only its own, then sends them to the other ranks, so every replica is whole again after the step.
The parameters and gradients stay whole on every rank (fsdp2.py shards them too). Every rank
prints the bytes it holds after its first epoch; --no_zero trains with plain Adam, for comparison.

    torchrun --standalone --nproc-per-node 2 zero_optimizer.py
    torchrun --standalone --nproc-per-node 2 zero_optimizer.py --no_zero
    torchrun --standalone --nproc-per-node 3 zero_optimizer.py --max_epochs 2 --checkpoint ckpt.pt
    torchrun --standalone --nproc-per-node 3 zero_optimizer.py --max_epochs 4 --checkpoint ckpt.pt

The model is model.py's wide MLP (2,121,729 parameters). The data, the validation, the exact epoch
means and the checkpoints are singlenode_cpu.py's; the file holds the whole optimizer state, gathered
on rank 0, as plain Adam's state_dict: --no_zero resumes from it.
Explained in docs/sharding.md.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import common
from data import LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders, resume, settle_buckets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser)
    parser.add_argument("--no_zero", action="store_true",
                        help="plain torch.optim.Adam on every rank: DDP's memory, for comparison")
    # The wide model at bench_ddp.py's learning rate (the small model's 0.005 overshoots at first). A
    # checkpoint records the precision and the clipping (common.run_config): fp32 and none here.
    # 1024 samples, as fsdp2.py: seconds on 2 CPU cores.
    parser.set_defaults(model="wide", lr=1e-3, max_epochs=3, train_size=1024, precision="fp32", clip_grad_norm=None)
    common.reject_old_launcher_flag(parser)
    return parser.parse_args()


def bytes_held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Bytes of the parameters, the gradients and the optimizer state that this rank holds: under ZeRO
    the state of the Adam it made for this rank's parameters (optimizer.optim). Every tensor counts:
    Adam's two moments per parameter, and its step count (4 bytes)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    state = [value for entry in local.state.values() for value in entry.values() if torch.is_tensor(value)]
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return tuple(sum(t.numel() * t.element_size() for t in tensors) for tensors in (params, grads, state))


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                    step_seconds: list[float]):
    """Train on this rank's shard, timing each step; return (sum of loss × samples, samples)."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        # DDP all-reduces every gradient to every rank, though under ZeRO-1 a rank uses only those of
        # its own parameters: sharding the gradients as well is stage 2.
        loss.backward()
        # ZeRO: Adam on this rank's parameters alone, then a broadcast of each parameter from the
        # rank that updated it (a collective, inside step()): the time below includes it.
        optimizer.step()
        step_seconds.append(time.perf_counter() - started)
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args.model).to(device)
    if args.no_zero:
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        # Whole parameters go to ranks, the largest first, each to the rank with the fewest elements
        # so far: balanced only as far as the sizes allow. (overlap_with_ddp=True would overlap the
        # step with DDP's all-reduce, through a communication hook; not used here.)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=args.lr)
        own = {id(p) for group in optimizer.optim.param_groups for p in group["params"]}  # as in bytes_held
        names = [name for name, p in model.named_parameters() if id(p) in own]
        common.print_line(f"[rank {rank}/{world_size}] updates {', '.join(names) or 'nothing'}")

    checkpoints = common.Checkpoints(args.checkpoint, rank) if args.checkpoint else None
    try:
        # singlenode_cpu.py's resume: under ZeRO every rank passes the whole state to load_state_dict,
        # which keeps the entries of its own parameters. So each rank briefly holds all of it: a state
        # too large for one rank needs a sharded format (torch.distributed.checkpoint, as fsdp2.py).
        start_epoch = resume(args, rank, world_size, model, optimizer, checkpoints, device) if checkpoints else 0
        # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce buckets, so the
        # gradients are held once; by default DDP keeps a second copy in its buckets.
        model = DDP(model, gradient_as_bucket_view=True)
        settle_buckets(model, train_loader, device, torch.float32)  # a resumed run steps as a fresh one
        step_seconds: list[float] = []
        for epoch in range(start_epoch, args.max_epochs):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            loss_sum, samples = train_one_epoch(model, train_loader, optimizer, device, step_seconds)
            if epoch == start_epoch:  # Adam's state exists from the first step on
                params, grads, state = bytes_held(model.module, optimizer)
                common.print_line(f"[rank {rank}/{world_size}] bytes held: parameters {params:,} | "
                                  f"gradients {grads:,} | optimizer state {state:,}")
            # Evaluate the plain module: a forward through the wrapper may wait for the other ranks.
            train_loss, val_loss = epoch_means((loss_sum, samples), evaluate(model.module, val_loader, device), device)
            line = f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}"
            if checkpoints and not args.no_zero:
                # A collective: every rank calls it, outside the rank guard, and sends its share of the
                # state to rank 0 (by broadcast: the others receive it too, and drop it). Without it rank
                # 0's state_dict() raises, or returns an earlier call's, stale. Rank 0 keeps the copy.
                optimizer.consolidate_state_dict(to=0)
            if rank == 0 and checkpoints:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch + 1, "config": common.run_config(args, world_size)}
                checkpoints.save(state, line)  # written in the background; the line follows once it is on disk
            elif rank == 0:
                common.print_line(line)
    finally:
        if checkpoints:
            checkpoints.close()  # waits for the write in flight

    if rank == 0:
        if start_epoch >= args.max_epochs:
            print(f"{args.checkpoint} already holds {start_epoch} epochs: nothing to train", flush=True)
        else:
            if len(step_seconds) > 1:  # the first step allocates Adam's state: left out
                median = statistics.median(step_seconds[1:]) * 1000
                print(f"step time: {median:.2f} ms (median of {len(step_seconds) - 1} steps, rank 0)", flush=True)
            print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
                  flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("zero_optimizer.py", args)  # as singlenode_cpu.py
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group("gloo", store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        train(args, rank, local_rank, world_size, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
