"""ZeRO by hand: the optimizer state (stage 1), then the gradients (2), then the parameters (3) sharded.

A diff of ddp_by_hand.py (docs/by_hand.md): each parameter is cut into one slice per rank. Stage 1 updates this
rank's slices, then all-gathers them; 2 also reduce-scatters gradients; 3 gathers each layer for its passes only.

    torchrun --standalone --nproc-per-node 4 zero_by_hand.py --stage 3 --checkpoint ckpt.pt
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later (Adam does), it holds the group at exit
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset

from data import LOSS_FLOOR, make_datasets
from model import MODELS, build_model


def shard_of(tensor: torch.Tensor, whole: bool = False) -> torch.Tensor:
    """This rank's slice of the flattened tensor, padded with zeros to a multiple of the ranks (whole: all N)."""
    n, flat = dist.get_world_size(), tensor.detach().reshape(-1)
    flat = F.pad(flat, (0, -flat.numel() % n)) if flat.numel() % n else flat  # no copy where none is needed
    return flat if whole else flat.view(n, -1)[dist.get_rank()].clone()


def gather(shard: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Every rank's slice end to end, unpadded: the whole tensor, on every rank."""
    flat = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(flat, shard)
    return flat[:torch.Size(shape).numel()].view(shape)


def reduce_scatter(grads: list[torch.Tensor], shards: list[nn.Parameter], pending: list) -> None:
    """Start one collective that sums every rank's gradients / N in fp32 and gives this rank its slices."""
    n = dist.get_world_size()  # each padded gradient as N rows side by side: rank r receives row r of all
    flat = torch.cat([shard_of(g, whole=True).view(n, -1) for g in grads], dim=1).reshape(-1).float().div_(n)
    out = torch.empty(flat.numel() // n, device=flat.device)
    pending.append((dist.reduce_scatter_single(out, flat, async_op=True), shards, out))  # returns at once


def wait_for_slices(pending: list) -> None:
    while pending:
        work, shards, out = pending.pop(0)
        work.wait()
        for shard, grad in zip(shards, out.split([s.numel() for s in shards]), strict=True):
            shard.grad = grad if shard.grad is None else shard.grad.add_(grad)  # adds up under accumulation


def whole_state(state: dict, shapes: list[torch.Size] | None = None) -> dict:
    """An optimizer's state_dict over slices → over whole tensors (a collective); with no shapes, back."""
    whole = {i: {k: (gather(t, shapes[i]) if shapes else shard_of(t)) if t.dim() else t for k, t in s.items()}
             for i, s in state["state"].items()}  # a 0-d tensor (Adam's step) is the same on every rank
    return {"state": whole, "param_groups": state["param_groups"]}


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 over an element-wise optimizer class (SGD, Adam; not LAMB, which looks at whole tensors): each rank
    keeps the state of its slices. Build it after loading weights. reduce_scatter=True: ZeRO-2."""

    def __init__(self, params, optimizer_cls: type, reduce_scatter: bool = False, bucket_mb: float = 25,
                 **kwargs) -> None:
        super().__init__(params, kwargs)
        self.params, self.pending = [p for group in self.param_groups for p in group["params"]], []
        self.bucket_bytes, self.ready = bucket_mb * 2**20, {}  # a dict: a gradient accumulated twice goes once
        for p in self.params:
            dist.broadcast(p.detach(), src=0)  # every rank starts from rank 0's weights, as DDP does
            if reduce_scatter and p.requires_grad:
                p.register_post_accumulate_grad_hook(self.reduce_scatter)
        self.shard = {p: nn.Parameter(shard_of(p).float()) for p in self.params}  # fp32 masters of this rank's slices
        self.inner = optimizer_cls([{**g, "params": [self.shard[p] for p in g["params"]]} for g in self.param_groups])

    def reduce_scatter(self, p: nn.Parameter | None) -> None:  # stage 2; None: what is left, at the step
        self.ready |= {} if p is None else {p: None}  # every rank sees the same order: the buckets match
        if self.ready and (p is None or sum(q.grad.nbytes for q in self.ready) >= self.bucket_bytes):
            reduce_scatter([q.grad for q in self.ready], [self.shard[q] for q in self.ready], self.pending)
            for q in self.ready:
                q.grad = None  # the whole gradient is dropped: the slice is all this rank keeps
            self.ready = {}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for ours, theirs in zip(self.param_groups, self.inner.param_groups, strict=True):  # a scheduler's changes
            theirs.update({k: v for k, v in ours.items() if k != "params"})
        self.reduce_scatter(None)  # stage 2's last bucket
        wait_for_slices(self.pending)
        for p in self.params:
            if p.grad is not None:  # stage 1: the gradient is whole, averaged already, on every rank
                self.shard[p].grad = shard_of(p.grad).float()
        self.inner.step()  # this rank's slices only
        sizes = [self.shard[p].numel() for p in self.params]  # every rank's new slices, in one all-gather:
        every = gather(torch.cat([self.shard[p].detach() for p in self.params]), (dist.get_world_size(), sum(sizes)))
        for p, rows in zip(self.params, every.split(sizes, dim=1), strict=True):  # rows: rank r's slice in row r
            whole = rows.reshape(-1)[:p.numel()] if p.numel() % len(rows) else rows  # padded: a copy, unpadded
            p.view(whole.shape).copy_(whole)  # the same weights everywhere
            if p.grad is not None:
                self.shard[p].grad = None  # stage 1's copy of the slice is spent

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reduce_scatter(None)  # a step skipped: its gradients still go, every rank alike, then are dropped
        wait_for_slices(self.pending)
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)

    def state_dict(self) -> dict:  # a collective: the wrapped class's own form
        return whole_state(self.inner.state_dict(), [p.shape for p in self.params])

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(whole_state(state_dict))
        for ours, theirs in zip(self.param_groups, self.inner.param_groups, strict=True):  # the saved lr, not ours
            ours.update({k: v for k, v in theirs.items() if k != "params"})


class Gather(torch.autograd.Function):
    """Forward: the whole weight from every rank's slice. Backward: its gradient reduce-scattered to the slices."""

    @staticmethod
    def forward(ctx, shard: nn.Parameter, fsdp: "FSDP", i: int) -> torch.Tensor:
        ctx.fsdp, ctx.i = fsdp, i
        return fsdp.gather_weight(i)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:  # the slice's .grad is set by the wait
        reduce_scatter([grad], [ctx.fsdp.shards[ctx.i]], ctx.fsdp.pending)
        return None, None, None


class FSDP(nn.Module):
    """ZeRO-3: parameters() are this rank's slices; each layer's weights are gathered before its forward and its
    backward, freed after. compute_dtype: the weights' before the gather; slices, gradients, state fp32."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.module, self.dtype, self.pending, self.live = module, compute_dtype or torch.float32, [], {}
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.detach(), src=0)  # every rank starts from rank 0's weights
        params = list(module.parameters())  # a tied weight comes once
        self.shards = nn.ParameterList([nn.Parameter(shard_of(p), p.requires_grad) for p in params])
        self.shapes, index = [p.shape for p in params], {p: i for i, p in enumerate(params)}
        self.names = {name: index[p] for name, p in module.named_parameters(remove_duplicate=False)}  # tied: both
        # layer → [(attribute, index of its slice)]: a tied weight is in two layers
        self.layers = {m: [(name, index[p]) for name, p in m.named_parameters(recurse=False)] for m in module.modules()}
        for layer, weights in self.layers.items():
            for name, _ in weights:
                del layer._parameters[name]  # the whole weight lives only from its gather to its free
            layer.register_forward_pre_hook(lambda layer, args: self.gather_layer(layer))
            layer.register_forward_hook(lambda layer, args, out: self.free_layer(layer), always_call=True)

    def gather_weight(self, i: int) -> torch.Tensor:
        return gather(self.shards[i].detach().to(self.dtype), self.shapes[i])  # cast first: fewer bytes to send

    def gather_layer(self, layer: nn.Module) -> None:
        for name, i in self.layers[layer]:
            setattr(layer, name, weight := Gather.apply(self.shards[i], self, i))
            self.live[weight.untyped_storage().data_ptr()] = i  # what pack() looks for

    def free_layer(self, layer: nn.Module) -> None:
        for name, _ in self.layers[layer]:
            del self.live[getattr(layer, name).untyped_storage().data_ptr()]
            setattr(layer, name, None)  # the last reference: autograd kept a note in its place (pack)

    def pack(self, saved: torch.Tensor) -> tuple:
        """What autograd keeps for backward: a gathered weight (or a view of it) becomes a note of its slice."""
        i = self.live.get(saved.untyped_storage().data_ptr())
        return (None, saved) if i is None else (i, saved.shape, saved.stride(), saved.storage_offset())

    def unpack(self, packed: tuple) -> torch.Tensor:
        """Just before the backward that needs it: the weight gathered again, freed when that backward is done."""
        i, *view = packed
        return view[0] if i is None else self.gather_weight(i).as_strided(*view)

    def finish_gradient_synchronization(self) -> None:
        wait_for_slices(self.pending)  # each slice's mean gradient in its .grad

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """A collective: {name: whole fp32 tensor} under the wrapped model's own names (a tied weight under
        each), with its buffers: what its state_dict() would be, loadable into the model unwrapped."""
        return {name: gather(self.shards[i].detach(), self.shapes[i]) for name, i in self.names.items()} | {
            name: buffer.clone() for name, buffer in self.module.named_buffers()}

    def forward(self, *args, **kwargs):
        def cast(a):  # floating-point tensors in compute_dtype; anything else as it is
            return a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            out = self.module(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
        return out.float() if torch.is_tensor(out) else out  # the loss in fp32 (a tuple: as the module made it)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max_epochs", type=int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the shuffle")
    parser.add_argument("--train_size", type=int, default=4096, help="training samples")
    parser.add_argument("--val_size", type=int, default=1024, help="validation samples")
    parser.add_argument("--checkpoint", default=None, help="saved after every epoch; resumed from if it exists")
    parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3], help="ZeRO stage: what is sharded")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS), help="model.py's; wide: 2.1M weights")
    args = parser.parse_args()
    for name in ("max_epochs", "batch_size", "lr", "train_size", "val_size"):
        if not 0 < getattr(args, name) < 1e7:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e7, got {getattr(args, name)}")
    return args


def make_loaders(args: argparse.Namespace, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    train_set, val_set = make_datasets(args.train_size, args.val_size)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size)
    return train_loader, val_loader


def train_one_epoch(model: torch.nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer):
    """Return (sum of loss × samples, samples) over this rank's shard."""
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # hooks: stage 1 all-reduces each gradient, 2 reduce-scatters it, 3 also gathers layers
        if isinstance(model, FSDP):  # stages 1 and 2 wait in optimizer.step()
            model.finish_gradient_synchronization()
        optimizer.step()
        loss_sum += loss.detach() * len(y)  # stays a tensor: no sync per step
    return loss_sum, len(loader.sampler)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader):
    """Return (sum of squared errors, samples) over this rank's validation shard."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in loader:
        loss_sum += F.mse_loss(model(x), y, reduction="sum")
    return loss_sum, len(loader.dataset)


def epoch_means(train_totals: tuple, val_totals: tuple) -> tuple[float, float]:
    """Means over every sample of every rank. Every rank all-reduces: behind `if rank == 0` the others never join."""
    totals = torch.tensor([*train_totals, *val_totals], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()


def train(args: argparse.Namespace, rank: int, world_size: int) -> torch.nn.Module:
    train_loader, val_loader = make_loaders(args, rank, world_size)
    print(f"[rank {rank}/{world_size}] {len(train_loader)} steps per epoch\n", end="", flush=True)  # 1 write: unmixed
    torch.manual_seed(args.seed)  # the same initial weights on every rank (the wrappers broadcast rank 0's)
    model = whole = build_model(args.model)
    checkpoint, start_epoch = args.checkpoint and os.path.exists(args.checkpoint), 0
    if checkpoint:  # every rank loads the whole model, and slices it in the wrapper
        checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(checkpoint["model"])
    for p in model.parameters() if args.stage == 1 else []:  # whole gradients all-reduced, as DDP (by hand: buckets)
        p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad.div_(world_size)))
    if args.stage < 3:  # the model stays whole on every rank; its optimizer is sharded
        optimizer = ShardedOptimizer(model.parameters(), torch.optim.Adam, reduce_scatter=args.stage == 2, lr=args.lr)
    else:  # the model itself is sharded: a plain optimizer updates this rank's slices
        model, whole = FSDP(model), build_model(args.model)  # whole: a copy gathered to evaluate and to save
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if checkpoint:  # a whole optimizer's state, sliced for this rank (ShardedOptimizer slices it itself)
        optimizer.load_state_dict((whole_state if args.stage == 3 else dict)(checkpoint["optimizer"]))
        start_epoch = checkpoint["epoch"]  # the next epoch to run: none is repeated
        if rank == 0:
            print(f"resuming from {args.checkpoint}: {start_epoch} of {args.max_epochs} epochs done", flush=True)
    for epoch in range(start_epoch, args.max_epochs):
        train_loader.sampler.set_epoch(epoch)  # reseeds the shuffle: without it every epoch has one order
        train_totals = train_one_epoch(model, train_loader, optimizer)
        if args.stage == 3:  # every rank gathers it, to evaluate with no collective (shards' batch counts differ)
            whole.load_state_dict(model.gather_full_params())
        val_totals = evaluate(whole, val_loader)
        train_loss, val_loss = epoch_means(train_totals, val_totals)
        if args.checkpoint:  # every rank: gathering the optimizer's slices is a collective
            state = optimizer.state_dict() if args.stage < 3 else whole_state(optimizer.state_dict(), model.shapes)
            state = {"model": whole.state_dict(), "optimizer": state, "epoch": epoch + 1}  # singlenode_cpu.py's form
        if rank == 0:  # one writer; no barrier after it, as no rank reads the file during the run
            if args.checkpoint:
                torch.save(state, args.checkpoint + ".tmp")  # a kill mid-write leaves the old file whole
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            print(f"epoch {epoch} | train_loss:{train_loss:.6f} val_loss:{val_loss:.6f}", flush=True)  # once saved
    if rank == 0 and start_epoch < args.max_epochs:
        print(f"done | val_loss:{val_loss:.6f} floor:{LOSS_FLOOR:.6f} ({val_loss / LOSS_FLOOR:.3f} × floor)")
    # Optimizer state: stages 1 and 2 keep fp32 masters of the slices too (the ZeRO paper's K = 12).
    params, masters = list(model.parameters()), list(getattr(optimizer, "shard", {}).values())
    held = {"parameters": params, "gradients": [p.grad for p in params + masters if p.grad is not None],
            "optimizer state": masters + [t for s in getattr(optimizer, "inner", optimizer).state.values()
                                          for t in s.values()]}
    held = " | ".join(f"{k} {sum(t.numel() * t.element_size() for t in ts):,}" for k, ts in held.items())
    print(f"[rank {rank}/{world_size}] stage {args.stage} bytes held: {held}\n", end="", flush=True)
    return whole


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process (and OMP_NUM_THREADS=1)
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 4 zero_by_hand.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > args.train_size:
        raise SystemExit(f"error: {world_size} ranks but {args.train_size} training samples: each needs one")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises: gloo's threads end with the group
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
