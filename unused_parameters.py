"""Parameters that some steps leave unused: DDP's error, and its two fixes with what each costs.

DDP all-reduces the gradients bucket by bucket during backward, each bucket once every parameter in
it has its gradient. A parameter that this step's forward did not use gets no gradient, so its
bucket is never reduced: backward returns with gradients that were never averaged, the optimizer
steps with them (the replicas drift apart), and DDP raises only at the next forward.

The model is model.py's plus a branch, a linear path from the input to the output, that training
uses on every K-th step only (--branch_every K; 0: on no step): an auxiliary head trained now and
then, a layer dropped on some steps, task heads trained in turn. The step count decides, so every
rank takes or skips the branch at the same step. (A branch chosen by each rank's data can be taken
on one rank and skipped on another: find_unused_parameters handles that too.)

    torchrun --standalone --nproc-per-node 2 unused_parameters.py --fix none
    torchrun --standalone --nproc-per-node 2 unused_parameters.py
    torchrun --standalone --nproc-per-node 2 unused_parameters.py --fix static_graph
    torchrun --standalone --nproc-per-node 2 unused_parameters.py --fix static_graph --branch_every 0

find_unused_parameters=True (the default here): after every forward DDP walks the autograd graph
from the outputs and marks the parameters it does not reach as ready, and every backward all-reduces
a map of which parameters each rank used: one all-reduce more per step. static_graph=True: DDP
learns the unused set in the first step and takes it as fixed from then on, with no search and no
extra all-reduce; a set that changes from step to step (--branch_every 2) is an error.
Explained in docs/past_the_basics.md.
"""
import argparse
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import common
from data import FEATURES, LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    parser.add_argument("--fix", choices=["none", "find_unused", "static_graph"], default="find_unused",
                        help="none: plain DDP; find_unused: DDP(find_unused_parameters=True); "
                             "static_graph: DDP(static_graph=True)")
    parser.add_argument("--branch_every", type=common.number_in(0, 10**6, int), default=2,
                        help="the branch joins the forward on every K-th step (0: on none)")
    common.reject_old_launcher_flag(parser)
    return parser.parse_args()


class WithBranch(nn.Module):
    """model.py's model, plus a linear branch from the input added to its output when asked."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.branch = nn.Linear(FEATURES, 1)
        nn.init.zeros_(self.branch.weight)  # adds nothing until trained: evaluation may always use it
        nn.init.zeros_(self.branch.bias)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        out = self.body(x)  # (batch, 1)
        return out + self.branch(x) if use_branch else out


def uses_branch(step: int, every: int) -> bool:
    """The step count alone decides, so every rank takes the branch at the same steps."""
    return every > 0 and (step + 1) % every == 0


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, device: torch.device,
                    first_step: int, branch_every: int):
    """Train on this rank's shard; return (sum of loss × samples, samples, steps)."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    samples = steps = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        # set_to_none: a parameter that no rank used keeps .grad None (DDP leaves it untouched), so
        # Adam skips it, as in one process; zeroed grads would let Adam's momentum move it.
        optimizer.zero_grad(set_to_none=True)
        try:
            loss = F.mse_loss(model(x, use_branch=uses_branch(first_step + steps, branch_every)), y)
            loss.backward()  # all-reduces each bucket once all its parameters have their gradients
        except RuntimeError as error:  # raised on every rank at the same step: they share the schedule
            if not re.search("finished reduction|graph has changed", str(error)):
                raise  # not about unused parameters
            common.die(explain(error, model, first_step + steps), code=1)
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        samples += len(y)
        steps += 1
    return loss_sum, samples, steps


def explain(error: RuntimeError, model: DDP, step: int) -> str:
    """DDP's message runs to a page: its first sentence, the parameters it names, and what to do."""
    text = str(error)
    line = f"DDP stopped step {step}: {text.split('. ')[0]}."
    found = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)", text)
    if found:  # DDP numbers the parameters as module.parameters() lists them
        names = [name for name, _ in model.module.named_parameters()]
        indices = found.group(1).split()
        line += (f" Step {step - 1} gave no gradient to parameters {' '.join(indices)} "
                 f"({', '.join(names[int(i)] for i in indices)}), so their bucket was never all-reduced and "
                 "the optimizer stepped with gradients that were not averaged.")
    if "static_graph" in text:
        return line + " static_graph=True needs the same parameters unused at every step: use --fix find_unused"
    return line + " Use --fix find_unused (or --fix static_graph where the same parameters go unused at every step)"


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    find_unused, static_graph = args.fix == "find_unused", args.fix == "static_graph"
    model = DDP(WithBranch(build_model(args.model)).to(device), find_unused_parameters=find_unused,
                static_graph=static_graph)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if rank == 0:
        every = f"1 step in {args.branch_every}" if args.branch_every else "no step"
        print(f"--fix {args.fix}: DDP(model, find_unused_parameters={find_unused}, static_graph={static_graph}) | "
              f"the branch joins the forward on {every}", flush=True)

    step = 0
    for epoch in range(args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        start = time.perf_counter()
        loss_sum, samples, steps = train_one_epoch(model, train_loader, optimizer, device, step, args.branch_every)
        ms_per_step = (time.perf_counter() - start) * 1000 / steps
        step += steps
        # Evaluate the plain module (with the branch): a forward through the wrapper may wait for the others.
        train_loss, val_loss = epoch_means((loss_sum, samples), evaluate(model.module, val_loader, device), device)
        if rank == 0:
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f} | "
                  f"{ms_per_step:.2f} ms/step on rank 0", flush=True)
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
              flush=True)
    return model.module


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("unused_parameters.py", args)  # as singlenode_cpu.py
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
