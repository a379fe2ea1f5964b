"""FSDP2: each rank holds a shard of every layer's parameters, gradients and Adam state (ZeRO stage 3).

Where DDP keeps a whole replica on every rank, fully_shard cuts every parameter into world_size
pieces along its first dimension; rank r keeps piece r, its gradient and its Adam moments. The loop is
singlenode_cpu.py's, on model.py's wide MLP by default; each rank prints the bytes it holds after its
first step. The checkpoint is a folder, where torch.distributed.checkpoint (DCP) has every rank write
its own shards.

    torchrun --standalone --nproc-per-node 2 fsdp2.py
    torchrun --standalone --nproc-per-node 3 fsdp2.py --max_epochs 1 --checkpoint ckpt
    torchrun --standalone --nproc-per-node 2 fsdp2.py --checkpoint ckpt --export wide.pt
    torchrun --standalone --nproc-per-node 8 fsdp2.py --backend nccl --precision bf16

The third resumes on 2 ranks what 3 wrote (DCP reshards as it reads), and saves the whole model in
wide.pt, which model.build_model("wide") loads without FSDP.
Explained in docs/sharding.md.
"""
import argparse
import itertools
import math
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

import common
from data import FEATURES, LOSS_FLOOR
from model import build_model
from singlenode_cpu import epoch_means, evaluate, make_loaders, train_one_epoch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_training_args(parser, checkpoint=False)
    # The wide model at bench_ddp.py's learning rate, as zero_optimizer.py (the small model's 0.005 overshoots).
    parser.set_defaults(model="wide", lr=1e-3, max_epochs=3, train_size=1024)  # seconds on 2 CPU cores
    parser.add_argument("--checkpoint", type=common.checkpoint_folder, default=None, metavar="DIR",
                        help="a FOLDER, replaced whole by every save: after every epoch each rank writes its "
                             "shards into it; if it holds a checkpoint at start, training resumes from it, on any "
                             "number of ranks")
    parser.add_argument("--export", default=None, metavar="PATH",
                        help="at the end rank 0 saves the whole model's state_dict here, for use without FSDP")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="gloo: CPUs; nccl: a GPU each")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: layers gathered and computed in bf16, gradients averaged in fp32")
    common.reject_old_launcher_flag(parser)
    args = parser.parse_args()
    if args.export and args.checkpoint and os.path.commonpath(
            [os.path.realpath(args.export), os.path.realpath(args.checkpoint)]) == os.path.realpath(args.checkpoint):
        parser.error(f"--export {args.export!r} is inside --checkpoint {args.checkpoint!r}, which every save replaces")
    if args.export and (os.path.isdir(args.export) or not os.access(os.path.dirname(os.path.abspath(args.export)),
                                                                     os.W_OK)):  # now, not after the training
        parser.error(f"--export {args.export!r} must name a file in a writable folder")
    return args


def shard(model: nn.Module, mesh, precision: str) -> None:
    """fully_shard every layer, then the whole model."""
    # param_dtype: what a gathered layer computes in; reduce_dtype: what its gradient is averaged in.
    # The shards, which Adam updates, stay fp32: they are the master weights, no extra copy needed.
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" else {}
    policy = MixedPrecisionPolicy(**bf16)
    for layer in [m for m in model.modules() if isinstance(m, nn.Linear) and m is not model]:
        # One group per layer: its pieces are all-gathered in one collective just before its
        # forward and freed after it (reshard_after_forward), gathered again in backward, and its
        # gradient reduce-scattered once computed. One layer is whole at a time (two in backward,
        # which gathers the next early so that the gathering overlaps the computing).
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root, whose forward runs first: it takes what no layer took (here nothing), sets the
    # layers up to share its streams and buffers, and waits for their last reduce-scatters at the
    # end of backward. Without it every layer would be a root of its own, and a root keeps its
    # gathered weights from forward until backward: every layer whole at once, as under DDP.
    fully_shard(model, mesh=mesh, mp_policy=policy)


def local_bytes(tensors) -> int:
    """Bytes of `tensors` held on this rank: of a DTensor, its local shard alone."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors if t is not None)


def watch_steps(optimizer: torch.optim.Optimizer, model: nn.Module, rank: int, world_size: int,
                device: torch.device) -> list:
    """Note the time after every optimizer step, and print what this rank holds after the first."""
    ends = []  # with None where train() starts an epoch

    def after_step(optimizer, args, kwargs) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()  # the GPU's time, not the time to queue its work
        if not any(ends):  # the run's first step. Adam's exp_avg and exp_avg_sq are DTensors: their
            # shards count. Its step counts are plain 4-byte tensors, whole on every rank: they count too.
            state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
            params = list(model.parameters())
            common.print_line(f"[rank {rank}/{world_size}] bytes held: parameters {local_bytes(params):,} | "
                              f"gradients {local_bytes(p.grad for p in params):,} | "
                              f"optimizer state {local_bytes(state):,}")
        ends.append(time.perf_counter())

    optimizer.register_step_post_hook(after_step)
    return ends


def equal_forwards(loader, steps: int):
    """The loader's batches, then empty ones up to `steps`. Every forward all-gathers each layer
    with every rank, so every rank must run the same number, also when its validation shard
    (singlenode_cpu.make_loaders: counted once, unpadded) holds a batch fewer than rank 0's."""
    yield from loader
    for _ in range(steps - len(loader)):
        yield torch.empty(0, FEATURES), torch.empty(0, 1)


def resume(args: argparse.Namespace, rank: int, world_size: int, model: nn.Module, optimizer: torch.optim.Optimizer,
           checkpoints: common.ShardedCheckpoints, config: dict) -> int:
    """Load the checkpoint, if there is one, on every rank; return the next epoch to run."""
    if rank == 0:
        checkpoints.tidy()  # the lock; puts back a checkpoint that a save cut short had moved aside
    dist.barrier()  # so no rank looks at the folder before rank 0 has tidied it
    found_by_rank = [None] * world_size
    # Every rank checks the sha256 of its share of the files before DCP reads any (DCP checks none),
    # then they compare: a damaged or missing file stops every rank with one line, before training.
    dist.all_gather_object(found_by_rank, checkpoints.check(config))
    manifest = checkpoints.require_agreement(found_by_rank)
    if manifest is None:
        return 0
    # This run's shards, DTensors keyed by parameter name: DCP reads into them, each rank the parts of
    # every file that overlap its shards, however many ranks wrote them.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=checkpoints.target)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    epoch, written_by = manifest["epoch"], manifest["world_size"]
    if rank == 0 and epoch < args.max_epochs:  # else train() says there is nothing to do
        common.print_line(f"resuming from {args.checkpoint}: {epoch} of {args.max_epochs} epochs done" + (
            "" if written_by == world_size else f", written by {written_by} ranks, read by {world_size} (DCP "
            f"reshards; the global batch changes from {written_by * args.batch_size} to "
            f"{world_size * args.batch_size} samples)"))
    return epoch


def save(checkpoints: common.ShardedCheckpoints, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int,
         config: dict, rank: int, world_size: int) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards, keyed by name
    # Every rank writes its own shards, to a file of its own (__<rank>_0.distcp); the coordinator,
    # rank 0, then writes .metadata: which piece of which tensor lies where, in which file.
    metadata = dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=checkpoints.tmp)
    # No barrier needed: dcp.save returns only once rank 0 has written .metadata, which it does
    # after every rank's writes returned. Rank 0 needs every file's sha256 for the manifest.
    shares = [None] * world_size
    dist.all_gather_object(shares, checkpoints.hash_share(metadata))
    if rank == 0:
        checkpoints.commit(shares, epoch, config)  # the manifest, then PATH.tmp renamed to PATH


def train(args: argparse.Namespace, rank: int, local_rank: int, world_size: int, device: torch.device):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    torch.manual_seed(args.seed)  # the same whole weights on every rank: each keeps its own piece
    model = build_model(args.model).to(device)
    shard(model, init_device_mesh(device.type, (world_size,)), args.precision)  # one mesh dimension: all ranks
    # After fully_shard, which replaced every parameter by a DTensor of this rank's piece: an optimizer
    # built before would hold the whole tensors, which no longer train (and whole-sized state for them).
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    config = {name: vars(args).get(name) for name in common.RESUME_MUST_MATCH}  # the world size may change
    checkpoints = common.ShardedCheckpoints(args.checkpoint, rank, world_size) if args.checkpoint else None
    try:
        start_epoch = resume(args, rank, world_size, model, optimizer, checkpoints, config) if checkpoints else 0
        ends = watch_steps(optimizer, model, rank, world_size, device)  # after resume: its load takes a step
        val_steps = math.ceil(math.ceil(args.val_size / world_size) / args.batch_size)  # rank 0's, the most
        for epoch in range(start_epoch, args.max_epochs):
            train_loader.sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            ends.append(None)  # the epoch's first step also waited for the last one's validation and save
            loss_sum, samples, _ = train_one_epoch(model, train_loader, optimizer, device, torch.float32, None)
            val_totals = evaluate(model, equal_forwards(val_loader, val_steps), device)
            train_loss, val_loss = epoch_means((loss_sum, samples), val_totals, device)
            if not math.isfinite(train_loss + val_loss):  # the same on every rank: all stop, before saving
                common.die(f"the loss stopped being finite in epoch {epoch}: stopped before saving", code=1)
            if checkpoints:
                save(checkpoints, model, optimizer, epoch + 1, config, rank, world_size)  # the next epoch to run
            if rank == 0:
                common.print_line(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}")
    finally:
        if checkpoints:
            checkpoints.close()
    if args.export:
        # A collective: every rank all-gathers every layer, and only rank 0 keeps the whole tensors,
        # on the CPU (cpu_offload). Called on rank 0 alone, it would wait for ever for the others.
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            try:
                common.save_checkpoint(whole, args.export)  # a temporary file, fsync, rename
            except OSError as exc:  # a full disk, the folder gone: the checkpoint, if any, is whole
                common.die(f"could not export the model to {args.export}: {exc.strerror or exc}", code=1)
            print(f"saved the whole model to {args.export}", flush=True)
    if rank == 0 and start_epoch >= args.max_epochs:
        print(f"{args.checkpoint} already holds {start_epoch} epochs: nothing to train. Raise --max_epochs or "
              "delete the folder.", flush=True)
    elif rank == 0:
        steps = [end - start for start, end in itertools.pairwise(ends) if start and end]  # not an epoch's first
        # From one step's end to the next: the batch's loading too, which is nothing here (zero_optimizer.py
        # times from zero_grad() to step()).
        common.print_line(f"step time: {1000 * statistics.median(steps or [math.nan]):.2f} ms (median of "
                          f"{len(steps)} steps, rank 0)\ndone | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} "
                          f"({val_loss / LOSS_FLOOR:.3f} × floor)")
    return model


def main() -> None:
    args = parse_args()
    rank, local_rank, world_size = common.torchrun_ranks("fsdp2.py", args)  # as singlenode_cpu.py
    device = torch.device("cpu")
    if args.backend == "nccl":
        common.check_gpus(int(os.environ["LOCAL_WORLD_SIZE"]), "--nproc-per-node", "fsdp2.py --backend gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group: otherwise every process allocates on GPU 0
    timeout = timedelta(seconds=args.timeout)
    dist.init_process_group(args.backend, store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout, device_id=device if device.type == "cuda" else None)
    try:
        train(args, rank, local_rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
