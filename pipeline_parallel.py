"""Pipeline parallel by hand: the GPT's blocks cut into one stage per rank, fed micro-batches, GPipe, 1F1B, zero bubble.

docs/pipeline_parallel.md. Each rank holds a run of blocks (the first also the embeddings, the last the output
layer); activations go forward and their gradients back with send/recv. GPipe runs every micro-batch's forward,
then every backward; 1F1B starts the backwards as soon as it can, so a stage keeps at most P micro-batches'
activations. Zero bubble (ZB-H1) splits each backward in two: the gradient for the stage's input, which the stage
before waits for, then later the gradient for its weights, which fills the waits (docs/zero_bubble.md). Each rank
records when it computes; the idle fraction is printed beside the formula. One step is checked against one process,
then torch.distributed.pipelining's schedule, then the model trains.

    torchrun --standalone --nproc-per-node 4 pipeline_parallel.py --schedule 1f1b --micro_batches 8
    torchrun --standalone --nproc-per-node 4 pipeline_parallel.py --schedule zb --micro_batches 8
    torchrun --standalone --nproc-per-node 2 pipeline_parallel.py --schedule gpipe --plot pipeline.png
"""
import argparse
import copy
import importlib.util
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  first: imported later, it holds the group at exit
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

from gpt.model import GPT, GPTConfig

TOLERANCE = 1e-5  # fp32: micro-batches' gradients are added one by one, where one process sums the batch at once
VOCAB_SIZE = 96  # token ids drawn at random below it


class Stage(nn.Module):
    """This rank's part of the GPT, under the whole model's parameter names: its run of blocks, the embeddings
    on the first stage, the final norm and the output layer on the last."""

    def __init__(self, model: GPT, rank: int, world_size: int) -> None:
        super().__init__()
        n, self.first, self.last = len(model.blocks), rank == 0, rank == world_size - 1
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(rank * n // world_size,
                                                                             (rank + 1) * n // world_size)})
        if self.first:
            self.wte, self.wpe = model.wte, model.wpe
        if self.last:  # lm_head.weight is wte.weight (tied): the first and the last stage each hold a copy
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # token ids (batch, seq), or the activations before
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x  # (batch, seq, vocab) logits, or (batch, seq, d)


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[tuple[str, int]]:
    """This stage's work in order: ("F", i) is micro-batch i's forward, ("B", i) its backward; under zb ("B", i) is
    the gradient for the stage's input only, and ("W", i) the gradient for its weights."""
    m = micro_batches
    if name == "gpipe":  # all forwards, then all backwards: every micro-batch's activations kept at once
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(stages - stage - 1, m)  # 1F1B: the forwards that fill the stages after this one
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # then one forward, one backward: a backward frees a micro-batch's activations
        order += [("F", warmup + i), ("B", i)]
    order += [("B", i) for i in range(m - warmup, m)]
    if name == "1f1b":
        return order
    zb = []  # ZB-H1: 1F1B's order, stage s holding back s weight passes: micro-batch i's after i + s's input pass
    for kind, i in order:
        zb += [(kind, i)] + ([("W", i - stage)] if kind == "B" and i >= stage else [])
    return zb + [("W", i) for i in range(max(m - stage, 0), m)]  # the last s: into the wait at the end


def p2p(op, tensor: torch.Tensor, peer: int) -> dist.Work:
    """One send or receive, started: batch_isend_irecv can start several together (NCCL needs that for pairs)."""
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])[0]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # the mean over one micro-batch's tokens


def weight_pass(waiting: list) -> None:
    """Zero bubble's second half: each module's weight gradients from the gradient of its output, saved by the input
    pass. Autograd runs from that output to those weights only (the input's path is needed by none of them)."""
    for module, out, grad in waiting:
        weights = list(module.parameters(recurse=False))
        for weight, part in zip(weights, torch.autograd.grad(out, weights, grad), strict=True):
            weight.grad = part if weight.grad is None else weight.grad + part


def run_schedule(stage: Stage, order: list, inputs: list, targets: list, rank: int, shape: tuple) -> tuple:
    """One step: every micro-batch forward and backward in `order`, gradients adding up in .grad. Returns
    (the batch's loss on the last stage, [(kind, start, end)] of each computation, most micro-batches kept)."""
    kept, received, sends, timeline, loss, most = {}, {}, [], [], 0.0, 0
    split, outputs, waiting = any(kind == "W" for kind, _ in order), {}, {}  # zero bubble: the weight pass apart
    owners = [module for module in stage.modules() if any(True for _ in module.parameters(recurse=False))]
    # Each weight's module output, where its weight pass starts, kept under the micro-batch whose forward runs: the
    # hook reads `i` when it fires (the loop's below), not when it is made.
    hooks = [module.register_forward_hook(lambda module, _, out: outputs[i].append((module, out)))
             for module in owners] if split else []
    for kind, i in order:
        if kind == "F":
            x, outputs[i] = inputs[i] if stage.first else torch.empty(shape), []
            if not stage.first:
                p2p(dist.irecv, x, rank - 1).wait()  # the previous stage's output: waiting here is the bubble
                x.requires_grad_()
            start, received[i] = time.perf_counter(), x
            kept[i] = loss_fn(stage(x), targets[i]) / len(targets) if stage.last else stage(x)  # a mean of m means
            timeline.append(("F", start, time.perf_counter()))
            if stage.last:
                loss += kept[i].item()
            else:  # not waited for: a send that waited for its receive could deadlock 1F1B
                sends.append(p2p(dist.isend, kept[i].detach(), rank + 1))
            most = max(most, len(kept) + len(waiting))
        elif kind == "B":
            grad = None if stage.last else torch.empty(shape)
            if not stage.last:
                p2p(dist.irecv, grad, rank + 1).wait()  # d loss / d (this stage's output i), from the next stage
            start = time.perf_counter()
            if split:  # through the stage to its input, and to each module's output on the way, no weight's gradient
                modules, outs = zip(*outputs.pop(i), strict=True)
                grads = torch.autograd.grad(kept.pop(i), ([] if stage.first else [received[i]]) + list(outs), grad,
                                            retain_graph=True)  # the graph is kept for the weight pass
                waiting[i] = list(zip(modules, outs, grads[-len(outs):], strict=True))
                if not stage.first:
                    received[i].grad = grads[0]
            else:
                torch.autograd.backward(kept.pop(i), grad)  # frees micro-batch i's activations
            timeline.append(("B", start, time.perf_counter()))
            if not stage.first:
                sends.append(p2p(dist.isend, received.pop(i).grad, rank - 1))
        else:
            start = time.perf_counter()
            weight_pass(waiting.pop(i))  # frees micro-batch i's activations
            timeline.append(("W", start, time.perf_counter()))
    for hook in hooks:
        hook.remove()
    for work in sends:
        work.wait()
    return loss, timeline, most


def sum_tied_gradients(stage: Stage, group: dist.ProcessGroup) -> None:
    """The output layer's weight is the embedding's: the first stage has one part of its gradient, the last the
    other. Each adds the other's (Megatron's embedding group), so both copies take the same step."""
    if stage.first or stage.last:
        dist.all_reduce((stage.wte if stage.first else stage.lm_head).weight.grad, group=group)


def torch_schedule(stage: Stage, name: str, tokens: torch.Tensor, targets: torch.Tensor, rank: int,
                   world_size: int, micro_batches: int) -> float:
    """The same step with torch.distributed.pipelining, which cuts the batch itself and infers the shapes."""
    pipe = PipelineStage(stage, rank, world_size, torch.device("cpu"))
    runner = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zb": ScheduleInterleavedZeroBubble}[name](
        [pipe] if name == "zb" else pipe, micro_batches, loss_fn=loss_fn)  # zb: torch's ZB1P, one stage a rank
    losses = []  # scale_grads=True (the default) divides the gradients by the micro-batches: the batch's mean
    runner.step(*[tokens] if stage.first else [], target=targets if stage.last else None, losses=losses)
    return sum(loss.item() for loss in losses) / micro_batches if stage.last else 0.0


def gradient_error(stage: Stage, reference: GPT) -> float:
    whole = dict(reference.named_parameters(remove_duplicate=False))  # lm_head.weight: the tied wte.weight
    return torch.stack([(p.grad - whole[name].grad).abs().max() for name, p in stage.named_parameters()]).max().item()


def idle_fraction(timelines: list[list]) -> tuple[float, float]:
    """The mean over the ranks of the time each spent not computing, between the step's first start and last end;
    and that span, in seconds."""
    start, end = min(t[0][1] for t in timelines), max(t[-1][2] for t in timelines)
    return 1 - sum(sum(e - s for _, s, e in t) for t in timelines) / len(timelines) / (end - start), end - start


def plot(timelines: list[list], path: str, title: str) -> None:
    import matplotlib  # the optional extra: requirements-plot.txt

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(t[0][1] for t in timelines)
    figure, axes = plt.subplots(figsize=(10, 0.6 * len(timelines) + 1))
    for rank, timeline in enumerate(timelines):
        for kind, s, e in timeline:
            axes.broken_barh([(1e3 * (s - start), 1e3 * (e - s))], (rank - 0.4, 0.8), edgecolor="white",
                             color={"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}[kind])
    axes.set(yticks=range(len(timelines)), yticklabels=[f"stage {r}" for r in range(len(timelines))],
             xlabel="ms (blue: forward, orange: backward, green: weight pass, blank: waiting)", title=title)
    axes.invert_yaxis()
    figure.savefig(path, dpi=100, bbox_inches="tight")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "zb"],
                        help="the order of the work; zb: zero bubble (ZB-H1)")
    parser.add_argument("--micro_batches", type=int, default=4, help="m: the batch is cut into m equal parts")
    parser.add_argument("--batch_size", type=int, default=16, help="sequences per step: a multiple of m")
    parser.add_argument("--n_layer", type=int, default=8, help="blocks, cut into one run per rank")
    parser.add_argument("--n_head", type=int, default=4, help="attention heads")
    parser.add_argument("--n_embd", type=int, default=64, help="width: a multiple of n_head")
    parser.add_argument("--seq_len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="training steps after the check")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--plot", default=None, help="draw the last step's schedule per rank to this PNG")
    args = parser.parse_args()
    for name in ("micro_batches", "batch_size", "n_layer", "n_head", "n_embd", "seq_len", "lr"):
        if not 0 < getattr(args, name) < 1e5:  # also refuses nan
            parser.error(f"--{name} must be above 0 and below 1e5, got {getattr(args, name)}")
    if args.batch_size % args.micro_batches or args.n_embd % args.n_head:
        parser.error(f"--micro_batches {args.micro_batches} must divide --batch_size {args.batch_size}"
                     if args.batch_size % args.micro_batches else f"--n_head {args.n_head} must divide --n_embd")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # the optional extra
        parser.error("--plot needs matplotlib: pip install -r requirements-plot.txt")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):  # found now, not after the run
        parser.error(f"--plot {args.plot}: no such folder")
    if args.steps < 0 or args.plot and args.steps == 0:
        parser.error(f"--steps must be 0 or more (1 or more with --plot), got {args.steps}")
    return args


def train(args: argparse.Namespace, rank: int, world_size: int) -> Stage:
    """Check one step of each schedule, by hand and torch's, against one process; then train beside it."""
    reference = GPT(GPTConfig(VOCAB_SIZE, args.seq_len, args.n_layer, args.n_head, args.n_embd))
    reference.init_weights(seed=0)  # the same weights on every rank, drawn from the seed: no broadcast needed
    stage, torch_stage = (Stage(copy.deepcopy(reference), rank, world_size) for _ in range(2))
    tokens = torch.randint(VOCAB_SIZE, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y, m = tokens[:, :-1], tokens[:, 1:], args.micro_batches  # the same batch on every rank
    loss_fn(reference(x), y).backward()
    tied = dist.new_group([0, world_size - 1])  # every rank takes part in creating a group, even one not in it
    order, shape = schedule(args.schedule, rank, world_size, m), (args.batch_size // m, args.seq_len, args.n_embd)
    _, _, most = run_schedule(stage, order, x.chunk(m), y.chunk(m), rank, shape)
    sum_tied_gradients(stage, tied)
    torch_schedule(torch_stage, args.schedule, x, y, rank, world_size, m)
    sum_tied_gradients(torch_stage, tied)
    errors = gradient_error(stage, reference), gradient_error(torch_stage, reference)
    print(f"[rank {rank}/{world_size}] stage {rank}, blocks {', '.join(stage.blocks)}: by hand {errors[0]:.1e}, "
          f"torch's {errors[1]:.1e} from one process | at most {most} of {m} micro-batches' activations kept\n",
          end="", flush=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=args.lr) for model in (stage, reference)]
    for step in range(args.steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        dist.barrier()  # the ranks start the step together: the timeline's zero
        loss, timeline, _ = run_schedule(stage, order, x.chunk(m), y.chunk(m), rank, shape)
        sum_tied_gradients(stage, tied)
        optimizers[0].step()
        timelines = [None] * world_size
        dist.all_gather_object(timelines, timeline)  # every rank: a collective behind `if` would hang
        if stage.last:  # the loss lives on the last stage; the reference trains there too, after the timed step
            (reference_loss := loss_fn(reference(x), y)).backward()
            optimizers[1].step()
            k = 3 if args.schedule == "zb" else 1  # zb: a forward, an input and a weight pass of equal time
            idle, span = idle_fraction(timelines)
            print(f"step {step} | loss {loss:.6f} (one process: {reference_loss.item():.6f}) | idle {idle:.2f} of "
                  f"{1e3 * span:.0f} ms, (p-1)/({'3' * (k == 3)}m+p-1) = "
                  f"{(world_size - 1) / (k * m + world_size - 1):.2f}", flush=True)
    if rank == 0 and args.plot and args.steps:
        plot(timelines, args.plot, f"{args.schedule}, {world_size} stages, {m} micro-batches")
    if any(not error <= TOLERANCE for error in errors):  # not >: a NaN passes no comparison
        raise SystemExit(f"error: rank {rank} differs from one process by {errors[0]:.1e} by hand, {errors[1]:.1e} "
                         f"torch's (tolerance {TOLERANCE})")
    return stage


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # torchrun sets these in every process
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 2 pipeline_parallel.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 1 < world_size <= args.n_layer:
        raise SystemExit(f"error: {world_size} ranks: a pipeline needs 2 or more, and a block for each (--n_layer "
                         f"{args.n_layer})")
    if args.schedule != "gpipe" and args.micro_batches < world_size:  # ValueError in torch's Schedule1F1B
        raise SystemExit(f"error: {args.schedule} needs a micro-batch per stage or more: --micro_batches {world_size} "
                         "at least")
    rounds = args.micro_batches // world_size  # torch's zero bubble, checked beside zb: a ValueError otherwise
    if args.schedule == "zb" and args.micro_batches % rounds:
        raise SystemExit(f"error: torch's zero bubble, checked beside zb, runs rounds of m // {world_size} ranks: "
                         f"--micro_batches {args.micro_batches} is not a multiple of its {rounds}")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:  # destroy also when training raises
        train(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
