"""The layouts of gpt/train.py: given the model, the mesh and the flags, the model laid out over the ranks.

train.py is the loop; every decision about which rank holds what, and what a backward communicates, is
here (torchtitan's parallelize_llama is the model): make_mesh() builds the DeviceMesh of --parallel and
--tp, parallelize_gpt() lays out the model built on `meta` on it, with the same starting weights in every
layout, data_rank() says which batch a rank reads, loss_context() how the loss is computed, gradient_sync()
what a backward communicates under gradient accumulation.
"""
import argparse
import contextlib
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import parallel as tp
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import context
import pipeline
from model import GPT, GPTConfig, MoE, grouped
from optimizer import clip, grad_norm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# --activation_checkpoint selective keeps what these return (the matrix products, attention on CPU and on GPUs) and
# recomputes the rest in backward: the norms, GELU, the additions and views, cheap for the bytes they would hold.
KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def refused_layout(args: argparse.Namespace) -> str | None:
    """Why a combination of train.py's layout options cannot run (one line), or None; it also sets
    --pp_schedule's default. simulate.py calls it too, so that it refuses what train.py refuses."""
    if args.shard_size is not None and (args.parallel != "hsdp" or args.shard_size < 1):
        return "--shard_size is for --parallel hsdp, and must be at least 1"
    if args.tp < 1 or args.pp < 1 or args.ep < 1 or args.cp < 1:
        return "--tp, --pp, --ep and --cp must be at least 1"
    if args.cp > 1 and args.parallel == "ddp":  # the cp ranks shard the weights: FSDP's groups
        return f"--cp {args.cp} needs --parallel fsdp or hsdp (cp alone: --parallel fsdp --cp N on N ranks)"
    if args.cp > 1 and args.compile:  # it runs (by hand, the same losses), but no test proves it yet: a minute each
        return f"--cp {args.cp} does not yet go with --compile (unproven: docs/gpt_context.md)"
    if args.ep > 1 and args.parallel == "ddp":  # the experts' shards need FSDP's groups of what ep leaves
        return f"--ep {args.ep} needs --parallel fsdp or hsdp (ep alone: --parallel fsdp --ep N on N ranks)"
    if args.ep > 1 and args.activation_checkpoint == "selective":  # torch 2.13, measured
        return (f"--ep {args.ep} and --activation_checkpoint selective: the experts' own FSDP hooks inside a block "
                "run in its forward, not in its recomputation, which selective checkpointing refuses: use full")
    if args.pp_schedule and args.pp == 1:
        return "--pp_schedule is for --pp above 1"
    if args.cp_method and args.cp == 1:
        return "--cp_method is for --cp above 1"
    args.cp_method = args.cp_method or ("allgather" if args.cp > 1 else None)  # None: no cp, in the checkpoint
    args.pp_schedule = args.pp_schedule or ("1F1B" if args.pp > 1 else None)  # None: no pipeline, in the checkpoint
    if args.pp > 1 and args.parallel == "ddp":
        return f"--pp {args.pp} needs --parallel fsdp or hsdp (pp alone: --parallel fsdp --pp N on N ranks)"
    if args.activation_checkpoint == "selective" and args.pp_schedule in pipeline.SPLIT_BACKWARD:  # torch 2.13
        return (f"--activation_checkpoint selective keeps its results for one backward, and --pp_schedule "
                f"{args.pp_schedule} runs two (the input's, then the weights'): use full there")
    # torch 2.13's split-backward schedules refuse a stage holding a torch.compile wrapper (OptimizedModule), not blocks
    # compiled in place (compile_model): the input's pass raises "compiled with non-empty donated buffers" (measured).
    if args.compile and args.pp_schedule in pipeline.SPLIT_BACKWARD:
        return (f"--compile and --pp_schedule {args.pp_schedule}: the schedule splits each backward in two (the "
                f"input's, then the weights'), and a compiled block's backward cannot be split: use GPipe, "
                f"1F1B, Interleaved1F1B or LoopedBFS, or no --compile")
    if args.compile and args.tp > 1 and args.activation_checkpoint == "full":  # torch 2.13, measured (aot_eager too)
        return ("--compile with --tp and --activation_checkpoint full fails in torch 2.13 (the compiled checkpoint "
                "saves tp's DeviceMesh for backward): use selective, or no --compile")
    if args.pp > 1 and args.precision == "fp16":  # the schedule runs each backward: no GradScaler can scale it
        return f"--pp {args.pp} runs in fp32 or bf16: fp16's loss scaling is not in torch's pipeline schedules"
    if args.tp > 1 and args.parallel == "ddp":  # DDP takes no DTensor parameters: tensor_parallel()
        return (f"--tp {args.tp} needs --parallel fsdp or hsdp: DDP takes no tensor-parallel parameters (tp alone: "
                f"--parallel fsdp --tp N on N ranks)")
    return None


def check_layout(args: argparse.Namespace, config: GPTConfig, world_size: int) -> None:
    """A layout that the ranks or the model cannot take, refused before anything is written (a ValueError,
    one line): --tp must divide the ranks, and the heads (q's, and k's and v's: a rank keeps whole ones), the
    width, the MLP's hidden units, the vocabulary and the sequence, which tensor_parallel() splits; hsdp's
    --shard_size must divide the data-parallel ranks; --pp × --tp must
    divide the ranks, and the pipeline suit the model and the schedule (pipeline.check)."""
    if world_size % args.tp:
        raise ValueError(f"--tp {args.tp} does not divide the {world_size} ranks")
    if world_size % (args.pp * args.tp):
        raise ValueError(f"--pp {args.pp} × --tp {args.tp} does not divide the {world_size} ranks")
    if world_size % (args.pp * args.tp * args.cp):
        raise ValueError(f"--cp {args.cp} × --pp {args.pp} × --tp {args.tp} does not divide the {world_size} ranks")
    if args.cp > 1 and config.seq_len % (2 * args.cp):  # head-tail: 2·cp chunks of the sequence (gpt/context.py)
        raise ValueError(f"--cp {args.cp}: 2 × {args.cp} does not divide --seq_len {config.seq_len} (each rank holds "
                         "two of 2·cp equal chunks)")
    if args.cp > 1 and config.seq_len // args.cp % args.tp:  # sequence parallel splits a cp rank's tokens over tp
        raise ValueError(f"--cp {args.cp} --tp {args.tp}: a cp rank's {config.seq_len // args.cp} tokens (--seq_len / "
                         f"cp) do not split over {args.tp} tp ranks")
    if args.cp > 1 and config.n_expert and config.capacity_factor:  # as under --tp below
        raise ValueError(f"--cp {args.cp} and a capacity factor: each cp rank routes its share of the sequence, and "
                         "a capacity is over a micro-batch's tokens in order: no capacity_factor under --cp")
    if args.cp > 1 and args.cp_method == "ulysses" and config.n_head // args.tp % args.cp:  # n_head / tp / cp each
        heads = f"n_head, {config.n_head}" if args.tp == 1 else f"n_head / tp, {config.n_head // args.tp}"
        raise ValueError(f"--cp {args.cp} --cp_method ulysses: {args.cp} does not divide the model's {heads} (each "
                         "rank attends with n_head / cp heads): use allgather or ring")
    dp = world_size // (args.pp * args.tp * args.cp)
    if args.parallel == "hsdp" and dp % shard_size(args, world_size):
        raise ValueError(f"--shard_size {shard_size(args, world_size)} does not divide the {dp} data-parallel ranks")
    if args.pp > 1:
        pipeline.check(args, config)
    if config.n_expert and config.capacity_factor and args.tp > 1:  # a capacity counts a whole micro-batch's
        # choices in token order; under tp each rank routes its share of the sequence (tensor_parallel)
        raise ValueError(f"--tp {args.tp} and a capacity factor: each tp rank routes its share of the sequence, "
                         "and a capacity is over a micro-batch's tokens in order: no capacity_factor under --tp")
    if args.ep > 1:  # ep's ranks are taken from FSDP's, shard × cp
        shard = (dp if args.parallel == "fsdp" else shard_size(args, world_size)) * args.cp
        if not config.n_expert:
            raise ValueError(f"--ep {args.ep}: the model has no experts (a mixture of experts: --model moe-tiny)")
        if config.n_expert % args.ep:
            raise ValueError(f"--ep {args.ep} does not divide the model's {config.n_expert} experts")
        if shard % args.ep:
            raise ValueError(f"--ep {args.ep} does not divide the {shard} ranks that shard the weights (fsdp: the "
                             "data-parallel ranks; hsdp: --shard_size; times --cp)")
    for what in ("n_head", "n_kv_head", "n_embd", "ffn_hidden", "vocab_size", "seq_len"):
        if getattr(config, what) % args.tp:
            raise ValueError(f"--tp {args.tp} does not divide the model's {what}, {getattr(config, what)}")


def shard_size(args: argparse.Namespace, world_size: int, node: int | None = None) -> int:
    """hsdp: the data-parallel ranks of a shard group (a cp group counting once, as a tp group does), --shard_size
    or a node's (`node` ranks, else LOCAL_WORLD_SIZE) over tp's and cp's, at most the data-parallel ranks (with --pp
    on one node, fewer than a node's)."""
    node, inner = node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), args.tp * args.cp
    return args.shard_size or math.gcd(max(1, node // inner), max(1, world_size // (inner * args.pp)))


def make_mesh(args: argparse.Namespace, world_size: int, device: torch.device) -> DeviceMesh | None:
    """The ranks as a mesh (check_layout() said it fits): fsdp, one dimension ("shard"); hsdp, ("replicate",
    "shard"), the shard groups of shard_size() neighbouring ranks; --tp adds "tp" innermost, so that a tp
    group is neighbouring ranks (one node on a cluster, where its many collectives are fastest); --pp adds "pp"
    outermost, a pipeline's stages the farthest apart (their sends are few and point to point). ddp: none."""
    if args.parallel == "ddp":
        return None
    dp = world_size // (args.pp * args.tp * args.cp)  # the data-parallel ranks: one per pipeline, cp and tp group
    shape, names = (dp,), ("shard",)
    if args.parallel == "hsdp":
        shape, names = (dp // shard_size(args, world_size), shard_size(args, world_size)), ("replicate", "shard")
    if args.cp > 1:  # next to shard: FSDP shards over the two, flattened (parallelize_gpt)
        shape, names = (*shape, args.cp), (*names, "cp")
    if args.tp > 1:
        shape, names = (*shape, args.tp), (*names, "tp")
    if args.pp > 1:
        shape, names = (args.pp, *shape), ("pp", *names)
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def parallelize_gpt(model: GPT, mesh: DeviceMesh | None, args: argparse.Namespace, device: torch.device,
                    init: bool = True, start: dict | None = None) -> torch.nn.Module | pipeline.Pipeline:
    """The model, built on `meta` (no memory), laid out on `mesh` for --parallel and given its starting
    weights: GPT.init_weights(--seed)'s in every layout, or `start`'s (a whole state_dict: --init_from), each
    rank taking the whole values and keeping its shard (init=False: left as allocated, for simulate.py, which
    only counts). Under --pp, this rank's stages, each laid out so, in a pipeline.Pipeline."""
    order = [(name, param.shape) for name, param in model.named_parameters()]  # the draws of GPT.init_weights
    checkpoint_blocks(model, args.activation_checkpoint)  # before compile (traced with it) and the wrappers' hooks
    if args.compile:
        compile_model(model)
    if mesh is None:
        model.to_empty(device=device)
        # From meta, to_empty gives each module a new Parameter (torch/nn/modules/module.py, Module._apply): the
        # tied head would be a matrix of its own. FSDP's DTensors are swapped in place, and stay tied.
        if model.config.tie_head:
            model.lm_head.weight = model.wte.weight
        zero_buffers(model)
        if start is None:
            model.init_weights(args.seed)
        else:  # the same parameters, in the same order, as `order` names them
            with torch.no_grad():
                for (name, _), param in zip(order, model.parameters(), strict=True):
                    param.copy_(start[name])
        if dist.get_world_size() == 1:  # the model alone, as nanoGPT runs one process: DDP's hooks there would
            return model  # only copy each gradient into a bucket, all-reduce it over one rank, and copy it back
        # DDP broadcasts rank 0's weights at construction; every rank drew the same ones anyway.
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    parts, ids = pipeline.stages(model, mesh, args) if "pp" in mesh.mesh_dim_names else ([model], [])
    # Gradients reduced in fp32. In fp32, no param_dtype: FSDP would cast every forward's inputs to what they are.
    policy = MixedPrecisionPolicy(param_dtype=None if args.precision == "fp32" else DTYPES[args.precision],
                                  reduce_dtype=torch.float32)
    root = fold_cp(mesh)  # FSDP's and tp's: one root mesh, as FSDP asks of a tp DTensor it shards again
    dp_mesh = root[tuple(name for name in root.mesh_dim_names if name not in ("pp", "tp"))]
    experts_mesh = expert_mesh(root, args.ep) if args.ep > 1 else None
    for part in parts:
        if "tp" in mesh.mesh_dim_names:
            tensor_parallel(part, root["tp"])  # FSDP then shards each tp shard again, over the data-parallel ranks
        if experts_mesh is not None:
            expert_parallel(part, experts_mesh, policy)
        if "cp" in mesh.mesh_dim_names:
            context.context_parallel(part, mesh["cp"].get_group(), args.cp_method)
        # One all-gather per block, freed after its forward and gathered again for its backward; under the
        # schedules that split each backward in two (torch 2.13), the last stage's blocks so sharded lose their
        # weights' gradients (None, measured): one per stage. The last block is kept gathered after its forward
        # (torchtitan's default): its backward comes next, after the head's. Under --pp every block is kept
        # gathered from the first micro-batch's forward to the step's end (torchtitan's default there): freed
        # after each forward, a block is gathered again for every micro-batch (m + 1 a step, not 1).
        units = blocks(part) if args.pp_schedule not in pipeline.SPLIT_BACKWARD or args.pp == 1 else []
        for i, block in enumerate(units):
            fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=not ids and i < len(units) - 1)
        # the rest: embeddings, final norm, tied head (the root: FSDP keeps it gathered after its forward anyway)
        fully_shard(part, mesh=dp_mesh, mp_policy=policy, **({"reshard_after_forward": False} if ids else {}))
        part.to_empty(device=device)
        zero_buffers(part)
    if init:
        generator = torch.Generator().manual_seed(args.seed)
        held = {}  # name: this rank's parameters of that name; a last stage's tied lm_head.weight, drawn as wte.weight
        tied = model.config.tie_head
        for part in parts:
            for name, param in part.named_parameters():
                held.setdefault("wte.weight" if tied and name == "lm_head.weight" else name, []).append(param)
        with torch.no_grad():
            for name, shape in order:  # each full value drawn as GPT.init_weights does
                full = (model.init_value(name, shape, generator) if start is None else start[name]).to(device)
                for param in held.get(name, []):  # keep this rank's shard
                    param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                             src_data_rank=None).to_local())
    if ids:
        return pipeline.Pipeline(parts, ids, mesh, args, device, DTYPES[args.precision], lambda: loss_context(mesh))
    return model


def fold_cp(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over and tp splits over: make_mesh()'s, with a cp dimension folded into shard (one
    dimension, shard_cp: the cp ranks hold shards of the weights too, as torchtitan folds cp into dp_shard). A mesh
    of its own, of all ranks, as expert_mesh() makes: torch 2.13 warns that slicing a flattened dimension out of
    the root mesh will go. Without cp, the mesh itself."""
    names = mesh.mesh_dim_names
    if "cp" not in names:
        return mesh
    at = names.index("shard")  # cp follows it
    shape = (*mesh.shape[:at], mesh.shape[at] * mesh.shape[at + 1], *mesh.shape[at + 2:])
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                      mesh_dim_names=(*names[:at], "shard_cp", *names[at + 2:]))


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The mesh of the experts under --ep: make_mesh()'s with its shard dimension split in two, (expert_shard, ep),
    ep innermost: groups of `ep` neighbouring shard ranks (as torchtitan takes ep from FSDP's ranks), at each pp
    stage, hsdp replica and tp rank alike."""
    names = mesh.mesh_dim_names
    at = names.index("shard_cp" if "shard_cp" in names else "shard")  # under --cp, fold_cp's: shard and cp
    shape = (*mesh.shape[:at], mesh.shape[at] // ep, ep, *mesh.shape[at + 1:])
    return DeviceMesh(mesh.device_type, mesh.mesh.reshape(shape),
                      mesh_dim_names=(*names[:at], "expert_shard", "ep", *names[at + 1:]))


def expert_parallel(model: GPT | pipeline.Stage, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> None:
    """--ep: each MoE layer's experts split over the `ep` ranks of expert_mesh(), each rank holding n_expert / ep
    of them (a DTensor sharded by experts on the ep mesh), the tokens sent to them and back by ep_forward; and
    sharded again by FSDP over what is left (expert_shard; hsdp: replicated across shard groups as the rest is).
    Each expert's gradient then sums every ep rank's tokens' before FSDP averages it over the rest: ep_forward
    divides it by ep, so that it is the mean over all the data-parallel ranks, as the other weights' is. (FSDP's
    set_gradient_divide_factor would do it, but gloo has no PREMUL_SUM, and with set_force_sum_reduction_for_comms
    torch 2.13 divides twice where FSDP's group is one rank.)"""
    for layer in moe_layers(model):
        experts = layer.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param, mesh["ep"], [Shard(0)],
                                                                            src_data_rank=None)))
        experts.forward = functools.partial(ep_forward, layer, mesh["ep"].get_group())
        fully_shard(experts, mesh=mesh[tuple(n for n in mesh.mesh_dim_names if n in ("replicate", "expert_shard"))],
                    mp_policy=policy)


def moe_layers(part: nn.Module) -> list[MoE]:
    """The MoE layers of a GPT or of a pipeline.Stage."""
    return [block.mlp for block in blocks(part) if isinstance(block.mlp, MoE)]


class AllToAll(torch.autograd.Function):
    """all_to_all_single over `group`: splits_in[r] of x's rows to rank r, splits_out[r] from it; the gradient
    back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, splits_out: list[int], splits_in: list[int], group) -> torch.Tensor:
        ctx.back = (splits_in, splits_out, group)
        out = x.new_empty(sum(splits_out), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), splits_out, splits_in, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, *ctx.back), None, None, None


class ScaleGrad(torch.autograd.Function):
    """x itself, its gradient times `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def ep_forward(layer: MoE, group: dist.ProcessGroup, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The layer's Experts.forward under --ep: x's rows sorted by expert (counts[e] for each of all n_expert experts)
    sent to the ranks that hold their experts (counts first, with all_to_all_single, then the rows), each rank's own
    experts run on what it received (from every rank of the group, sorted by its experts), and the results sent
    back the same way, in x's order. Nothing is of a fixed size: a rank that every token chooses gets them all."""
    experts = layer.experts
    ep, mine = group.size(), experts.gate.to_local().shape[0]  # this rank's experts: n_expert / ep
    sent = torch.tensor(counts, device=x.device)
    got = torch.empty_like(sent)
    dist.all_to_all_single(got, sent, group=group)  # got[r * mine + e]: rows rank r sends to my expert e
    # a host sync (on a GPU, the step waits for the counts): all_to_all_single takes its split sizes as ints.
    # MoE.even (gpt/simulate.py): every rank sent `counts`, so what this one got is known without its values.
    me = dist.get_rank(group)
    received = counts[me * mine:(me + 1) * mine] * ep if layer.even else got.tolist()
    splits_out = [sum(received[r * mine:(r + 1) * mine]) for r in range(ep)]
    splits_in = [sum(counts[r * mine:(r + 1) * mine]) for r in range(ep)]
    rows = AllToAll.apply(x, splits_out, splits_in, group)
    expert = torch.arange(mine, device=x.device).repeat(ep).repeat_interleave(got, output_size=sum(received))
    order = expert.argsort(stable=True)  # by expert, each expert's rows by sending rank, each rank's in its order
    w = [ScaleGrad.apply(p.to_local(), 1 / ep) for p in (experts.gate, experts.fc, experts.proj)]
    local = [sum(received[e::mine]) for e in range(mine)]
    y = grouped(F.silu(grouped(rows[order], w[0], local)) * grouped(rows[order], w[1], local), w[2], local)
    back = torch.empty_like(y).index_copy(0, order, y)  # the received order again: by sending rank
    return AllToAll.apply(back, splits_in, splits_out, group)


def zero_buffers(model: nn.Module) -> None:
    """The buffers to_empty left as allocated, set to their start: DeepSeek's expert biases, zeros."""
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.zero_()


def moe_step(model: nn.Module | pipeline.Pipeline) -> None:
    """After each optimizer step: every data rank's routing of the step (GPT.tally, Pipeline.tally) summed,
    DeepSeek-V3's expert biases moved by bias_rate toward the under-loaded experts (the sign of each layer's mean
    count less the expert's, as torchtitan moves them), the same on every rank, and the sums kept for
    moe_metrics()."""
    owner = getattr(model, "module", model)  # DDP's
    if getattr(owner, "routing", None) is None:  # a dense model
        return
    routing, owner.routing = owner.routing, None
    # over every rank: under --tp each tp rank holds its micro-batches' sums alike (tp_moe_forward), so each is
    # counted tp times; under --pp a layer's counts are its stage's ranks' (the others hold 0 there), the
    # auxiliary loss the last stage's; what is read of them is a ratio or a sign
    dist.all_reduce(routing)
    c, layers = owner.config, owner.moe_layers()
    counts = routing[:(c.n_layer - c.first_dense) * c.n_expert].view(-1, c.n_expert)
    if c.bias_rate:
        with torch.no_grad():
            for i, layer in layers.items() if isinstance(layers, dict) else enumerate(layers):  # a pipeline's: some
                layer.expert_bias += c.bias_rate * torch.sign(counts[i].mean() - counts[i])
    owner.interval = routing if owner.interval is None else owner.interval + routing


def moe_metrics(model: nn.Module | pipeline.Pipeline, record: dict, line: str) -> tuple[dict, str]:
    """The log's record and line with the experts' figures since the last call: the auxiliary loss (the mean of
    the forwards'), the load (over the layers, the most the busiest expert took over the mean: 1 is even), and
    with a capacity factor the share of choices dropped. A dense model's as they were."""
    owner = getattr(model, "module", model)
    routing = getattr(owner, "interval", None)
    if routing is None:
        return record, line
    owner.interval, c = None, owner.config
    n = c.n_layer - c.first_dense
    counts = routing[:n * c.n_expert].view(n, -1)
    moe = {"aux_loss": (routing[-2] / routing[-1]).item(),
           "expert_load": (counts.max(-1).values / counts.mean(-1)).max().item()}
    if c.capacity_factor:
        moe["dropped"] = (routing[n * c.n_expert:-2].sum() / counts.sum()).item()
    return {**record, **moe}, line + " | " + " ".join(f"{name} {value:.3f}" for name, value in moe.items())


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_blocks(model: GPT, mode: str) -> None:
    """--activation_checkpoint, per block. full: a block's forward keeps nothing for backward but its input (kept
    anyway, the block before's output), and runs again in backward; selective: it keeps KEEP's results too. Each
    block's forward is wrapped where it is, so its parameters keep their names and FSDP's and tp's hooks, on the
    block's call and its modules', run around it: FSDP gathers the block's weights before its backward, which
    recomputes inside. Non-reentrant (use_reentrant=False), as torch recommends: it records the graph, so a backward
    over chosen inputs works (the pipeline schedules' autograd.grad; the reentrant kind takes only a plain
    backward), and it stops recomputing once what backward needs is rebuilt. Selective keeps its results for one
    backward: train.py refuses it under the schedules that run two (the input's, then the weights')."""
    if mode == "none":
        return
    policy = {"context_fn": functools.partial(create_selective_checkpoint_contexts, keep_matmuls)}
    for block in model.blocks:
        block.forward = checkpointed(block.forward, policy if mode == "selective" else {})


def checkpointed(forward, policy: dict):
    """forward under checkpoint(), in a function of this file: --compile's dynamo starts at the first frame it may
    trace, and traces the checkpoint in it as one operation. A functools.partial of checkpoint itself has no such
    frame (checkpoint is marked @torch._disable_dynamo, torch 2.13): the whole block ran uncompiled."""
    def run(*args, **kwargs):  # kwargs: the rotary tables
        return checkpoint(forward, *args, use_reentrant=False, **policy, **kwargs)
    return run


def blocks(part: nn.Module) -> list[nn.Module]:
    """The blocks of a GPT or of a pipeline.Stage."""
    return list(part.blocks.values() if isinstance(part.blocks, nn.ModuleDict) else part.blocks)


def tensor_parallel(model: GPT | pipeline.Stage, mesh: DeviceMesh) -> None:
    """Megatron's split of every matrix over the tp ranks, with sequence parallel: q, k, v, fc and SwiGLU's gate
    by columns (each rank some heads, some hidden units; under grouped-query attention q by its heads and k and v
    by theirs, so that a rank's q heads find their k and v heads on it), o and proj by rows, their outputs
    reduce-scattered along the sequence; the norms and the residual stream hold 1/tp of the sequence,
    all-gathered before attention and the MLP (Qwen3's norms of q and k: a rank's heads, whole). The embeddings
    and the head, tied or not, are split over the vocabulary (wpe over the positions), the cross-entropy computed
    on the vocabulary's shards (loss_context). Every parameter
    becomes a DTensor on the tp mesh, so that optimizer.grad_norm sees one kind of tensor. DDP takes no DTensor
    parameters (torch composes the two only through a private transform, _pre_dp_module_transform in
    torch/distributed/tensor/parallel/ddp.py), so train.py refuses ddp × tp: fsdp × tp is the layout for it."""
    whole = tp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    plan = {"ln_1": tp.SequenceParallel(), "attn": whole, "ln_2": tp.SequenceParallel(), "mlp": whole,
            "attn.q": tp.ColwiseParallel(), "attn.k": tp.ColwiseParallel(), "attn.v": tp.ColwiseParallel(),
            "attn.o": tp.RowwiseParallel(output_layouts=Shard(1)), "mlp.fc": tp.ColwiseParallel(),
            "mlp.proj": tp.RowwiseParallel(output_layouts=Shard(1))}
    if model.config.family == "llama":
        plan["mlp.gate"] = tp.ColwiseParallel()
    if model.config.qk_norm:  # each (batch, seq, heads, head_dim) input holds this rank's heads: dimension 2 split
        plan["attn.q_norm"] = plan["attn.k_norm"] = tp.SequenceParallel(sequence_dim=2, use_local_output=True)
    own = tp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Shard(1), use_local_output=True)
    dense = {name: style for name, style in plan.items() if not name.startswith("mlp")}
    for block in blocks(model):
        if isinstance(block.mlp, MoE):  # on this rank's share of the sequence, as it is: tp_moe_forward
            tp.parallelize_module(block, mesh, {**dense, "mlp": own})
            block.mlp.forward = functools.partial(tp_moe_forward, block.mlp, mesh.get_group())
        else:
            tp.parallelize_module(block, mesh, plan)
    model.tp_group = mesh.get_group() if moe_layers(model) else None  # for tp_moe_gradients
    tp.parallelize_module(model, mesh, {name: style for name, style in {
        "wte": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # (batch, seq / tp, n_embd)
        "wpe": tp.RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (seq / tp, n_embd)
        "ln_f": tp.SequenceParallel(),
        "lm_head": tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }.items() if getattr(model, name, None) is not None})  # a pipeline's stage: what it holds; llama: no wpe
    if not isinstance(model, GPT):  # a stage: its head's logits go to pipeline.loss, under loss_parallel
        return
    if model.config.tie_head:
        model.lm_head.weight = model.wte.weight  # parallelize_module made the tied matrix two: one again
    head_loss = model.head_loss

    def local_losses(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        losses = head_loss(x, targets)  # a DTensor: each token's loss, the same on every tp rank (Replicate)
        return losses.to_local().clone()  # not a view, which FSDP warns of (as GPT.head_loss says)

    model.head_loss = local_losses


class SumOver(torch.autograd.Function):
    """x summed over `group`'s ranks; the gradient passed back as it is (Megatron's reduce from the tensor-parallel
    region): every rank of the group computes the same loss from the sum, so each holds the whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def tp_moe_forward(layer: MoE, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward under --tp, on the rank's share of the sequence (sequence parallel, as the norms run), local:
    a token's routing and experts are its own, so each tp rank routes its tokens through the router, the experts
    and the shared experts held whole on every tp rank (torchtitan, whose expert parallel borrows the tp ranks
    when its experts are not tensor-parallel, splits the tokens over them so too: ReordererSequenceParallel), a
    tp-th of the FLOPs each; their gradients are summed over tp by
    tp_moe_gradients. The routing's sums are the micro-batch's, over tp, for the auxiliary loss (each micro-batch
    counted once), which every tp rank then computes alike."""
    y = MoE.forward(layer, x)
    counts, probs, dropped = layer.routed  # fresh tensors, summed in place
    dist.all_reduce(counts, group=group)
    dist.all_reduce(dropped, group=group)
    layer.routed = (counts, SumOver.apply(probs, group), dropped)
    return y


@torch.no_grad()
def tp_moe_gradients(model: nn.Module) -> None:
    """Under --tp, the MoE layers' gradients summed over the tp ranks (each rank's are its tokens': tp_moe_forward),
    once a step, on the shards FSDP reduced (a sum over tp commutes with FSDP's mean over the data ranks), one
    all-reduce per parameter: a tp group's ranks hold the same shards. Nothing otherwise."""
    for part in getattr(model, "parts", [model]):
        group = getattr(part, "tp_group", None)
        for layer in moe_layers(part) if group is not None else []:
            for param in layer.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad.to_local(), group=group)


def data_rank(mesh: DeviceMesh | None, rank: int, world_size: int) -> tuple[int, int]:
    """(which share of each batch this rank reads, how many shares): the ranks of one tp group, neighbours
    (tp innermost), read the same, and so do those of a cp group (next outward) and a pipeline's stages (pp
    outermost)."""
    names = mesh.mesh_dim_names if mesh is not None else ()
    tp_size, cp_size, pp_size = (mesh[name].size() if name in names else 1 for name in ("tp", "cp", "pp"))
    shares = world_size // (tp_size * cp_size * pp_size)
    return rank // (tp_size * cp_size) % shares, shares


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)  # the optimizer's state by parameter name: parts merge


def state_dict(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict:
    """The checkpoint's state of this rank's parts (one model, or a pipeline's stages) and their optimizers,
    under the unstaged model's names: a last stage's head is lm_head.weight, and its optimizer state, as in one
    process (where the tied matrix is listed once), wte.weight's (an untied head's stays its own)."""
    state = {"model": {}, "optim": {}}
    for part, optimizer in zip(parts, optimizers, strict=True):
        model_state, optim_state = get_state_dict(part, optimizer, options=FLAT)
        state["model"].update(model_state)
        state["optim"].update({head_as_wte(name, part): value for name, value in optim_state.items()})
    return state


def head_as_wte(name: str, part: nn.Module, back: bool = False) -> str:
    """A last stage's optimizer-state name of a tied lm_head.weight as wte.weight's (back: the other way)."""
    if isinstance(part, GPT) or not hasattr(part, "lm_head") or not part.config.tie_head:
        return name
    old, new = ("wte.weight.", "lm_head.weight.") if back else ("lm_head.weight.", "wte.weight.")
    kind, _, rest = name.partition(".")  # state.<name>.<key> or param_groups.<name>.<key>
    return f"{kind}.{new}{rest[len(old):]}" if rest.startswith(old) else name


def load_state_dict(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], state: dict) -> None:
    """state_dict()'s state, loaded (by dcp.load) into the tensors it gave, set into the parts and optimizers."""
    for part, optimizer in zip(parts, optimizers, strict=True):
        own = set(get_state_dict(part, optimizer, options=FLAT)[0])
        # The head's state loaded under wte's names is copied: in a V, one rank holds both stages, and the two
        # optimizers would otherwise share (and each step) the same moments
        optim_state = {head_as_wte(name, part, back=True): value for name, value in state["optim"].items()}
        tied = getattr(part, "module", part).config.tie_head  # a DDP wrapper's module
        optim_state.update({name: value.clone() for name, value in optim_state.items() if tied
                            and name.split(".")[1:3] == ["lm_head", "weight"] and isinstance(value, torch.Tensor)})
        set_state_dict(part, optimizer, model_state_dict={k: v for k, v in state["model"].items() if k in own},
                       optim_state_dict=optim_state, options=FLAT)


def loss_context(mesh: DeviceMesh | None):
    """Around a forward and its backward: under tp, the cross-entropy on the vocabulary's shards."""
    return tp.loss_parallel() if mesh is not None and "tp" in mesh.mesh_dim_names else contextlib.nullcontext()


def clip_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The gradient's global norm (on the device), before clipping it to max_norm (0: no clipping)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    norm = grad_norm(grads, isinstance(params[0], DTensor), params[0].device)
    clip(grads, max_norm, norm)
    return norm


def compile_model(model: GPT) -> None:
    """torch.compile each block, and the head with its loss (head_loss), before any wrapping: each
    block apart, so that FSDP's hooks stay between them (one all-gather per block); the head and the
    loss apart from the rest, as the root module's forward holds FSDP's hooks for the embeddings and
    the tied head. Under --pp a last stage runs its own head, and the schedule its loss, uncompiled."""
    for block in model.blocks:
        block.compile()
    model.head_loss = torch.compile(model.head_loss)


def gradient_sync(model: torch.nn.Module, last_micro_step: bool):
    """What this backward communicates. DDP: no all-reduce until the last micro-step of an
    accumulation (no_sync), so once per optimizer step. FSDP: a reduce-scatter at every micro-step,
    so that each rank keeps only its shard of the gradients (without it, every rank would hold
    whole gradients until the last micro-step: the memory FSDP is there to save). HSDP: the same,
    and the all-reduce across replica groups only at the last micro-step. ddp at one rank: the model alone,
    nothing to communicate."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if last_micro_step else model.no_sync()
    if isinstance(model, FSDPModule):
        model.set_requires_all_reduce(last_micro_step)  # only HSDP's mesh has a replicate dimension to reduce over
    return contextlib.nullcontext()


def settle_buckets(model: DDP, x: torch.Tensor, autocast) -> None:
    """One backward of zeros, so that every real step uses the same gradient buckets. DDP's first
    backward all-reduces one bucket in the order the model defines its parameters, then it
    rebuilds its buckets in the order the gradients became ready; with 3 or more ranks, where a
    number sits in a bucket decides the order in which the ranks' values are added, and so its
    rounding. After this pass a fresh run and a resumed one step alike, bit for bit."""
    with autocast:
        logits = model(x)
    (logits.float().sum() * 0).backward()  # all-reduces zeros; no optimizer step follows
    model.zero_grad(set_to_none=True)
