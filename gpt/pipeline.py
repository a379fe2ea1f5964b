"""Pipeline parallel for gpt/train.py (--pp): the GPT cut into stages at block boundaries and run by any
schedule torch.distributed.pipelining ships, each stage laid out by parallelize.py (FSDP or HSDP, tensor parallel).

The ranks of one pipeline differ only in the mesh's "pp" dimension (outermost: on a cluster, a pipeline's
point-to-point sends are the traffic that crosses nodes best). Each holds one stage, or two for the interleaved
and V-shaped schedules; they read the same batch, whose --grad_accum micro-batches one schedule.step() runs.
The schedule divides the gradients by the number of micro-batches itself (scale_grads), so the loss of a
micro-batch is its plain mean. The embedding and the head, one matrix in one process, are two parameters here,
on the first and the last stage: drawn alike, their gradients summed after each step (tie_gradients), so that
AdamW updates them alike, bit for bit. Each stage keeps the whole model's parameter names, so a checkpoint's
names are the unstaged model's (parallelize.state_dict names the head's optimizer state as wte's, as one
process does), and any layout resumes it.
"""
import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import context
from model import GPT, GPTConfig, MoE, balancing_loss, rotary
from optimizer import clip, grad_norm

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # rank r holds stages r and 2p - 1 - r; the others, r and r + p
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # input's gradient first, weights' later


def schedule_class(schedule: str) -> type:
    """torch's class of that name. torch.distributed.pipelining is imported here, not at the top: it imports
    torch._dynamo, about 1.2 s of every process's start on a CPU, which only --pp's runs need."""
    from torch.distributed.pipelining.schedules import get_schedule_class
    return get_schedule_class(schedule)


def stages_per_rank(schedule: str) -> int:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    return 1 if issubclass(schedule_class(schedule), PipelineScheduleSingle) else 2


def stage_ids(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages rank pp_rank of a pipeline of pp ranks holds, as torch's schedules place them."""
    if stages_per_rank(schedule) == 1:
        return [pp_rank]
    return [pp_rank, 2 * pp - 1 - pp_rank] if schedule in V_SHAPED else [pp_rank, pp_rank + pp]


def holder(stage: int, pp: int, schedule: str) -> int:
    """The pipeline rank that holds `stage` (stage_ids' inverse)."""
    return stage % pp if schedule not in V_SHAPED or stage < pp else 2 * pp - 1 - stage


def bubble(schedule: str, pp: int, micro_batches: int) -> float:
    """The share of a step each rank waits, in the schedule's paper, forward and backward (or the backward's two
    halves) taking the same time on every stage: (p - 1) / (m + p - 1) for GPipe and 1F1B (p - 1 steps to fill
    and to drain the pipeline, m of work); (p - 1) / (v·m + p - 1) with v stages per rank, interleaved or looped
    (Megatron-LM, 2021: a fill of 1/v the length); 0 for the zero-bubble ones (Qi et al., 2024; DeepSeek's
    DualPipe): the weights' gradients, which nothing waits for, fill the waits once m >= 2p."""
    if schedule in SPLIT_BACKWARD:
        return 0.0
    v = stages_per_rank(schedule)
    return (pp - 1) / (v * micro_batches + pp - 1)


def check(args: argparse.Namespace, config: GPTConfig) -> None:
    """A pipeline the model or the schedule cannot run, refused before anything is written (ValueError, one line):
    a stage holds at least one block; the schedules' own rules on the number of micro-batches (--grad_accum)."""
    stages, m = args.pp * stages_per_rank(args.pp_schedule), args.grad_accum
    if config.n_layer < stages:
        raise ValueError(f"--pp {args.pp} with --pp_schedule {args.pp_schedule} cuts the model into {stages} stages "
                         f"of at least one block, and --model {args.model or args.init_from} has {config.n_layer}")
    least = stages if args.pp_schedule in ("1F1B", "DualPipeV") else 1  # torch's Schedule1F1B, ScheduleDualPipeV
    if m < least:
        raise ValueError(f"--pp_schedule {args.pp_schedule} at --pp {args.pp} ({stages} stages, {stages // args.pp} "
                         f"a rank) runs at least {least} micro-batches: --grad_accum {m} is too few")
    rounds = max(1, m // args.pp)  # torch's ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble
    if args.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        raise ValueError(f"--pp_schedule {args.pp_schedule} at --pp {args.pp} runs --grad_accum {m} micro-batches "
                         f"in {rounds} rounds (--grad_accum // --pp), which must divide them: give a multiple of "
                         f"--pp, for one, or fewer than {2 * args.pp}")


class Stage(nn.Module):
    """One stage of the GPT, under the whole model's parameter names: blocks [a, b), the embeddings on the first
    stage, the final norm and the head on the last (a tied head's lm_head.weight: the tied matrix's second copy)."""

    def __init__(self, model: GPT, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last, self.config = first, last, model.config
        self.cp_group = None  # --cp: context.context_parallel's
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        # the MoE layers, by their place among the model's (blocks first_dense on): the routing's rows
        self.moe = {i - model.config.first_dense: model.blocks[i].mlp for i in blocks
                    if isinstance(model.blocks[i].mlp, MoE)}
        if last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head if not model.config.tie_head else nn.Linear(
                model.config.n_embd, model.config.vocab_size, bias=False, device="meta")

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None) -> torch.Tensor | tuple:
        """x: token ids (batch, seq), or the previous stage's output; the logits, or the activations to send. A
        mixture of experts in training sends `routing` along, (2, n_expert): the choices and the probabilities of
        the micro-batch's tokens for each expert, summed over the MoE layers so far, for the auxiliary loss the
        last stage adds (Pipeline.loss: it couples every layer's), its gradient sent back with x's."""
        # every token's position, the whole sequence's (under tp, a stage's input holds 1/tp of it); --cp: this cp
        # rank's tokens' (the Pipeline cut the batch to them)
        cp = self.cp_group
        positions = torch.arange(self.config.seq_len, device=x.device) if cp is None else context.positions(
            self.config.seq_len, cp.size(), cp.rank(), x.device)
        if self.first:
            x = self.wte(x) + self.wpe(positions) if self.wpe is not None else self.wte(x)
        rope = rotary(self.config, positions) if self.config.family == "llama" else None  # as GPT.embed
        for block in self.blocks.values():
            x = block(x, rope=rope)
        out = self.lm_head(self.ln_f(x)) if self.last else x
        if not (self.config.n_expert and self.training):
            return out
        if routing is None:  # the first stage's, whose blocks may all be dense
            routing = torch.zeros(2, self.config.n_expert, device=x.device)
        for layer in self.moe.values():
            routing = routing + torch.stack(layer.routed[:2])
        return out, routing


def stages(model: GPT, mesh: DeviceMesh, args: argparse.Namespace) -> tuple[list[Stage], list[int]]:
    """(this rank's stages, their numbers): the blocks split as evenly as they go, the first stages taking one
    more where they do not divide."""
    pp, rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    count = pp * stages_per_rank(args.pp_schedule)
    n = model.config.n_layer
    bounds = [s * (n // count) + min(s, n % count) for s in range(count + 1)]
    ids = stage_ids(rank, pp, args.pp_schedule)
    return [Stage(model, range(bounds[s], bounds[s + 1]), s == 0, s == count - 1) for s in ids], ids


def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The schedule's loss: the mean over a micro-batch's tokens (the schedule then divides the gradients by the
    number of micro-batches: their mean), in fp32; in evaluate(), the sum, padding's targets (-100) left out."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: under tensor parallel, loss_parallel's is a DTensor, the same on every tp rank."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class Optimizers:
    """One optimizer per stage (a stage's state dict is its module's and its optimizer's), stepped as one."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:  # read each time: a resume's load_state_dict makes new ones
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class Pipeline:
    """This rank's stages (laid out by parallelize.parallelize_gpt) and the schedule that runs them."""

    def __init__(self, parts: list[Stage], ids: list[int], mesh: DeviceMesh, args: argparse.Namespace,
                 device: torch.device, dtype: torch.dtype, loss_context) -> None:
        # dtype: the compute dtype; loss_context(): parallelize.loss_context's
        self.parts, self.mesh, self.micro_batches, self.loss_context = parts, mesh, args.grad_accum, loss_context
        self.count = count = mesh["pp"].size() * len(ids)
        self.by_stage = dict(zip(ids, parts, strict=True))
        self.holder = [holder(s, mesh["pp"].size(), args.pp_schedule) for s in range(count)]
        self.pp_rank = mesh["pp"].get_local_rank()
        # what a stage sends the next: (batch, seq / cp / tp, n_embd) in the compute dtype (FSDP's param_dtype)
        tp_size, cp_size = (mesh[name].size() if name in mesh.mesh_dim_names else 1 for name in ("tp", "cp"))
        self.activation = ((args.batch_size, args.seq_len // cp_size // tp_size, parts[0].config.n_embd), dtype,
                           device)
        self.cp_group = mesh["cp"].get_group() if cp_size > 1 else None
        group = mesh["pp"].get_group()
        from torch.distributed.pipelining import PipelineStage  # here: see schedule_class
        self.stages = [PipelineStage(part, i, count, device, group=group) for part, i in zip(parts, ids, strict=True)]
        # What each stage computes, and when: timed() wraps each stage's three kinds of work (torch's schedules
        # call them), so that report() can tell the time this rank waited and the micro-batches a stage held.
        self.busy = self.wall = 0.0
        self.held, self.peak = dict.fromkeys(ids, 0), dict.fromkeys(ids, 0)
        self.timeline, self.started = [], 0.0
        for stage in self.stages:
            self.timed(stage)
        schedule = schedule_class(args.pp_schedule)
        self.config, self.tokens = parts[0].config, args.batch_size * args.seq_len  # a micro-batch's (a cp group's)
        # a mixture of experts: this rank's stages' routing since the last optimizer step, and since the last log
        # line, as GPT.tally's (the model's layers that other ranks hold at 0), for parallelize.moe_step
        self.routing = self.interval = None
        self.schedule = schedule(self.stages[0] if len(ids) == 1 else self.stages, n_microbatches=args.grad_accum,
                                 loss_fn=self.loss)  # scale_grads=True: the gradients of the micro-batches' mean
        self.first, self.last = 0 in ids, count - 1 in ids
        # The tied matrix: wte.weight on the first stage, lm_head.weight on the last. Its gradients are added
        # between the two ranks that hold them (the same rank in a V), the other dimensions' coordinates alike.
        tied = parts[0].config.tie_head  # untied: the head is a matrix of its own, on the last stage only
        self.tied = [part.wte.weight for part in parts if part.first and tied] + [
            part.lm_head.weight for part in parts if part.last and tied]
        self.head = next((part.lm_head.weight for part in parts if part.last and tied), None)
        self.tie_group = None
        ranks = mesh.mesh.reshape(mesh["pp"].size(), -1)  # (pp, the other dimensions' ranks)
        holders = (self.holder[0], self.holder[count - 1])
        if holders[0] != holders[1] and tied:
            for column in range(ranks.shape[1]):  # every rank creates every group, in the same order
                pair = dist.new_group([int(ranks[h, column]) for h in holders])
                if dist.get_rank() in ranks[:, column][list(holders)].tolist():
                    self.tie_group = pair
        self.pp_group = group

    def loss(self, output: torch.Tensor | tuple, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: loss()'s, plus with experts aux_loss_coef times the auxiliary loss of the
        micro-batch's routing summed over every stage (Stage.forward), as GPT.forward adds it in one process."""
        if not isinstance(output, tuple):
            return loss(output, targets)
        logits, routing = output
        ce = loss(logits, targets)
        # --cp: the routing's sums are the cp group's (context.moe_forward), over its ranks' targets
        tokens = targets.numel() * (self.cp_group.size() if self.cp_group is not None else 1)
        aux = self.config.aux_loss_coef * balancing_loss(self.config, routing[0].detach(), routing[1], tokens)
        return ce + (DTensor.from_local(aux, ce.device_mesh, ce.placements) if isinstance(ce, DTensor) else aux)

    def moe_layers(self) -> dict[int, MoE]:
        """This rank's MoE layers, by their place among the model's."""
        return {i: layer for part in self.parts for i, layer in part.moe.items()}

    def tally(self, index: int, output: torch.Tensor | tuple) -> None:
        """After stage `index`'s forward of a micro-batch in training: its layers' choices and drops added to
        self.routing at their places (GPT.tally's layout), and on the last stage the auxiliary loss and 1."""
        c = self.config
        if not (c.n_expert and isinstance(output, tuple)):
            return
        n = c.n_layer - c.first_dense
        if self.routing is None:
            self.routing = torch.zeros(n * c.n_expert + n + 2, device=output[1].device)
        with torch.no_grad():
            for i, layer in self.by_stage[index].moe.items():
                self.routing[i * c.n_expert:(i + 1) * c.n_expert] += layer.routed[0]
                self.routing[n * c.n_expert + i] += layer.routed[2]
            if index == self.count - 1:
                self.routing[-2] += balancing_loss(c, output[1][0], output[1][1], self.tokens)
                self.routing[-1] += 1

    def parameters(self):
        return (param for part in self.parts for param in part.parameters())

    def train(self, mode: bool = True) -> None:
        for part in self.parts:
            part.train(mode)

    def eval(self) -> None:
        self.train(False)

    def cut(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """--cp: the whole sequences' ids and targets cut to this cp rank's tokens (context.positions)."""
        cp = self.cp_group
        if cp is None:
            return x, y
        where = context.positions(x.shape[1], cp.size(), cp.rank(), x.device)
        return x[:, where], y[:, where]

    def inputs(self, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, torch.Tensor | None]:
        x, y = self.cut(x, y)
        return ((x,) if self.first else ()), (y if self.last else None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step's forwards and backwards over the batch (x, y) in --grad_accum micro-batches; the
        mean of their losses on the last stage (0 elsewhere)."""
        losses = []
        args, target = self.inputs(x, y)
        self.timeline, self.started = [], time.perf_counter()
        with self.loss_context():
            self.schedule.step(*args, target=target, losses=losses)
        self.wall += time.perf_counter() - self.started
        self.tie_gradients()
        if not losses:
            return torch.zeros((), device=x.device)
        return torch.stack([local(loss.detach()) for loss in losses]).sum() / self.micro_batches

    def timed(self, stage) -> None:
        """Stage's forward (F), backward (B; I: the input's gradient alone) and weights' backward (W), each
        timed into self.busy and self.timeline; self.held counts the micro-batches whose activations the stage
        keeps (from F to B, or to W where the backward is split), self.peak the most at once."""
        index = stage.stage_index

        def wrap(method, kind: str):
            def run(*args, **kwargs):
                start = time.perf_counter()
                out = method(*args, **kwargs)
                end = time.perf_counter()
                if kind == "F":
                    self.tally(index, out)
                done = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
                micro = args[0] if args else next(iter(kwargs.values()))  # torch's schedules: the chunk id first
                self.held[index] += {"F": 1, "B": -1, "I": 0, "W": -1}[done]
                self.peak[index] = max(self.peak[index], self.held[index])
                self.busy += end - start
                self.timeline.append((index, done, micro, start - self.started, end - self.started))
                return out
            return run

        stage.forward_one_chunk = wrap(stage.forward_one_chunk, "F")
        stage.backward_one_chunk = wrap(stage.backward_one_chunk, "B")
        stage.backward_weight_one_chunk = wrap(stage.backward_weight_one_chunk, "W")

    def report(self) -> list[dict]:
        """Each rank of this rank's pipeline, in pipeline order: the share of its time in step() that it waited
        (not computing) since the last report, the most micro-batches each of its stages held, and its last
        step's timeline [stage, kind, micro-batch, start, end] (seconds). One all_gather_object over the pipeline."""
        mine = {"wait": 1 - self.busy / self.wall if self.wall else 0.0,
                "held": {str(s): n for s, n in self.peak.items()},
                "timeline": [[s, kind, i, round(a, 6), round(b, 6)] for s, kind, i, a, b in self.timeline]}
        everyone = [None] * self.mesh["pp"].size()
        dist.all_gather_object(everyone, mine, group=self.pp_group)
        self.busy = self.wall = 0.0
        return everyone

    def tie_gradients(self) -> None:
        """wte's and lm_head's gradients both made their sum: the tied matrix's gradient in one process."""
        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in self.tied]
        if len(grads) == 2:  # both on this rank
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
        elif grads:
            dist.all_reduce(grads[0], group=self.tie_group)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """The sum of the losses of (x, y)'s tokens whose target is not -100, on the last stage (None elsewhere):
        each micro-batch through the stages in turn, their outputs sent on (dist.send), nothing run alongside.
        Not the schedule's eval(): in torch 2.13 it runs the V-shaped schedules' backward actions, and fails."""
        (x, y), total, group = self.cut(x, y), None, self.pp_group
        for xs, ys in zip(x.split(self.activation[0][0]), y.split(self.activation[0][0]), strict=True):
            out = xs
            for s in range(self.count):
                if self.holder[s] != self.pp_rank:
                    continue
                if s > 0 and self.holder[s - 1] != self.pp_rank:  # the previous stage is another rank's
                    out = torch.empty(self.activation[0], dtype=self.activation[1], device=self.activation[2])
                    dist.recv(out, group=group, group_src=self.holder[s - 1])
                out = self.by_stage[s](out)
                if s == self.count - 1:
                    with self.loss_context():
                        total = local(loss(out, ys, reduction="sum")).double() + (0 if total is None else total)
                elif self.holder[s + 1] != self.pp_rank:
                    dist.send(out.contiguous(), group=group, group_dst=self.holder[s + 1])
        return total

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """As parallelize.clip_gradients, over every stage: each rank's squared norm (the head's copy of the tied
        matrix left out: counted once) added over the pipeline, then every gradient clipped by the one norm."""
        grads = [p.grad for p in self.parameters() if p.grad is not None and p is not self.head]
        norm = grad_norm(grads, True, next(self.parameters()).device, across=self.pp_group)
        clip([p.grad for p in self.parameters() if p.grad is not None], max_norm, norm)
        return norm

    def full_state_dict(self) -> dict | None:
        """The whole model's state (the unstaged names, on the CPU) on rank 0, None elsewhere: every rank
        gathers its stages' full tensors, and the first rank of each pipeline stage's other dimensions sends."""
        state = {}
        for part in self.parts:
            full = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            state.update({name: tensor.cpu() for name, tensor in full.items()})
        sender = all(self.mesh[name].get_local_rank() == 0 for name in self.mesh.mesh_dim_names if name != "pp")
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state if sender else None, gathered, dst=0)
        if gathered is None:
            return None
        return {name: tensor for states in gathered if states for name, tensor in states.items()}
