"""ZeRO by configuration: DeepSpeed's engine trains singlenode_cpu.py's model, stages 0 to 3, offloaded or not.

`diff singlenode_cpu.py deepspeed_zero.py` is the lesson (docs/deepspeed.md): deepspeed.initialize wraps the model
in an engine in DDP's place, and config() says what each rank shards. Needs pip install -r requirements-deepspeed.txt.

    torchrun --standalone --nproc-per-node 3 deepspeed_zero.py --stage 3 --checkpoint ds_ckpt  # again: it resumes
    deepspeed --num_gpus 2 --no_local_rank deepspeed_zero.py --stage 2 --offload  # DeepSpeed's own launcher
"""
import argparse
import os
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read at deepspeed's import: gloo on CPUs, as singlenode_cpu.py

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import LOSS_FLOOR, make_datasets
from model import MODELS, build_model

try:
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
except ImportError:
    deepspeed = None  # main() says how to install it


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffle")
    parser.add_argument("--train_size", type=int, default=4096, help="training samples")
    parser.add_argument("--val_size", type=int, default=1024, help="validation samples")
    parser.add_argument("--checkpoint", default=None, help="a folder: saved every epoch; resumed from if it exists")
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage: what is sharded")
    parser.add_argument("--offload", action="store_true", help="the optimizer's partition and step on the CPU")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS), help="model.py's; wide: 2.1M weights")
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size"):
        if not 0 < getattr(args, name) < 1e7:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e7, got {getattr(args, name)}")
    if args.offload and args.stage == 0:  # DeepSpeed would ignore it
        parser.error("--offload moves ZeRO's optimizer partition: it needs --stage 1, 2 or 3")
    return args


def config(args: argparse.Namespace) -> dict:
    """The whole DeepSpeed configuration (docs/deepspeed.md, key by key)."""
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,  # per rank: a global batch of it × ranks, as DDP's
        "gradient_clipping": 0,  # left out, DeepSpeed clips the gradients' norm at 1.0; singlenode_cpu.py does not
        "zero_optimization": {
            "stage": args.stage,  # 1: Adam's state sharded; 2: the gradients too; 3: the parameters too
            "stage3_param_persistence_threshold": 0,  # else a tensor under 100k elements stays whole on every rank
            "offload_optimizer": {"device": "cpu" if args.offload else "none"},  # ZeRO-Offload: state and step on CPU
        },
        "zero_force_ds_cpu_optimizer": False,  # offload with torch's Adam: DeepSpeedCPUAdam is a C++ op to compile
    }


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    # Rank r takes samples r, r + N, r + 2N, ... of a permutation of seed + epoch, repeating a few if N does
    # not divide the size: a rank with an extra step would wait for ever in that step's all-reduce.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # A strided shard, no repeats, in one batch: under stage 3 each forward all-gathers, so every rank runs one.
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=len(val_set))
    return train_loader, val_loader


def bytes_held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """Bytes of this rank's parameters (stage 3: its partition ds_tensor, and any tensor kept whole, ds_persist),
    gradients and optimizer state: what Adam steps on (from stage 1 an fp32 partition), its moments and step."""
    params, masters = list(model.parameters()), [p for group in optimizer.param_groups for p in group["params"]]
    grads = {id(p.grad): p.grad for p in params + masters if p.grad is not None}  # stage 0: the model's own
    state = [p for p in masters if all(p is not q for q in params)]
    state += [t for entry in optimizer.state.values() for t in entry.values()]
    sizes = [sum(p.ds_tensor.nbytes + p.ds_persist * 4 * p.ds_numel if hasattr(p, "ds_tensor") else p.nbytes
                 for p in params), *(sum(t.nbytes for t in ts) for ts in (grads.values(), state))]
    return "parameters {:,} | gradients {:,} | optimizer state {:,}".format(*sizes)


def train_one_epoch(engine, loader: DataLoader):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    engine.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)  # averages the gradients: all-reduced (stages 0 to 2) or reduce-scattered (3)
        engine.step()  # steps this rank's partition, all-gathers the updated weights (1, 2), zeroes the gradients
        loss_sum += loss.detach() * len(y)  # stays a tensor: no sync per step
    return loss_sum, len(loader.sampler)


@torch.no_grad()
def evaluate(engine, loader: DataLoader):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    engine.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        loss_sum += F.mse_loss(engine(x), y, reduction="sum")
    return loss_sum, len(loader.dataset)


def epoch_means(train_totals: tuple, val_totals: tuple) -> tuple[float, float]:
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` the others never join."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace, rank: int, world_size: int):
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (initialize also broadcasts rank 0's)
    model = build_model(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    held = []  # read inside DeepSpeed's first step (it frees the gradients after it), printed after the first epoch
    hook = optimizer.register_step_post_hook(lambda opt, *_: held.append(bytes_held(model, opt)) or hook.remove())
    # The shared-memory all-reduce that DeepSpeed builds at start-up (a C++ compile, minutes) serves inference only.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(args))
    run = f"stage{args.stage}-{world_size}ranks-{args.model}"  # in each tag: DeepSpeed's own errors are tracebacks
    start_epoch = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        latest = Path(args.checkpoint, "latest")  # the last tag that every rank saved whole (written below)
        tag = latest.read_text().strip() if latest.is_file() else "none"
        if not tag.endswith(f"-{run}") or "/" in tag or not Path(args.checkpoint, tag).is_dir():
            raise SystemExit(f"error: {args.checkpoint} holds no checkpoint of a {run} run to resume (latest: {tag})")
        try:  # each rank reads its own partitions; DeepSpeed's torch.load is weights_only=False: your files only
            start_epoch = engine.load_checkpoint(args.checkpoint, tag)[1]["epoch"]  # the next epoch to run
        except (OSError, RuntimeError) as exc:  # a file cut short or missing: one line, not a traceback
            raise SystemExit(f"error: {args.checkpoint}/{tag} does not load: {exc}".splitlines()[0]) from None
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(engine, train_loader)
        if epoch == start_epoch:  # torch's Adam has stepped on this rank's partition
            print(f"[rank {rank}/{world_size}] stage {args.stage} bytes held: {held[0]}\n", end="", flush=True)
        val_totals = evaluate(engine, val_loader)
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if args.checkpoint:  # a collective: each rank writes its partitions, then all meet at a barrier
            tag = f"epoch{epoch + 1}-{run}"
            engine.save_checkpoint(args.checkpoint, tag, client_state={"epoch": epoch + 1}, save_latest=False)
            if rank == 0:  # DeepSpeed's own "latest" is written before the other ranks' files are: this one after
                Path(args.checkpoint, "latest.tmp").write_text(tag)
                os.replace(f"{args.checkpoint}/latest.tmp", f"{args.checkpoint}/latest")  # a kill mid-write: the old
        if rank == 0:
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and args.checkpoint:  # zero_to_fp32: the last tag's partitions, every rank's, made whole
        whole = get_fp32_state_dict_from_zero_checkpoint(args.checkpoint, tag) if args.stage else model.state_dict()
        torch.save(whole, f"{args.checkpoint}/model.pt.tmp")  # the plain model's names: a plain model loads it
        os.replace(f"{args.checkpoint}/model.pt.tmp", f"{args.checkpoint}/model.pt")  # a kill mid-write: none half
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    return engine


def main() -> None:
    args = parse_args()
    if deepspeed is None:
        raise SystemExit("error: DeepSpeed is not installed: pip install -r requirements-deepspeed.txt")
    if "RANK" not in os.environ:  # torchrun and deepspeed set these in every process (torchrun: OMP_NUM_THREADS=1 too)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 deepspeed_zero.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > min(args.train_size, args.val_size):  # each rank needs a training and a validation sample
        raise SystemExit(f"error: {world_size} ranks: --train_size and --val_size must be at least that")
    warnings.filterwarnings("ignore", "`torch.distributed.", FutureWarning)  # DeepSpeed calls collectives' old names
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://; deepspeed.initialize finds the group
    try:  # destroy also when training raises: gloo's threads end with the group
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
