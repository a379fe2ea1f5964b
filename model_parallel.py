"""DDP over a model split across two devices: model parallelism inside each process, data parallelism across them.

When one replica does not fit on one GPU, each process can hold its model across two: the first
half of the layers on one device, the rest on another, the activations copied from one to the
other in forward (and their gradients back in backward). DDP wraps such a module as it wraps any
other, with one difference: device_ids and output_device stay None, as the module itself decides
where its inputs and outputs live. On GPUs, the process of local rank r uses GPUs 2r and 2r+1.

    torchrun --standalone --nproc-per-node 2 model_parallel.py
    torchrun --standalone --nproc-per-node 4 model_parallel.py --device cuda    # 8 GPUs

On CPUs both halves sit on the CPU: that run shows the API only, not two devices at work. The
data, the validation and the exact epoch means are singlenode_cpu.py's, and so are the final
weights, bit for bit once DDP lays out its bucket alike (tests/test_model_parallel.py says how).
Explained in docs/past_the_basics.md.
"""
import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import common
from data import LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: each process holds its model on two GPUs (nccl); cpu: both halves on the CPU")
    common.reject_old_launcher_flag(parser)
    args = parser.parse_args()
    if args.model == "linear":
        parser.error("--model linear is a single layer: there is nothing to split over two devices")
    return args


class TwoStages(nn.Module):
    """model.py's network cut in two: the first half of its layers on `first`, the rest on `second`."""

    def __init__(self, net: nn.Sequential, first: torch.device, second: torch.device) -> None:
        super().__init__()
        cut = (len(net) + 1) // 2  # mlp: Linear, Tanh | Linear
        self.first, self.second = first, second
        self.stage0 = net[:cut].to(first)
        self.stage1 = net[cut:].to(second)

    def forward(self, x):
        hidden = self.stage0(x.to(self.first))
        # The activations cross to the second device; backward sends their gradient the other way.
        return self.stage1(hidden.to(self.second))  # (batch, 1), on the second device


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer,
                    devices: tuple[torch.device, torch.device]):
    """Train on this rank's shard; return (sum of loss × samples, samples) for this rank."""
    first, second = devices
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=second)
    samples = 0
    for x, y in loader:
        # The input goes where the first stage is, the target where the output comes out.
        x, y = x.to(first), y.to(second)
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        # DDP's buckets each hold one device's gradients; every bucket is all-reduced (averaged)
        # with the same bucket of the other ranks, on its own device.
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(y)
        samples += len(y)
    return loss_sum, samples


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int,
          devices: tuple[torch.device, torch.device]):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same initial weights on every rank, and those of singlenode_cpu.py
    model = TwoStages(build_model(args.model).net, *devices)
    common.print_line(f"[rank {rank}/{world_size}] stage 0 on {devices[0]}, stage 1 on {devices[1]}")
    if rank == 0 and devices[0] == devices[1]:
        print("both stages are on the CPU: this run shows the API only; with --device cuda they span two GPUs",
              flush=True)
    # No device_ids and no output_device: DDP raises a ValueError if a module on two devices gets
    # them, and the module's own forward puts its input and output where they belong.
    model = DDP(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        loss_sum, samples = train_one_epoch(model, train_loader, optimizer, devices)
        # Evaluate the plain module: a forward through the wrapper may wait for the other ranks.
        # evaluate() copies each batch to the second device, where output and target meet.
        val_totals = evaluate(model.module, val_loader, devices[1])
        train_loss, val_loss = epoch_means((loss_sum, samples), val_totals, devices[1])
        if rank == 0:
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)
    if rank == 0:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)",
              flush=True)
    return model.module


def check_two_gpus_per_process(procs_on_node: int) -> None:
    """One line, before nccl would fail obscurely: no CUDA, or fewer than two GPUs per process."""
    common.check_gpus(procs_on_node, "--nproc-per-node", "model_parallel.py --device cpu")  # CUDA at all?
    gpus = torch.cuda.device_count()
    if gpus < 2 * procs_on_node:
        if int(os.environ.get("LOCAL_RANK", 0)) != 0:
            sys.exit(2)  # the same line from every process says nothing more
        fix = f"use --nproc-per-node {gpus // 2} or fewer" if gpus >= 2 else "run with --device cpu to see the API"
        need = "1 process on this node needs" if procs_on_node == 1 else f"{procs_on_node} processes on this node need"
        common.die(f"each process holds its model on 2 GPUs: {need} {2 * procs_on_node} GPUs and it has {gpus}; "
                   f"{fix}")


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("model_parallel.py", args)  # as singlenode_cpu.py
    if args.device == "cuda":
        check_two_gpus_per_process(int(os.environ["LOCAL_WORLD_SIZE"]))
        # Local rank r takes GPUs 2r and 2r+1, so no two processes on a node share a GPU.
        devices = (torch.device("cuda", 2 * local_rank), torch.device("cuda", 2 * local_rank + 1))
        torch.cuda.set_device(devices[0])  # before anything touches a GPU: else every process would use GPU 0
    else:
        devices = (torch.device("cpu"), torch.device("cpu"))
    timeout = timedelta(seconds=args.timeout)
    # No device_id: it names "a single, specific device this process will work on", and this one has two.
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=common.torchrun_store(timeout),
                            rank=rank, world_size=world_size, timeout=timeout)
    try:
        train(args, rank, local_rank, world_size, devices)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
