"""What each rank holds and sends in a layout of train.py: counted in a real run, or simulated in one
process at any number of ranks.

    torchrun --nproc-per-node 4 gpt/simulate.py --parallel fsdp --tp 2 --model tiny --vocab_size 64 --seq_len 32
    python gpt/simulate.py --ranks 4 --parallel fsdp --tp 2 --model tiny --vocab_size 64 --seq_len 32  # the same
    python gpt/simulate.py --ranks 1024 --parallel hsdp --shard_size 16 --tp 8 --model 6.7b --precision bf16

Both lay the model out through parallelize.py, as train.py does, and run one training step (forward and
backward under the tp loss, clipping, AdamW) on --batch_size sequences per data-parallel rank, while
Collectives records every collective: which, on which dimension of the mesh, of how many bytes. Simulated,
the process group is torch's fake one (each collective returns at once, its result garbage) and the step
runs under FakeTensorMode (activations, gradients and optimizer state have shapes but no memory, nor any
arithmetic), so one rank of a 6.7B model among 1,024 takes half a minute on 2 cores; each rank's own shards
of the parameters are real, and small. Shapes, not values, decide what is sent, so the two count the same.
"""
import argparse
import contextlib
import json
import multiprocessing
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import context
import parallelize
import pipeline
from model import CONFIGS, GPT, GPTConfig

# Past train.py's sizes, for the simulation only: GPT-2 XL (1.5B) and GPT-3's 6.7B and 13B shapes.
SIZES = {**CONFIGS, "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),
         "6.7b": dict(n_layer=32, n_head=32, n_embd=4096), "13b": dict(n_layer=40, n_head=40, n_embd=5120)}
# The collectives of c10d (FSDP's) and of the functional API (DTensor's), by what they do.
KINDS = {"_allgather_base_": "all-gather", "allgather_": "all-gather", "all_gather_into_tensor": "all-gather",
         "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_": "reduce-scatter",
         "reduce_scatter_tensor": "reduce-scatter", "allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce",
         "all_reduce": "all-reduce", "alltoall_base_": "all-to-all", "all_to_all_single": "all-to-all",
         "broadcast_": "broadcast", "send": "send", "recv_": "recv"}
# Groups outside the mesh, by their size: a pipeline's tied matrix, all-reduced between its first and last stage.
PAIRS = {"tied": 2}
# Bytes each rank sends, as a share of the collective's whole tensor, in a ring of n ranks.
WIRE = {"all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: (n - 1) / n,
        "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
        "send": lambda n: 1.0, "recv": lambda n: 0.0}


class Collectives(TorchDispatchMode):
    """Every collective dispatched inside it, as {mesh dimension: {kind: [count, bytes]}}: the bytes are
    each collective's whole tensor (an all-gather's output, a reduce-scatter's input, an all-reduce's
    tensor), its largest; WIRE says what a ring sends of it. FSDP's collectives come as c10d ops, with
    their process group; DTensor's as functional ones, with the group's name."""

    def __init__(self, mesh) -> None:
        super().__init__()
        if mesh is None:  # ddp: every rank in one group
            self.dims, self.sizes = {dist.group.WORLD.group_name: "world"}, {"world": dist.get_world_size()}
        else:
            self.dims = {dist.group.WORLD.group_name: "world",  # (unless a dimension spans it)
                         **{mesh.get_group(name).group_name: name for name in mesh.mesh_dim_names}}
            self.sizes = {name: mesh[name].size() for name in mesh.mesh_dim_names}
        self.sent = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # DTensor first: the collectives its op turns into come back here (CommDebugMode's way)
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        kind = KINDS.get(func.__name__.split(".")[0]) if func.namespace in ("c10d", "_c10d_functional") else None
        if kind:
            flat = [t for a in (*args, out) for t in (a if isinstance(a, list | tuple) else [a])]
            if func.namespace == "c10d":  # the process group, boxed for the dispatcher
                group = next(dist.ProcessGroup.unbox(a).group_name for a in flat
                             if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
            else:  # the group's name, the last string (after the reduce op's)
                group = [a for a in args if isinstance(a, str)][-1]
            if kind in ("send", "recv") and not flat[0].is_floating_point():
                return out  # a schedule's first step votes with integers (static_shapes): not a step's traffic
            entry = self.sent[self.dims.get(group, "other")][kind]
            entry[0] += 1
            entry[1] += max(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
        return out


class Saved(torch.autograd.graph.saved_tensors_hooks):
    """The bytes autograd keeps for the backward inside each block's forward (its activations): each storage once
    (q, k and v are views of one), the block's parameters' not counted (they are held anyway; under FSDP, gathered
    for the forward and the backward, their storages are those the block holds when it saves them)."""

    def __init__(self, blocks: list[torch.nn.Module]) -> None:
        super().__init__(self.pack, lambda t: t)
        self.block, self.weights, self.storages = None, set(), defaultdict(dict)
        for i, block in enumerate(blocks):  # a module sharded on its own inside it (the experts) gathers its own
            for module in [m for m in block.modules() if m is block or isinstance(m, FSDPModule)]:
                module.register_forward_pre_hook(lambda *_, i=i: self.enter(i, blocks[i]))
            block.register_forward_hook(lambda *_: setattr(self, "block", None))

    def enter(self, i: int, block: torch.nn.Module) -> None:
        """Block i's forward, or that of a module in it that FSDP shards, begins (after FSDP's hook, which gathers
        its weights): the block's weights' storages, once each time, not at each tensor saved."""
        self.block = i
        self.weights = {StorageWeakRef((p.to_local() if isinstance(p, DTensor) else p).untyped_storage())
                        for p in block.parameters()}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            if StorageWeakRef(storage) not in self.weights:
                self.storages[self.block][StorageWeakRef(storage)] = storage.nbytes()
        return t

    def per_block(self) -> list[int]:
        return [sum(self.storages[i].values()) for i in sorted(self.storages)]


def local(t: torch.Tensor) -> int:
    """Bytes of this rank's shard of t."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and AdamW moments (its shards of each)."""
    params = list(model.parameters())
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return {"parameters": sum(map(local, params)), "gradients": sum(local(p.grad) for p in params),
            "optimizer": sum(map(local, moments))}


def one_step(args: argparse.Namespace, world_size: int, device: torch.device, fake: bool) -> dict:
    """This rank's bytes held and sent, per mesh dimension, in one training step of args' layout."""
    config = GPTConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, **SIZES[args.model])
    parallelize.check_layout(args, config, world_size)
    mesh = parallelize.make_mesh(args, world_size, device)
    with torch.device("meta"):
        model = GPT(config)
    flops = model.flops_per_token()
    model = parallelize.parallelize_gpt(model, mesh, args, device, init=not fake)
    optimizer = torch.optim.AdamW(model.parameters())
    counted = Collectives(mesh)
    layers = [layer for part in getattr(model, "parts", [model]) for layer in parallelize.moe_layers(part)]
    for layer in layers:  # routed evenly: its counts from shapes, the same real and simulated
        layer.even = True
    experts = next((layer.experts.gate.device_mesh for layer in layers if isinstance(layer.experts.gate, DTensor)),
                   None)  # --ep: the experts' mesh, every layer's the same
    for name in experts.mesh_dim_names if experts is not None else []:
        group, counted.sizes[name] = experts.get_group(name).group_name, experts[name].size()
        known = counted.dims.get(group)  # a group two dimensions' (the world's, fsdp 2 with ep 2): both names
        counted.dims[group] = name if known in (None, name) else f"{known} = {name}"
    spmd = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor)) if mesh is not None else None
    if spmd is not None and "shard_cp" in spmd.mesh_dim_names:  # under --cp, FSDP's and tp's mesh: shard, cp folded
        for name in spmd.mesh_dim_names:
            group, counted.sizes[name] = spmd.get_group(name).group_name, spmd[name].size()
            known = counted.dims.get(group)  # cp's own group where shard is 1: both names
            counted.dims[group] = name if known in (None, "world", name) else f"{name} = {known}"
    if isinstance(model, pipeline.Pipeline) and model.tie_group is not None:  # the tied matrix's pair of ranks
        counted.dims[model.tie_group.group_name] = "tied"
    if isinstance(model, pipeline.Pipeline):
        static_shapes(model, args, fake)
    # under selective checkpointing torch's checkpoint keeps what its policy saves itself, out of these hooks' sight
    blocks = [block for part in getattr(model, "parts", [model])  # a stage's blocks: a ModuleDict
              for block in (part.blocks.values() if isinstance(part.blocks, torch.nn.ModuleDict) else part.blocks)]
    saved = contextlib.nullcontext() if args.activation_checkpoint == "selective" else Saved(blocks)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), counted, saved:
        x, y = torch.randint(args.vocab_size, (2, args.batch_size * args.grad_accum, args.seq_len), device=device)
        if isinstance(model, pipeline.Pipeline):
            model.step(x, y)
            model.clip_gradients(1.0)
        else:
            with parallelize.loss_context(mesh):
                model(x, y).mean().backward()
            parallelize.tp_moe_gradients(model)
            parallelize.clip_gradients(model, 1.0)
        optimizer.step()
        parallelize.moe_step(model)
        bytes_held = held(model, optimizer)
    sent = {dim: dict(kinds) for dim, kinds in counted.sent.items()}
    wire = {dim: round(sum(total * WIRE[kind]({**counted.sizes, **PAIRS}.get(dim, world_size))  # sent, in a ring
                           for kind, (_, total) in kinds.items())) for dim, kinds in sent.items()}
    experts = sum(local(p) for layer in layers for p in layer.experts.parameters())  # among the parameters held
    return {"mesh": dict(counted.sizes), "held": bytes_held, "sent": sent, "wire": wire, "flops_per_token": flops,
            "moe_layers": len(layers), "experts": experts, "blocks": len(blocks) * args.grad_accum,
            "activations": [n // args.grad_accum for n in saved.per_block()] if isinstance(saved, Saved) else None}


def static_shapes(pipe: pipeline.Pipeline, args: argparse.Namespace, fake: bool) -> None:
    """Each stage's input and output shapes given up front, as PipelineStage's input_args and output_args would:
    without them, a schedule's first step learns them by running a micro-batch's forward and backward more and
    sending them on (send_object_list), which a fake process group cannot (its results are garbage), and which
    is not a step's traffic (train.py's first step does it, once). Simulated, also the vote on whether shapes
    were given: the stages' 0s and 1s multiplied along the pipeline and read with .item(), which a fake tensor
    has no value for. Private in torch 2.13 (torch/distributed/pipelining/stage.py: _user_meta, _inference_mode)."""
    shape, dtype, _ = pipe.activation
    activation = torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(shape[:1] + (args.seq_len,), dtype=torch.long, device="meta")
    n_expert = pipe.stages[0].submod.config.n_expert  # a mixture of experts: the routing's sums sent along
    sent = (activation, torch.empty(2, n_expert, device="meta", requires_grad=True)) if n_expert else (activation,)
    for stage in pipe.stages:  # the last stage's output (the logits) goes to the loss, not to a stage: any shape
        stage._user_meta = _StageMeta(inputs=extract_tensor_metas((tokens,) if stage.is_first else sent),
                                      outputs=extract_tensor_metas(sent))

    def no_vote(stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC
    if fake:
        pipe.schedule._warmup_p2p = no_vote


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=SIZES, default="gpt2", help="gpt/model.py's CONFIGS, and larger ones")
    p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp"], default="fsdp",
                   help="as train.py's, but fsdp by default (train.py's is ddp, as its --model is tiny, here gpt2)")
    p.add_argument("--shard_size", type=int, help="hsdp: data-parallel ranks per shard group (default: a node's "
                                                    "ranks / (--tp × --cp),\n8 GPUs a node when simulated)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel ranks, innermost, as train.py's")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, outermost, as train.py's")
    p.add_argument("--ep", type=int, default=1, help="expert parallel ranks, taken from the data-parallel ones, as "
                                                      "train.py's")
    p.add_argument("--cp", type=int, default=1, help="context parallel ranks, next to shard, as train.py's")
    p.add_argument("--cp_method", choices=context.METHODS, help="as train.py's (default allgather)")
    p.add_argument("--pp_schedule", choices=pipeline.SCHEDULES, help="as train.py's (default 1F1B)")
    p.add_argument("--activation_checkpoint", choices=["none", "full", "selective"], default="none",
                   help="as train.py's: what a block's recomputed forward sends is counted")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches a step (the pipeline's)")
    p.add_argument("--batch_size", type=int, default=1, help="sequences per data-parallel rank per micro-batch")
    p.add_argument("--seq_len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--vocab_size", type=int, default=50304, help="GPT-2's, padded to a multiple of 64")
    p.add_argument("--precision", choices=parallelize.DTYPES, default="fp32", help="the compute dtype")
    p.add_argument("--ranks", type=int, help="simulate this many ranks (default: torchrun's, counted for real)")
    p.add_argument("--every_rank", action="store_true", help="simulate each rank in turn, not only rank 0")
    p.add_argument("--json", action="store_true", help="one JSON list of the ranks' figures, for tests")
    args = p.parse_args(argv)
    for name in ("shard_size", "tp", "pp", "ep", "cp", "grad_accum", "batch_size", "seq_len", "vocab_size", "ranks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    args.compile, args.seed = False, 0  # what parallelize.py reads of train.py's
    refused = parallelize.refused_layout(args)  # what train.py refuses
    if refused:
        p.error(refused)
    if args.ranks and args.shard_size is None and args.parallel == "hsdp":  # a node of 8 GPUs (torchrun: the real's)
        args.shard_size = parallelize.shard_size(args, args.ranks, node=min(8, args.ranks))
    if (args.ranks is None) == ("RANK" not in os.environ):
        p.error("give --ranks to simulate, or start under torchrun to count a real run: one of the two")
    if args.grad_accum > 1 and args.pp == 1:  # one forward here, where train.py runs --grad_accum micro-steps
        p.error("--grad_accum is a pipeline's micro-batches: give it with --pp (without, count one step of "
                "--batch_size)")
    if args.ranks and args.parallel == "ddp":  # and DDP's reducer fails on the fake group's results
        p.error("ddp holds the whole model on every rank and all-reduces every gradient once a step (at one rank, "
                "nothing: the model alone): count it under torchrun")
    return args


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} B" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024


def report(args: argparse.Namespace, world_size: int, figures: dict, simulated: bool) -> str:
    dims = figures["mesh"]
    mesh = " × ".join(f"{name} {n}" for name, n in dims.items() if name not in ("expert_shard", "ep", "shard_cp"))
    if "shard_cp" in dims:  # FSDP's mesh: shard and cp folded in one
        mesh += f"; FSDP shards over shard × cp, shard_cp {dims['shard_cp']}"
    if "ep" in dims:  # the experts' mesh: the shard dimension split in two
        mesh += f"; the experts': shard {dims['shard']} = expert_shard {dims['expert_shard']} × ep {dims['ep']}"
    width = max(24, *(len(f"{dim} {kind}") for dim, kinds in figures["sent"].items() for kind in kinds))
    held = figures["held"]
    experts = f" (experts {size(figures['experts'])})" if figures["moe_layers"] else ""
    lines = [f"{args.model} | {args.parallel} on {world_size:,} rank{'s' if world_size > 1 else ''} ({mesh}) | "
             f"{args.precision} | "
             f"{args.batch_size} × {args.seq_len} tokens per data-parallel rank"
             f"{f' ({args.seq_len // args.cp:,} of each on each cp rank)' if args.cp > 1 else ''}"
             f"{f' and micro-batch, {args.grad_accum} of them' if args.grad_accum > 1 else ''} | "
             f"{'simulated' if simulated else 'counted in a real run'}",
             "held by rank 0: " + " | ".join(f"{k} {size(v)}{experts if k == 'parameters' else ''}"
                                             for k, v in held.items()),
             f"{'sent in one step':<{width + 2}}{'count':>6}{'whole tensors':>15}{'each rank sends':>17}"]
    for dim, kinds in figures["sent"].items():
        for kind, (count, total) in kinds.items():
            lines.append(f"  {dim + ' ' + kind:<{width}}{count:>6}{size(total):>15}"
                         f"{size(total * WIRE[kind]({**dims, **PAIRS}.get(dim, world_size))):>17}")
    layers = figures["moe_layers"]
    routed = layers and sum(kinds.get("all-to-all", [0, 0])[1] for kinds in figures["sent"].values())  # ep's alone
    if routed:  # its counts, the tokens there and back, and their gradients the other way: 5 a layer
        lines.append(f"per MoE layer ({layers}, routed evenly): all-to-all {size(routed / layers)} whole tensors, "
                     f"each rank sends {size(routed / layers * WIRE['all-to-all'](dims['ep']))}")
    if "cp" in dims and "cp" not in figures["sent"]:  # cp's group is FSDP's too
        lines.append("cp's group is FSDP's too (shard 1): its collectives are counted with FSDP's, above")
    elif "cp" in dims:  # the attention's collectives, per block and micro-batch (recomputed: its forward's twice)
        runs = figures["blocks"]  # this rank's blocks, times the micro-batches
        per = ", ".join(f"{kind} {count / runs:g} × {size(total / count)}"
                        for kind, (count, total) in figures["sent"]["cp"].items())
        lines.append(f"per block{' and micro-batch' if args.grad_accum > 1 else ''} on cp ({args.cp_method}): {per}; "
                     f"each rank sends {size(figures['wire']['cp'] / runs)}")
    blocks = figures["activations"]  # one micro-batch's, per block
    if blocks is None:
        lines.append("activations: not counted under selective checkpointing (torch's checkpoint keeps them)")
    elif blocks:
        lines.append(f"activations a block keeps for its backward, one micro-batch: {size(max(blocks))}"
                     f"{'' if min(blocks) == max(blocks) else f' (the least: {size(min(blocks))})'}, "
                     f"{size(sum(blocks))} over this rank's {len(blocks)} block{'s' if len(blocks) > 1 else ''}")
    if layers:
        lines.append(f"training FLOPs per token: {figures['flops_per_token']:,} (6 per active parameter, top_k of "
                     f"the experts, and attention's)")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.ranks is None:  # under torchrun: count what these ranks really send
        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        figures = [None] * world_size
        try:
            dist.all_gather_object(figures, one_step(args, world_size, torch.device("cpu"), fake=False))
        except ValueError as error:  # a layout the ranks or the model cannot take, found alike by every rank
            sys.exit(f"error: {error}" if rank == 0 else 1)
        finally:
            dist.destroy_process_group()
        if rank == 0:
            print(json.dumps(figures) if args.json else report(args, world_size, figures[0], False))
        return
    figures = [in_a_child(args, rank) for rank in range(args.ranks if args.every_rank else 1)]
    said = [figure for figure in figures if isinstance(figure, str)]
    if said:  # a layout the ranks or the model cannot take, said as train.py says it, or a child that died
        sys.exit(f"error: {said[0]}")
    print(json.dumps(figures) if args.json else report(args, args.ranks, figures[0], True))


def in_a_child(args: argparse.Namespace, rank: int) -> dict | str:
    """simulate() in a forked process of its own, one rank at a time: the fake process group (and DeviceMesh's
    groups) once per process. A child that dies (the out-of-memory killer: a rank's shards are real) is said in
    one line, where a process pool would wait for it forever."""
    receive, send = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=lambda: send.send(simulate(args, rank)))
    child.start()
    send.close()  # this end is the child's: its death closes the pipe
    try:
        return receive.recv()
    except EOFError:
        child.join()
        return f"rank {rank}'s simulation died (exit code {child.exitcode}; out of memory?)"
    finally:
        child.join()


def simulate(args: argparse.Namespace, rank: int) -> dict | str:
    """One rank's figures, in a process of torch's fake process group of args.ranks (or the ValueError's words)."""
    dist.init_process_group("fake", rank=rank, world_size=args.ranks)  # torch's FakeProcessGroup: no peers, no store
    try:
        return one_step(args, args.ranks, torch.device("cpu"), fake=True)
    except ValueError as error:
        return str(error)


if __name__ == "__main__":
    main()
