"""gpt/train.py: N ranks train what one process trains, in every layout; the documented run reaches
the floor; text files and nanoGPT folders load; metrics.jsonl holds what the lines print.

The runs go through tests/harness.torchrun_in_process: each rank's main() in a forked worker with
torchrun's variables, the same code path as `torchrun --standalone --nproc-per-node N gpt/train.py`.
"""
import argparse
import contextlib
import functools
import importlib
import io
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import workers
from docs_blocks import rerun, succeeded
from harness import spawn, torchrun_in_process
from launch import REPO, TORCHRUN, run
from test_errors import run_main

sys.path.insert(0, str(REPO))  # gpt.model and gpt.data, which import nothing of the project
from gpt.data import load  # noqa: E402
from gpt.model import CONFIGS, GPT, GPTConfig  # noqa: E402

TRAIN = "gpt/train.py"
# 8 steps of a global batch of 12 sequences of 32 tokens, logged every step; warmup and cosine in reach.
ARGV = ["--max_steps", "8", "--seq_len", "32", "--warmup_steps", "3", "--log_every", "1", "--eval_every", "4",
        "--val_tokens", "512", "--lr", "3e-3"]
# (ranks, --batch_size, --grad_accum): the same 12 sequences per step, split three ways and one more.
SPLITS = [(1, 2, 6), (2, 2, 3), (3, 2, 2)]
HSDP_SPLIT = (4, 1, 3)
TP_SPLIT = (6, 2)  # tp 2 alone, one data-parallel rank: few micro-steps (tp's, many small collectives, are slow here)
# fp32, yet not bitwise: a sum over 12 sequences is added in another order when they are split over
# other ranks and micro-steps (the all-reduce adds per-rank sums; accumulation adds micro-step sums).
# Measured after 8 AdamW steps at lr 3e-3: up to 1.2e-7 relative in the loss, 1.1e-5 in a weight
# (Adam divides by the root of the squared gradient, which magnifies tiny differences); a run
# without the gradient reduction is off by 2e-2 in both.
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 5e-5
# Under QK-norm (Qwen3) the loss does not change with the scale of a head's q or k, so each head's q and k weights
# get a gradient with no component along themselves: entries that cancel to near zero, where Adam's division by
# their own root mean square magnifies rounding. Measured at 3 ranks on an AMD EPYC: one entry of 4,096 in a k
# weight 6.3e-5 from one process's (2% of lr 3e-3; within 5e-5 on an Intel Xeon); without the reduction, 2e-2.
# The v weights too: at cp 3 (tests/test_gpt_context.py, qwen3-tiny) one entry of 4,096 in a v weight was 7.9e-5
# off, the same in the ring's sums and the all-gather's (the losses and gradient norms within 1e-5); broken, 2e-2.
QK_ATOL = 2e-4
FOLDERS = tempfile.TemporaryDirectory()  # each run's out_dir and export, removed with the session


@functools.cache
def train(nproc: int, *argv: str) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    """(metrics.jsonl's records, the exported weights, rank 0's stdout) of one run, in a fresh folder."""
    return train_script(TRAIN, nproc, *argv)


@functools.cache
def train_script(script: str, nproc: int, *argv: str) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    folder = Path(tempfile.mkdtemp(dir=FOLDERS.name))
    result = torchrun_in_process(nproc, script, *argv, "--out_dir", "out", "--export", "model.pt", cwd=folder,
                                 timeout=120)
    assert result.codes == [0] * nproc, f"{result.codes}\n{result.stdout}\n{result.stderr}"
    records = strict_records(folder / "out" / "metrics.jsonl")
    return records, GPT.load(str(folder / "model.pt")).state_dict(), result.stdouts[0]


def strict_records(path: Path) -> list[dict]:
    """metrics.jsonl's records, read as strict JSON: Infinity or NaN in a line fails."""
    def refuse(constant: str):
        raise ValueError(f"{path}: {constant} is not JSON")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def overflowing_fp16(rank: int, world_size: int, out_dir: str) -> str:
    """train.py's stdout of 3 fp16 steps whose scaler starts at 2**127 (torch's: 2**16): every step's scaled
    loss overflows, even in fp32, so the scaler skips them all."""
    gpt_train = import_gpt()
    scaler = torch.amp.GradScaler.__init__
    torch.amp.GradScaler.__init__ = lambda self, *a, **k: scaler(self, *a, **{**k, "init_scale": 2.0 ** 127})
    args = gpt_train.parse_args(["--precision", "fp16", "--max_steps", "3", "--log_every", "1", "--out_dir", out_dir])
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        gpt_train.train_and_export(args, rank, world_size, torch.device("cpu"))
    return stdout.getvalue()


def test_fp16s_skipped_steps_are_null_in_metrics_jsonl(tmp_path):
    """A step that fp16's scaler skips has a gradient norm that is not finite (here nan: inf scaled by 1/inf):
    printed as such, written as null (Python's json would write NaN or Infinity, which strict readers refuse)."""
    results, _ = spawn(overflowing_fp16, 1, str(tmp_path), timeout=60)
    assert results[0].count("grad_norm nan") == 3, results[0]
    records = strict_records(tmp_path / "metrics.jsonl")
    assert [r.get("grad_norm", "none") for r in records] == [None, None, None, "none"]  # the last: val_loss's line


def test_the_workers_start_from_the_servers_warmup():
    """The fork server's preloads (tests/harness.py), which it skips in silence when one fails to import: a worker
    starts with DeepSpeed imported, gpt/'s synthetic tokens drawn and torch's objects frozen out of gc's way."""
    (seen,), _ = spawn(workers.warmed_up, 1)
    assert seen["deepspeed"] and seen["synthetic drawn"] and seen["frozen"] > 10_000, seen


def run_split(parallel: str, nproc: int, batch_size: int, grad_accum: int, *extra: str):
    return train(nproc, *ARGV, "--parallel", parallel, "--batch_size", str(batch_size),
                 "--grad_accum", str(grad_accum), *extra)


def assert_same_training(reference, other, what: str) -> None:
    ref_records, ref_weights, _ = reference
    records, weights, _ = other
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    ref_losses = [(r["step"], r["loss"]) for r in ref_records if "loss" in r]
    assert [s for s, _ in losses] == [s for s, _ in ref_losses] == list(range(1, 9)), what
    np.testing.assert_allclose([v for _, v in losses], [v for _, v in ref_losses], rtol=LOSS_RTOL, err_msg=what)
    norms, ref_norms = ([r["grad_norm"] for r in rs if "loss" in r] for rs in (records, ref_records))
    np.testing.assert_allclose(norms, ref_norms, rtol=LOSS_RTOL, err_msg=what)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    np.testing.assert_allclose(val, [r["val_loss"] for r in ref_records if "val_loss" in r], rtol=LOSS_RTOL)
    assert weights.keys() == ref_weights.keys()
    qk_norm = any(name.endswith("attn.q_norm.weight") for name in weights)
    for name in weights:
        qkv = name.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight"))
        atol = QK_ATOL if qk_norm and qkv else WEIGHT_ATOL
        torch.testing.assert_close(weights[name], ref_weights[name], rtol=0, atol=atol, msg=f"{what}: {name}")


def one_process():
    return run_split("ddp", *SPLITS[0])


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("split", SPLITS[1:], ids=lambda s: f"{s[0]}ranks")
def test_n_ranks_train_what_one_process_trains(parallel, split):
    reference = one_process()
    losses = [r["loss"] for r in reference[0] if "loss" in r]
    assert losses[-1] < losses[0] - 0.1  # it learned something
    assert_same_training(reference, run_split(parallel, *split), f"{parallel} at {split[0]} ranks")


def test_fsdp_at_one_rank_trains_what_ddp_does():
    assert_same_training(one_process(), run_split("fsdp", *SPLITS[0]), "fsdp at 1 rank")


def test_hsdp_on_a_2_by_2_mesh_trains_what_one_process_trains():
    records, weights, stdout = run_split("hsdp", *HSDP_SPLIT, "--shard_size", "2")
    assert "hsdp on 4 ranks" in stdout
    assert_same_training(one_process(), (records, weights, stdout), "hsdp 2 × 2")


def test_tensor_parallel_trains_what_one_process_trains():
    """--tp 2 alone (2 ranks reading one batch) and hsdp 2 × 2 × tp 2 (8 ranks), each with --grad_accum: the
    losses, gradient norms and exported weights of one process on the same 12 sequences a step (fsdp 2 × tp 2:
    inside test_pipeline_parallel_trains_what_one_process_trains' pp 2 × fsdp 2 × tp 2)."""
    tp_alone = run_split("fsdp", 2, *TP_SPLIT, "--tp", "2")
    assert "fsdp on 2 ranks (shard 1 × tp 2)" in tp_alone[2]
    assert_same_training(one_process(), tp_alone, "tp 2")
    three = run_split("hsdp", 8, 3, 1, "--shard_size", "2", "--tp", "2")
    assert "hsdp on 8 ranks (replicate 2 × shard 2 × tp 2)" in three[2]
    assert_same_training(one_process(), three, "hsdp 2 × 2 × tp 2")


# Half precision, tp 2 against one process in the same precision: how the split rounds is then as large as the
# precision itself. Measured over the 8 steps: bf16 5.6e-5 relative in a loss, 2.6e-3 in a gradient norm, 1.7e-2 in
# a weight (Adam magnifies); fp16 2.2e-5, 1.5e-3, 9.6e-3; one process in bf16 against fp32: 9.1e-5, 4.9e-3, 1.2e-2.
# The head untied is off by 1e-2, 0.15 and 0.11: the tolerances sit between.
HALF = {"loss": 5e-4, "grad_norm": 2e-2, "weight": 5e-2}


def assert_same_in_half_precision(reference, other, what: str) -> None:
    for key in ("loss", "grad_norm", "val_loss"):
        mine, theirs = ([r[key] for r in rs[0] if key in r] for rs in (other, reference))
        np.testing.assert_allclose(mine, theirs, rtol=HALF.get(key, HALF["loss"]), err_msg=f"{what}: {key}")
    for name in reference[1]:
        torch.testing.assert_close(other[1][name], reference[1][name], rtol=0, atol=HALF["weight"],
                                   msg=f"{what}: {name}")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tensor_parallel_in_half_precision_trains_what_one_process_does_in_it(precision):
    """tp 2 against one process, both computing in bf16 (or fp16) through FSDP's policy, to HALF's tolerances."""
    reference = run_split("fsdp", *SPLITS[0], "--precision", precision)
    assert_same_in_half_precision(reference, run_split("fsdp", 2, *TP_SPLIT, "--tp", "2", "--precision", precision),
                                  f"tp 2 in {precision}")


@pytest.mark.parametrize(("mutant", "precision"), [("gpt_tp_untied.py", "fp32"), ("gpt_tp_untied.py", "bf16"),
                                                   ("gpt_tp_no_reduce.py", "fp32")], ids=["untied", "untied-bf16",
                                                                                          "no-reduce"])
def test_the_tensor_parallel_proof_fails_with_the_head_untied_or_a_collective_left_out(mutant, precision):
    """Two mutants of tp 2: the head untied from the embedding (as parallelize_module leaves it), and the
    all-reduce of the norms' gradients over the tp ranks left out (each rank keeps its own tokens' part)."""
    broken = train_script(mutant, 2, *ARGV, "--parallel", "fsdp", "--tp", "2", "--batch_size",
                          str(TP_SPLIT[0]), "--grad_accum", str(TP_SPLIT[1]), "--precision", precision)
    with pytest.raises(AssertionError):
        if precision == "fp32":
            assert_same_training(one_process(), broken, f"tp with {mutant}")
        else:
            assert_same_in_half_precision(run_split("fsdp", *SPLITS[0], "--precision", precision), broken,
                                          f"tp in {precision} with {mutant}")


# Pipeline parallel: (ranks, --batch_size, --grad_accum) of 12 sequences a step; the micro-batches are the schedule's.
PP_SPLIT = (2, 6)  # one pipeline: 6 micro-batches of 2


def test_pipeline_parallel_trains_what_one_process_trains():
    """--pp 2 (1F1B), pp 2 × hsdp (replicate 2) and pp 2 × fsdp 2 × tp 2 (8 ranks), each against one process on
    the same 12 sequences a step: the losses, gradient norms, validation losses (through the stages) and exported
    weights, to the tolerances of the other layouts (the micro-batches' sums are added in another order)."""
    alone = run_split("fsdp", 2, *PP_SPLIT, "--pp", "2")
    assert "fsdp on 2 ranks (pp 2 × shard 1), schedule 1F1B, cpu" in alone[2]
    assert_same_training(one_process(), alone, "pp 2")
    hsdp = run_split("hsdp", 4, 3, 2, "--pp", "2", "--shard_size", "1")
    assert "hsdp on 4 ranks (pp 2 × replicate 2 × shard 1)" in hsdp[2]
    assert_same_training(one_process(), hsdp, "pp 2 × hsdp 2 × 1")
    three = run_split("fsdp", 8, 3, 2, "--pp", "2", "--tp", "2")
    assert "fsdp on 8 ranks (pp 2 × shard 2 × tp 2)" in three[2]
    assert_same_training(one_process(), three, "pp 2 × fsdp 2 × tp 2")


@pytest.mark.parametrize(("nproc", "schedule"), [(4, "1F1B"), (2, "Interleaved1F1B"), (2, "ZBVZeroBubble")])
def test_every_kind_of_schedule_trains_what_one_process_trains(nproc, schedule):
    """The `mini` model (4 blocks): pp 4 with 1F1B, and pp 2 with two stages per rank: interleaved (stages r and
    r + 2), and the V-shaped zero-bubble ZB-V (stages r and 3 - r), which computes each backward in two parts,
    the input's gradient first and the weights' later (DualPipeV: tests/test_gpt_checkpoints.py's resume in a V).
    4 micro-batches of 3."""
    reference = run_split("ddp", *SPLITS[0], "--model", "mini")
    pipelined = run_split("fsdp", nproc, 3, 4, "--model", "mini", "--pp", str(nproc), "--pp_schedule", schedule)
    assert f"schedule {schedule}, cpu" in pipelined[2]  # the start line says which ran
    assert_same_training(reference, pipelined, f"pp {nproc} with {schedule}")


def assert_bit_for_bit(reference, other, what: str) -> None:
    assert reference[0] == other[0], what  # every record: losses, gradient norms, validation losses (not times...)
    assert reference[1].keys() == other[1].keys() and all(torch.equal(reference[1][k], other[1][k])
                                                          for k in reference[1]), what


@pytest.mark.parametrize("shape", ["tiny", "qwen3-tiny"])
@pytest.mark.parametrize("mode", ["none", "full", "selective"])
def test_compile_traces_every_block_checkpointed_or_not(mode, shape):
    """--compile compiles each block under --activation_checkpoint too: dynamo traces its forward, the checkpoint in
    it as one operation whose body is the block's (with the block a functools.partial of checkpoint, dynamo found no
    frame to trace, and every block ran eager). A backend that keeps what dynamo traced and runs it, with no code
    generation: one graph, the block's operations in it, and the same loss and gradients as eager. GPT-2's block,
    and the Llama family's (qwen3-tiny: RMSNorm, SwiGLU, QK-norm, the rotary tables an input of the block's)."""
    parallelize = import_gpt("parallelize")
    graphs, calls = [], []

    def keep(graph_module: torch.fx.GraphModule, example_inputs):
        graphs.append(graph_module)

        def run(*args):
            calls.append(len(graphs))
            return graph_module.forward(*args)
        return run

    torch.manual_seed(0)
    eager = GPT(GPTConfig(vocab_size=64, seq_len=16, **CONFIGS[shape]))
    compiled = GPT(GPTConfig(vocab_size=64, seq_len=16, **CONFIGS[shape]))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    for model in (eager, compiled):
        parallelize.checkpoint_blocks(model, mode)
    for block in compiled.blocks:
        block.compile(backend=keep)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    losses = [model(x, y).mean() for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert len(graphs) == 1 and calls == [1, 1]  # each block runs it: the same code, dynamo's guards let it reuse it
    ops = {getattr(node.target, "__name__", str(node.target)) for module in graphs[0].modules()
           for node in module.graph.nodes if node.op == "call_function"}  # a checkpoint's body is a module of it
    block_ops = {"gelu", "layer_norm"} if shape == "tiny" else {"silu", "rms_norm", "cat"}  # cat: the rotation
    assert {"linear", "scaled_dot_product_attention", *block_ops} <= ops, ops
    assert ("tag_activation_checkpoint" in ops) == (mode != "none"), ops
    assert torch.equal(*losses)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6), name


def test_activation_checkpointing_changes_no_loss_bit_for_bit():
    """--activation_checkpoint full and selective recompute in backward what the forward computed, with the same
    weights (FSDP gathers a block's before its backward, which recomputes inside) and the same kernels: fp32 on
    a CPU, the same numbers. fsdp 2 (full), fsdp 1 × tp 2 (selective, its collectives run again in the
    recomputation) and pp 2 in a V with zero bubble's split backward (full), each against the same layout without
    it: every logged loss, gradient norm and validation loss, and every exported weight, equal."""
    layouts = {"fsdp 2": (("fsdp", *SPLITS[1]), ("full",)),
               "tp 2": (("fsdp", 2, *TP_SPLIT, "--tp", "2"), ("selective",)),
               "pp 2, ZBVZeroBubble": (("fsdp", 2, 3, 4, "--model", "mini", "--pp", "2", "--pp_schedule",
                                        "ZBVZeroBubble"), ("full",))}
    for what, (layout, modes) in layouts.items():
        reference = run_split(*layout)
        for mode in modes:
            checkpointed = run_split(*layout, "--activation_checkpoint", mode)
            assert f", {mode} checkpointing |" in checkpointed[2]
            timeless = [[{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "val_loss", "lr")}
                         for r in run[0]] for run in (reference, checkpointed)]
            assert_bit_for_bit((timeless[0], reference[1]), (timeless[1], checkpointed[1]), f"{what}, {mode}")


def test_the_micro_batch_rules_refuse_exactly_what_torchs_schedules_refuse():
    """pipeline.check, which refuses before anything is written, against torch's own schedule classes built on
    mock stages (torch's private _schedule_visualizer.get_schedule_ops): every schedule, 2 and 4 pipeline ranks,
    1, 2, 3, 5 and 8 micro-batches (fewer than the stages, and not a multiple of the interleaved ones' rounds);
    check() refuses exactly what the schedule's constructor raises a ValueError for (the same from 2 to 4 ranks
    and 1 to 9 micro-batches, by hand)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    pipeline = import_gpt().pipeline
    config = GPTConfig(vocab_size=64, seq_len=32, n_layer=8, n_head=2, n_embd=64)  # blocks for every stage
    differ = []
    for schedule in pipeline.SCHEDULES:
        for pp in (2, 4):
            for micro_batches in (1, 2, 3, 5, 8):
                try:
                    with contextlib.redirect_stdout(io.StringIO()):  # it prints its schedule
                        get_schedule_ops(schedule, pp, micro_batches)
                    torch_runs = True
                except ValueError:
                    torch_runs = False
                args = argparse.Namespace(pp=pp, pp_schedule=schedule, grad_accum=micro_batches, model="x")
                try:
                    pipeline.check(args, config)
                    we_run = True
                except ValueError:
                    we_run = False
                if torch_runs != we_run:
                    differ.append((schedule, pp, micro_batches, torch_runs))
    assert not differ


@pytest.mark.parametrize("mutant", ["gpt_pp_untied.py", "gpt_pp_scaled_twice.py"])
def test_the_pipeline_proof_fails_with_the_tied_gradients_not_added_or_the_micro_batches_divided_twice(mutant):
    """Two mutants of pp 2: the embedding's and the head's gradients each left to its own stage, and a loss that
    divides by the micro-batches as well as the schedule."""
    broken = train_script(mutant, 2, *ARGV, "--parallel", "fsdp", "--pp", "2", "--batch_size", str(PP_SPLIT[0]),
                          "--grad_accum", str(PP_SPLIT[1]))
    with pytest.raises(AssertionError):
        assert_same_training(one_process(), broken, f"pp with {mutant}")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_proof_fails_without_the_gradient_reduction(parallel):
    """tests/gpt_no_sync.py is gpt/train.py with every backward's gradient sync switched off: each
    rank steps on its own sequences only, and the comparison with one process must fail."""
    broken = train_script("gpt_no_sync.py", 2, *ARGV, "--parallel", parallel, "--batch_size", "2", "--grad_accum", "3")
    with pytest.raises(AssertionError):
        assert_same_training(one_process(), broken, f"{parallel} without gradient sync")


# ---------------------------------------------------------------------------------------------
# The documented run, its metrics, and the other data sources

DOCUMENTED = "torchrun --standalone --nproc-per-node 2 gpt/train.py --model tiny"  # docs/gpt_job.md
VAL_LINE = re.compile(r"^step (\d+) \| val_loss ([\d.]+)(?: \| floor ([\d.]+))?", re.MULTILINE)
LOG_LINE = re.compile(r"^step (\d+)/300 \| loss ([\d.]+) \| lr ([\d.e+-]+) \| grad_norm ([\d.]+) \| ([\d,]+) tok/s "
                      r"\| mem ([\d.]+) GiB \(rss\)(?: \| (\d+s|\d+m\d\ds) left)?$", re.MULTILINE)


def import_gpt(script: str = "train"):
    """gpt/SCRIPT.py (train.py, activations.py) as a module of this process. It imports its siblings as `model`
    and `data`, names that the root's lessons hold here: they are swapped out for the import, then back."""
    root = {name: sys.modules.pop(name) for name in ("model", "data") if name in sys.modules}
    sys.path.insert(0, str(REPO / "gpt"))
    try:
        module = importlib.import_module(script)
    finally:
        sys.path.remove(str(REPO / "gpt"))
        for name in ("model", "data"):
            sys.modules.pop(name, None)
        sys.modules.update(root)
    return module


def test_the_documented_run_reaches_the_floor_and_metrics_hold_what_the_lines_print():
    stdout = succeeded(DOCUMENTED)
    step, val_loss, floor = VAL_LINE.findall(stdout)[-1]
    assert int(step) == 300 and float(val_loss) <= 1.10 * float(floor)
    (output,) = rerun(DOCUMENTED)
    records = [json.loads(line) for line in (output.cwd / "out" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == list(range(10, 301, 10))
    lines = LOG_LINE.findall(stdout)
    assert len(lines) == len(logged)
    assert [bool(left) for *_, left in lines] == [True] * 29 + [False]  # the time to the end, but at the end
    for (step, loss, lr, grad_norm, tokens_per_s, memory, _), record in zip(lines, logged, strict=True):
        assert int(step) == record["step"] and set(record) == {"step", "loss", "lr", "grad_norm", "tokens_per_s",
                                                              "peak_rss_gib"}
        assert loss == f"{record['loss']:.4f}" and lr == f"{record['lr']:.2e}"
        assert grad_norm == f"{record['grad_norm']:.3f}" and tokens_per_s == f"{record['tokens_per_s']:,.0f}"
        assert memory == f"{record['peak_rss_gib']:.2f}" and 0.05 < record["peak_rss_gib"] < 4  # a torch process
    assert all("peak_rss_gib" in r for r in records)  # the evaluations' records too
    evals = [r for r in records if "val_loss" in r]
    assert [(str(r["step"]), f"{r['val_loss']:.4f}", f"{r['floor']:.4f}") for r in evals] == VAL_LINE.findall(stdout)


def test_the_learning_rate_follows_warmup_then_cosine():
    """The logged LR of every step against the schedule written out here: linear warmup from 0 to
    --lr over --warmup_steps, then a cosine down to --min_lr at --max_steps."""
    records, _, _ = train(1, "--max_steps", "30", "--warmup_steps", "5", "--lr", "1e-3", "--min_lr", "1e-4",
                          "--log_every", "1", "--eval_every", "30", "--seq_len", "16", "--val_tokens", "64")
    lrs = [r["lr"] for r in records if "lr" in r]
    expected = [1e-3 * (s + 1) / 5 if s < 5 else 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * (s - 5) / 25))
                for s in range(30)]
    np.testing.assert_allclose(lrs, expected, rtol=1e-12)
    assert lrs[4] == 1e-3 and lrs.index(max(lrs)) == 4


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The README and docs as one text file: about 170 KB of English and code."""
    path = tmp_path_factory.mktemp("text") / "docs.txt"
    path.write_bytes(b"".join(p.read_bytes() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]))
    return path


def test_a_text_file_trains_well_below_the_uniform_loss(text_file):
    records, _, stdout = train(2, "--data", str(text_file), "--max_steps", "120")  # 2.92 at 120, 300 the default
    size = text_file.stat().st_size
    assert f"data {text_file} (text uint8: train 1 file {size * 9 // 10:,} tokens, val 1 file " \
           f"{size - size * 9 // 10:,} tokens; vocab 256)" in stdout
    val_loss = [r["val_loss"] for r in records if "val_loss" in r][-1]
    assert val_loss < 0.6 * math.log(256), val_loss  # uniform over bytes: ln 256 = 5.55


def test_a_nanogpt_folder_trains_exactly_as_the_same_tokens_from_a_text_file(text_file, tmp_path):
    """train.bin and val.bin of uint16 ids, as nanoGPT's prepare.py writes them, holding the text
    file's bytes split where train.py splits a text file: the same tokens, so the same run."""
    tokens = np.frombuffer(text_file.read_bytes(), dtype=np.uint8)
    cut = len(tokens) * 9 // 10
    tokens[:cut].astype(np.uint16).tofile(tmp_path / "train.bin")
    tokens[cut:].astype(np.uint16).tofile(tmp_path / "val.bin")
    loaded = load(str(tmp_path), 256)
    assert loaded.train.dtype == np.uint16 and np.array_equal(loaded.train, tokens[:cut])
    assert load(str(tmp_path)).vocab_size == 50304  # GPT-2's, padded, unless told
    argv = ("--max_steps", "20", "--log_every", "5", "--eval_every", "10")
    folder, text = train(1, "--data", str(tmp_path), "--vocab_size", "256", *argv), train(1, "--data", str(text_file),
                                                                                        *argv)
    assert [r.get("loss", r.get("val_loss")) for r in folder[0]] == [r.get("loss", r.get("val_loss")) for r in text[0]]


def test_every_documented_gpt_command_passes_options_train_py_accepts():
    gpt_train = import_gpt()
    sbatch = (REPO / "gpt" / "train.sbatch").read_text().replace("\\\n", " ")
    pages = [*sorted((REPO / "docs").glob("gpt_*.md")), REPO / "docs" / "activation_checkpointing.md"]
    docs = "".join(page.read_text() for page in pages)  # every page that quotes train.py
    docs += (REPO / "README.md").read_text() + sbatch
    lines = re.findall(r"(?:torchrun|python) [^`\n]*gpt/train\.py[^`\n]*", docs)
    commands = [line.split("gpt/train.py", 1)[1] for line in lines]
    assert len(commands) >= 6
    for command in commands:
        gpt_train.parse_args(shlex.split(command.split("  #")[0]))  # argparse exits 2 on a bad option


def test_help_shows_each_default_once(capsys):
    gpt_train = import_gpt()
    with pytest.raises(SystemExit) as exited:
        gpt_train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal's width
    assert exited.value.code == 0
    for shown in ("optimizer steps in the whole run (default: 300)", "the batches (default: 0)",
                  "(1: none) (default: 1)", "(default: lr / 10) --warmup_steps"):
        assert shown in text, text
    assert "default: None" not in text and "default: False" not in text and "(default 32768)" not in text


@pytest.mark.parametrize(("argv", "error"), [
    (["--data", "no/such/file.txt"], "error: --data no/such/file.txt: no such file"),
    (["--seq_len", "200000"], "error: --data synthetic: the val split holds 32768 tokens, fewer than --seq_len"),
    (["--data", "{text}", "--vocab_size", "100"], "is outside the vocab of 100: set --vocab_size"),
    (["--out_dir", "{text}"], "error: {text}: File exists"),
    (["--export", "{folder}"], "error: {folder}: is a folder"),
    (["--timeout", "-1"], "--timeout must be above 0"),
    (["--vocab_size", "100"], "--vocab_size is for files; the synthetic data has 64 tokens"),
    (["--shard_size", "2"], "--shard_size is for --parallel hsdp"),
    (["--parallel", "hsdp", "--shard_size", "2"], "error: --shard_size 2 does not divide the 1 data-parallel ranks"),
    (["--tp", "2"], "error: --tp 2 needs --parallel fsdp or hsdp"),
    (["--parallel", "fsdp", "--tp", "2"], "error: --tp 2 does not divide the 1 ranks"),
    (["--pp", "2"], "error: --pp 2 needs --parallel fsdp or hsdp"),
    (["--parallel", "fsdp", "--pp", "2", "--precision", "fp16"], "error: --pp 2 runs in fp32 or bf16"),
    (["--parallel", "fsdp", "--pp", "2", "--pp_schedule", "ZeroBubble"], "invalid choice: 'ZeroBubble'"),
    (["--pp_schedule", "GPipe"], "--pp_schedule is for --pp above 1"),
])
def test_bad_input_gets_one_line_and_a_non_zero_exit(argv, error, text_file):
    names = {"text": text_file, "folder": text_file.parent}
    result = torchrun_in_process(1, TRAIN, *(a.format(**names) for a in argv), "--max_steps", "1", timeout=60)
    assert result.codes[0] != 0 and error.format(**names) in result.stderr, result.stderr
    said = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]  # argparse's usage
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr


def test_a_mistyped_option_under_torchrun_is_said_once_and_in_torchruns_summary(tmp_path):
    """Under torchrun (launched whole: its summary is what is tested), argparse's error once, by rank 0, without the
    usage; each worker's error file holds it, so torchrun's summary names it, not `error_file: <N/A>`."""
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", str(REPO / TRAIN), "--parallel", "fdsp"],
                 cwd=tmp_path, timeout=90)
    line = "train.py: error: argument --parallel: invalid choice: 'fdsp'"
    assert result.returncode == 1 and "usage:" not in result.stderr, result.stderr
    said = [said for said in result.stderr.splitlines() if said.startswith("train.py: error:")]
    assert len(said) == 1 and said[0].startswith(line) and not list(tmp_path.iterdir()), result.stderr
    assert result.stderr.count(f"traceback : {line}") == 2 and "<N/A>" not in result.stderr, result.stderr


@pytest.mark.parametrize(("nproc", "argv", "error"), [
    (3, ["--tp", "3"], "--tp 3 does not divide the model's n_head, 2"),
    (2, ["--tp", "2", "--data", "{text}", "--vocab_size", "255"], "--tp 2 does not divide the model's vocab_size, 255"),
    (2, ["--tp", "2", "--seq_len", "33"], "--tp 2 does not divide the model's seq_len, 33"),
    (2, ["--pp", "2", "--pp_schedule", "Interleaved1F1B"], "--pp 2 with --pp_schedule Interleaved1F1B cuts the "
                                                             "model into 4 stages of at least one block, and --model "
                                                             "tiny has 2"),
    (2, ["--pp", "2", "--grad_accum", "1"], "--pp_schedule 1F1B at --pp 2 (2 stages, 1 a rank) runs at least 2 "
                                             "micro-batches: --grad_accum 1 is too few"),
    (3, ["--pp", "2"], "--pp 2 × --tp 1 does not divide the 3 ranks")],
    ids=["heads", "vocab", "seq", "pp-blocks", "pp-micro-batches", "pp-ranks"])
def test_a_layout_that_does_not_divide_the_model_or_the_ranks_is_one_line_and_nothing_is_written(nproc, argv, error,
                                                                                               text_file, tmp_path):
    argv = [a.format(text=text_file) for a in argv]
    result = torchrun_in_process(nproc, TRAIN, "--parallel", "fsdp", *argv, "--max_steps", "1", "--export", "model.pt",
                                 cwd=tmp_path, timeout=60)
    assert result.codes == [1] * nproc and "Traceback" not in result.stderr, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert said == [f"error: {error}"], result.stderr
    assert not list(tmp_path.iterdir())  # no out_dir, no export


@pytest.mark.parametrize(("argv", "error"), [
    (["--weight_decay", "nan"], "--weight_decay must not be negative, nan or infinite"),
    (["--grad_clip", "inf"], "--grad_clip must not be negative, nan or infinite"),
    (["--timeout", "inf"], "--timeout must be above 0 and finite"),
    (["--lr", "1e30"], "--lr must be below 1e7"),
    (["--timeout", "1e15"], "--timeout must be below 1e7"),
    (["--seed", str(2**64)], "--seed must be below 2**64"),
    (["--profile", "5:3"], "'5:3' is not A:B with 1 <= A <= B"),
    (["--profile", "0:1"], "'0:1' is not A:B with 1 <= A <= B"),
    (["--profile", "290:310"], "--profile 290:310 ends after --max_steps 300"),  # a trace of the whole run, thrown away
    # RuntimeError at the first weight pass: "Trying to backward an extra time" (torch 2.13's selective checkpoint)
    (["--parallel", "fsdp", "--pp", "2", "--pp_schedule", "DualPipeV", "--activation_checkpoint", "selective"],
     "--pp_schedule DualPipeV runs two (the input's, then the weights'): use full there"),
    # RuntimeError in the first input's pass: "compiled with non-empty donated buffers" (torch 2.13)
    (["--parallel", "fsdp", "--pp", "2", "--pp_schedule", "ZBVZeroBubble", "--compile"],
     "--compile and --pp_schedule ZBVZeroBubble: the schedule splits each backward in two"),
    # AssertionError in the first forward: "expected all tensors_saved_with_vc_check to be Tensors" (torch 2.13)
    (["--parallel", "fsdp", "--tp", "2", "--compile", "--activation_checkpoint", "full"],
     "--compile with --tp and --activation_checkpoint full fails in torch 2.13"),
])
def test_values_that_would_fail_later_with_a_traceback_are_refused_by_the_parser(argv, error, capsys):
    """nan passes `< 0` checks; an lr past float32's range fails in Adam's first step; a seed of 2**64
    in torch.manual_seed; a timeout of inf in timedelta: each one line from argparse now."""
    with pytest.raises(SystemExit) as stopped:
        import_gpt().parse_args(argv)
    assert stopped.value.code == 2 and error in capsys.readouterr().err


def hang_up(rank: int, world_size: int) -> tuple:
    """A StopRequest of a group of one, called as after each step: before a SIGHUP to this process, then
    until it agrees to stop (how many steps that took); then the same with SIGHUP ignored, as nohup
    starts a command, for 300 steps."""
    gpt_train = import_gpt()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a terminal starts it, even where the suite runs under nohup
    stop = gpt_train.StopRequest(None)
    try:
        before = stop.agreed()
        os.kill(os.getpid(), signal.SIGHUP)
        steps = next(n for n in range(1, 1000) if stop.agreed())
        stopped = steps, stop.name
    finally:
        stop.restore()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stop = gpt_train.StopRequest(None)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        return before, *stopped, any(stop.agreed() for _ in range(300)), gpt_train.StopRequest.MAX_STEPS
    finally:
        stop.restore()


def test_a_sighup_stops_the_run_as_sigterm_does():
    """A closed terminal or ssh session sends SIGHUP, and torchrun passes it on to its workers: it is a
    stop request (the run saves the step in flight), not the default death without a save; but a run
    started under nohup keeps running. The agreement comes within two intervals (StopRequest): here
    the second step's agreement carries the signal, read the interval after it."""
    results, _ = spawn(hang_up, 1, timeout=60)
    before, steps, name, under_nohup, max_steps = results[0]
    assert (before, name, under_nohup) == (False, "SIGHUP", False)  # under nohup it stays ignored
    assert 2 <= steps <= 1 + max_steps, steps


def agree_at_own_paces(rank: int, world_size: int, signal_step: int) -> tuple:
    """StopRequest called after each of up to 400 steps that take each rank its own time (1 to 9 ms),
    with intervals of about 20 ms; rank 1 signals itself as step `signal_step` starts. Returns (the
    step it stopped after, the steps whose ends read an agreement)."""
    stop = import_gpt().StopRequest(None)
    stop.SECONDS = 0.02
    reads = []
    try:
        for step in range(1, 400):
            time.sleep(0.001 * (rank + 1) * (1 + step % 3))
            if rank == 1 and step == signal_step:
                os.kill(os.getpid(), signal.SIGTERM)
            if stop.steps_left == 1:
                reads.append(step)
            if stop.agreed():
                return step, reads
        return None, reads
    finally:
        stop.restore()


def test_ranks_at_different_paces_agree_at_the_same_steps_and_stop_after_the_same_one():
    """Each rank proposes intervals from its own pace, so the intervals would differ from rank to rank
    if any rank used its own proposal: the agreed one is the same everywhere, and so is the stop, two
    reads after the signal."""
    results, _ = spawn(agree_at_own_paces, 3, 60, timeout=90)
    stopped, reads = results[0]
    assert all(result == (stopped, reads) for result in results), results
    intervals = [b - a for a, b in zip(reads, reads[1:], strict=False)]
    assert reads[:2] == [1, 2] and len(set(intervals)) > 1, reads  # the intervals grow, then follow the pace
    after = [r for r in reads if r >= 60]
    assert stopped == after[1], (stopped, reads)  # the first read at or after it sends the signal, the next reads it


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_bf16_trains_as_fp32_does_to_within_its_precision(parallel):
    """bf16 (autocast under DDP, FSDP2's MixedPrecisionPolicy under FSDP) keeps 8 bits of mantissa.
    Measured against fp32 over 8 steps: the losses within 1e-4, the gradient norms within 5e-3,
    where fp32 at 2 ranks is within 1e-7 of one process: bf16 did compute in bf16."""
    reference, _, _ = one_process()
    records, _, _ = run_split(parallel, 2, 2, 3, "--precision", "bf16")
    np.testing.assert_allclose([r["loss"] for r in records if "loss" in r],
                               [r["loss"] for r in reference if "loss" in r], rtol=1e-3)
    norms, ref_norms = ([r["grad_norm"] for r in rs if "loss" in r] for rs in (records, reference))
    np.testing.assert_allclose(norms, ref_norms, rtol=3e-2)
    assert max(abs(a / b - 1) for a, b in zip(norms, ref_norms, strict=True)) > 1e-4


def test_plot_draws_each_runs_losses(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "gpt"))
    try:
        from plot import plot
    finally:
        sys.path.remove(str(REPO / "gpt"))
    runs = []
    for name, scale in (("one", 1.0), ("two", 2.0)):
        (tmp_path / name).mkdir()
        records = [{"step": s, "loss": scale / s} for s in (1, 2, 3)] + [{"step": 3, "val_loss": scale, "floor": 0.5}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append(str(tmp_path / name))
    figure = plot(runs, str(tmp_path / "loss.png"))
    lines = {line.get_label(): [float(y) for y in line.get_ydata()] for line in figure.axes[0].get_lines()}
    assert lines[f"{runs[0]} train"] == [1.0, 0.5, 1 / 3] and lines[f"{runs[1]} val"] == [2.0]
    assert lines["floor 0.5000"] == [0.5, 0.5]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_on_a_gpu_each_precision_reaches_the_floor(precision, tmp_path):
    result = run([sys.executable, str(REPO / TRAIN), "--precision", precision, "--out_dir", str(tmp_path)],
                 timeout=300)
    assert result.returncode == 0, result.stderr
    assert "cuda" in result.stdout
    step, val_loss, floor = VAL_LINE.findall(result.stdout)[-1]
    assert float(val_loss) <= 1.10 * float(floor)


def test_the_slurm_script_is_valid_bash():
    assert run(["bash", "-n", str(REPO / "gpt" / "train.sbatch")]).returncode == 0


@pytest.fixture
def bench_main(monkeypatch, capsys):
    """gpt/bench.py's main() in this process, its train.py runs canned: each writes OUT_DIR/metrics.jsonl with a
    record every --log_every steps to --max_steps (past the last step that OUT_DIR's file holds: a resume) at the
    tokens/s speed(ranks, save_every, resumed, --parallel) gives; what else it runs (simulate.py) runs. Returns a
    function of (argv, speed) that gives (stdout, the train.py commands run)."""
    bench = import_gpt("bench")
    real = bench.subprocess.run

    def main(argv: list[str], speed) -> tuple[str, list[list[str]]]:
        commands = []

        def canned(command, **kwargs):
            if not any(str(word).endswith("train.py") for word in command):
                return real(command, **kwargs)
            commands.append(command)
            def last(flag: str) -> int:  # train.py's reading: the last one given wins
                return int(command[len(command) - command[::-1].index(flag)])
            path = os.path.join(command[command.index("--out_dir") + 1], "metrics.jsonl")
            done = [json.loads(line)["step"] for line in open(path)] if os.path.exists(path) else []
            layout = command[len(command) - command[::-1].index("--parallel")] if "--parallel" in command else "ddp"
            tokens_per_s = speed(int(command[command.index("--nproc-per-node") + 1]), last("--save_every"), bool(done),
                                 layout)
            with open(path, "a") as file:
                file.writelines(json.dumps({"step": step, "tokens_per_s": tokens_per_s}) + "\n" for step in
                                range(max(done, default=0) + last("--log_every"), last("--max_steps") + 1,
                                      last("--log_every")))
            return bench.subprocess.CompletedProcess(command, 0, "", "")

        monkeypatch.setattr(bench.subprocess, "run", canned)
        monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
        bench.main()
        return capsys.readouterr().out, commands
    return main


def test_bench_prints_each_world_size_and_an_efficiency_recomputable_from_its_figures(bench_main):
    stdout, commands = bench_main(["--world_sizes", "1", "2", "--repeats", "1", "--", "--max_steps", "12",
                                   "--log_every", "4"],
                                  lambda ranks, saves, resumed, layout: 1000 * ranks - 200 * (ranks - 1))
    rows = [line.split() for line in stdout.splitlines() if re.match(r"\s+\d+\s+\d+\s+[\d,]+", line)]
    assert [row[0] for row in rows] == ["1", "2"]
    assert [row[2] for row in rows] == ["1,000", "1,800"] and [row[-1] for row in rows] == ["100%", "90%"]
    assert "train.py --max_steps 12 --log_every 4 --eval_every 1000000 --val_tokens 64 --save_every 0\n" in stdout
    assert [c[c.index("--nproc-per-node") + 1] for c in commands] == ["1", "2"]


def test_bench_compares_layouts_run_by_run(bench_main):
    """--layouts ddp fsdp hsdp at 1 rank: their runs interleaved (ddp, fsdp, hsdp, ddp, ...), each layout's tokens/s
    (the median of its runs) and its ratio to ddp's in each round of runs (the canned runs: fsdp at 0.6 of ddp in the
    first round, 0.8 in the second, 0.7 in the third; hsdp at 0.5 throughout)."""
    rounds = iter([1000, 600, 500, 2000, 1600, 1000, 1500, 1050, 750])
    stdout, commands = bench_main(["--world_sizes", "1", "--layouts", "ddp", "fsdp", "hsdp", "--repeats", "3", "--",
                                   "--max_steps", "8", "--log_every", "4"],
                                  lambda ranks, saves, resumed, layout: next(rounds))
    assert [c[c.index("--parallel") + 1] for c in commands] == ["ddp", "fsdp", "hsdp"] * 3
    rows = re.findall(r"^ +(\w+) +([\d,]+) +([\d,]+) +([\d,]+) +([\d.]+) \(([\d.]+) to ([\d.]+)\)$", stdout,
                      re.MULTILINE)
    assert rows == [("ddp", "1,500", "1,000", "2,000", "1.00", "1.00", "1.00"),
                    ("fsdp", "1,050", "600", "1,600", "0.70", "0.60", "0.80"),
                    ("hsdp", "750", "500", "1,000", "0.50", "0.50", "0.50")], stdout
    for argv in (["--layouts", "ddp", "ddp"], ["--layouts", "ddp", "fsdp", "--host"]):  # refused before any run
        code, stdout, stderr = run_main(import_gpt("bench"), *argv)
        assert code == 2 and stdout == "" and stderr.strip().endswith(
            "error: --layouts names each layout once, and runs alone (not with --host, --tp, --cp, --pp, "
            "--stop_agreement, --save_every or --resume)"), stderr


def test_bench_prints_what_saving_costs_and_compares_a_resumed_run_with_a_fresh_one(bench_main):
    """Checkpoints every 4 steps against none, in runs beside each other; and a run resumed at its own
    --max_steps (12 here; 60 by default), then run to twice that in the same OUT_DIR, against the same steps of a
    fresh one (the canned runs: 10% slower with saves, 5% once resumed)."""
    stdout, commands = bench_main(["--world_sizes", "1", "--repeats", "1", "--resume", "--save_every", "4", "--",
                                   "--max_steps", "12", "--log_every", "4"],
                                  lambda ranks, saves, resumed, layout: 900 if saves else 950 if resumed else 1000)
    assert "    saving every 4 steps: 900 tokens/s against 1,000 in the runs beside them, 10.0% slower (min 10.0%, " \
           "max 10.0%)" in stdout
    assert "    resumed at step 12: 950 tokens/s against 1,000 for the same steps of a fresh run" in stdout
    first, resumed, fresh = commands[-3:]  # after the plain run and the pair with and without saves
    out_dir = first[first.index("--out_dir") + 1]
    assert resumed[resumed.index("--out_dir") + 1] == out_dir != fresh[fresh.index("--out_dir") + 1]
    assert resumed[-4:-2] == fresh[-4:-2] == ["--max_steps", "24"]


def test_bench_prints_a_tp_degree_beside_what_a_rank_holds_and_sends(bench_main):
    """--tp 2 at 2 ranks: its tokens/s (the canned run's), and the bytes of the mini model's state that each rank
    holds (simulate.py's, run), which are the formula's (tests/test_gpt_simulate.py's plan: params, gradients,
    twice the params for Adam)."""
    from test_gpt_simulate import plan
    stdout, commands = bench_main(["--world_sizes", "2", "--tp", "2", "--repeats", "1", "--", "--max_steps", "8",
                                   "--log_every", "2", "--batch_size", "2"], lambda ranks, saves, resumed, layout: 1234)
    rows = re.findall(r"^ +tp 2 +([\d,]+) +[\d,]+ +[\d,]+ +([\d.]+) MiB +([\d.]+) MiB$", stdout, re.MULTILINE)
    assert len(rows) == 1 and rows[0][0] == "1,234", stdout
    assert " ".join(commands[0]).endswith("--model mini --parallel fsdp --tp 2 --batch_size 4 --out_dir " +
                                          commands[0][-1])  # the global batch kept: 2 × tp per tp group
    params, _ = plan(GPTConfig(vocab_size=64, seq_len=64, **CONFIGS["mini"]), 4, {"shard": 1, "tp": 2})
    assert float(rows[0][1]) == round(4 * params / 2**20, 2) and float(rows[0][2]) > 0


def bench_in_process(monkeypatch):
    """gpt/bench.py as a module, its torchrun of train.py run with the ranks forked from the tests' server (a rank
    killed (-9) or hung (None) fails, as under torchrun); what else it runs, run."""
    bench = import_gpt("bench")
    real = subprocess.run

    def in_process(command, **kwargs):
        if not any(str(word).endswith("train.py") for word in command):
            return real(command, **kwargs)
        nproc = int(command[command.index("--nproc-per-node") + 1])
        script = next(i for i, word in enumerate(command) if word.endswith("train.py"))
        result = torchrun_in_process(nproc, TRAIN, *command[script + 1:], cwd=REPO, timeout=120)
        return subprocess.CompletedProcess(command, 0 if result.codes == [0] * nproc else 1, result.stdout,
                                           result.stderr)
    monkeypatch.setattr(bench.subprocess, "run", in_process)
    return bench


def test_bench_prints_each_schedules_wait_beside_its_formula_and_the_micro_batches_each_stage_held(tmp_path,
                                                                                                      monkeypatch):
    """--pp 1F1B ZBVZeroBubble at 2 ranks, 4 micro-batches: each rank's measured share of a step spent waiting
    (a share: the time is the benchmark's to print, not a test's), the formula ((p - 1) / (m + p - 1) for 1F1B,
    0 for ZB-V), and the most micro-batches each stage held, which the schedules' orders decide: 1F1B p - s on
    stage s, ZB-V 2p - s (stage s of 2p, each backward ending with the weights'). Then plot.py --pipeline draws
    their timelines, one bar per stage's piece of work."""
    bench = bench_in_process(monkeypatch)
    code, stdout, stderr = run_main(bench, "--world_sizes", "2", "--repeats", "1", "--pp", "1F1B", "ZBVZeroBubble",
                                    "--timelines", str(tmp_path), "--", "--max_steps", "4", "--log_every", "2",
                                    "--grad_accum", "4", "--batch_size", "2")
    assert code == 0, stderr
    rows = {name: (waits, formula, held) for name, waits, formula, held in re.findall(
        r"^ +(\w+) +[\d,]+ +(\d+% \d+%) +(\d+)%  ((?:\d+:\d+ ?)+)$", stdout, re.MULTILINE)}
    assert sorted(rows) == ["1F1B", "ZBVZeroBubble"], stdout
    for name, (waits, formula, held) in rows.items():
        assert all(0 <= int(w[:-1]) < 100 for w in waits.split())
        assert int(formula) == {"1F1B": 20, "ZBVZeroBubble": 0}[name]  # 1 / (4 + 1)
        assert held == {"1F1B": "0:2 1:1", "ZBVZeroBubble": "0:4 1:3 2:2 3:1"}[name], name
    files = [str(tmp_path / f"{name}.json") for name in ("1F1B", "ZBVZeroBubble")]
    code, _, stderr = run_main(import_gpt("plot"), "--pipeline", *files, "--out", str(tmp_path / "pp.png"))
    assert code == 0 and (tmp_path / "pp.png").stat().st_size > 0, stderr
    timelines = [json.loads(Path(f).read_text()) for f in files]
    pieces = [sum(len(rank) for rank in t["ranks"]) for t in timelines]
    assert pieces == [2 * 2 * 4, 3 * 4 * 4]  # 1F1B: F and B per micro-batch and stage; ZB-V: F, I, W on 4 stages
    code, _, stderr = run_main(import_gpt("bench"), "--world_sizes", "1", "--pp", "1F1B")
    assert code == 2 and stderr.splitlines()[-1] == "bench.py: error: --pp runs one pipeline over the last of " \
        "--world_sizes: it must be 2 or more", stderr


def test_bench_host_prints_each_layouts_time_per_step_from_its_runs_tokens_per_second(monkeypatch, capsys):
    """--host: each layout's run (canned here: train.py's metrics.jsonl with its tokens/s) on the model too small to
    compute anything, turned into ms per step (a step of 8 tokens, the pipeline's of 16), the median of the runs."""
    bench = import_gpt("bench")
    speeds = {"ddp": [8000, 4000], "fsdp": [4000, 4000], "fsdp 1 × tp 2": [2000, 1000], "fsdp 1 × pp 2": [4000, 2000]}
    commands = []

    def canned(command, **kwargs):
        commands.append(command)
        start = command.index("--seq_len") + 4  # after HOST_SHAPE: the layout's flags, then --out_dir
        name = next(name for name, (_, layout) in bench.HOST_LAYOUTS.items()
                    if command[start:command.index("--out_dir")] == layout)
        speed = speeds[name].pop(0)
        out_dir = command[command.index("--out_dir") + 1]
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as file:  # the first interval is left out
            file.writelines(json.dumps({"step": step, "tokens_per_s": speed}) + "\n" for step in (10, 20, 30))
        return bench.subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(bench.subprocess, "run", canned)
    bench.host_cost([], repeats=2, cores=2)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row[-5:] for row in rows] == [["1", "1.50", "ms", "1.00", "2.00"], ["1", "2.00", "ms", "2.00", "2.00"],
                                          ["2", "6.00", "ms", "4.00", "8.00"], ["2", "6.00", "ms", "4.00", "8.00"]]
    assert all("--model tiny --seq_len 8 --batch_size 1" in " ".join(c) for c in commands) and len(commands) == 8


def ddp_layout(rank: int, world_size: int) -> tuple[str, bool]:
    """What parallelize_gpt() makes of --parallel ddp, and whether a micro-step outside the last (gradient_sync
    False) leaves a gradient, as it must: DDP's no_sync() holds the all-reduce, not the gradient."""
    gpt_train = import_gpt()
    args = gpt_train.parse_args(["--seq_len", "16"])
    with torch.device("meta"):
        model = gpt_train.GPT(GPTConfig(vocab_size=64, seq_len=16, **CONFIGS["tiny"]))
    model = gpt_train.parallelize.parallelize_gpt(model, None, args, torch.device("cpu"))
    x = torch.randint(0, 64, (2, 16))
    with gpt_train.parallelize.gradient_sync(model, False):
        model(x, x).mean().backward()
    return type(model).__name__, all(p.grad is not None for p in model.parameters())


def test_ddp_at_one_rank_is_the_model_alone():
    """At one rank --parallel ddp trains the model itself, as nanoGPT's one process does (DDP's hooks there cost
    the tiny model's step 9 to 12%: docs/gpt_speed.md); at two, DDP. Their numbers are one process's either way
    (test_n_ranks_train_what_one_process_trains)."""
    assert spawn(ddp_layout, 1, timeout=60)[0] == [("GPT", True)]
    assert spawn(ddp_layout, 2, timeout=60)[0] == [("DistributedDataParallel", True)] * 2


def fp16_inf_on_one_rank(rank: int, world_size: int, parallel: str, local_check: bool) -> tuple[float, bool]:
    """One fp16 step in which one gradient entry is inf on the last rank alone, after the reduction
    (as when a sum overflows into one rank's shard); returns (the scaler's new scale, whether this
    rank's weights changed). local_check: the inf check as it would be without DTensor's handler in
    torch/distributed/tensor/_dispatch.py (found_inf_reduce_handler), each rank on its own shard."""
    from torch.distributed.tensor import DTensor
    gpt_train = import_gpt()
    args = gpt_train.parse_args(["--parallel", parallel, "--precision", "fp16", "--seq_len", "16"])
    if local_check:
        def each_rank_alone(op_call, op_args, kwargs):
            grads, found_inf, inv_scale = op_args
            op_call([g.to_local() for g in grads], found_inf, inv_scale)
        op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
        DTensor._op_dispatcher._custom_op_handlers[op] = each_rank_alone
    mesh = gpt_train.parallelize.make_mesh(args, world_size, torch.device("cpu"))
    with torch.device("meta"):
        model = gpt_train.GPT(GPTConfig(vocab_size=64, seq_len=16, **CONFIGS["tiny"]))
    model = gpt_train.parallelize.parallelize_gpt(model, mesh, args, torch.device("cpu"))
    optimizer = gpt_train.make_optimizer(model, args)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))
    scaler.scale(model(x, x).mean()).backward()
    if rank == world_size - 1:
        model.blocks[0].mlp.fc.weight.grad.to_local().view(-1)[0] = math.inf  # this rank's shard only
    before = [p.to_local().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    return scaler.get_scale(), any(not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters(),
                                                                                  strict=True))


@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_fp16_under_fsdp_every_rank_skips_the_step_that_one_ranks_shard_overflowed(parallel):
    """GradScaler's inf check over DTensor gradients is all-reduced by DTensor's dispatch, so every
    rank skips the step and lowers the scale alike (hsdp at 2 ranks: one shard group, no replicas);
    with each rank checking only its own shard they would disagree, and the test sees it."""
    results, _ = spawn(fp16_inf_on_one_rank, 2, parallel, False, timeout=90)
    assert results == [(2.0**15, False)] * 2  # the default scale 2**16, halved; no weight moved
    results, _ = spawn(fp16_inf_on_one_rank, 2, parallel, True, timeout=90)
    assert results == [(2.0**16, True), (2.0**15, False)]  # rank 0 stepped, rank 1 skipped: the replicas part


def test_bench_prints_each_cp_methods_speed_memory_and_the_rings_wait(monkeypatch):
    """--cp 1 2 at 2 ranks (llama-tiny, 32 tokens, real runs): fsdp 2, then fsdp 1 × cp 2 by each method, each
    with its tokens/s and the largest rank's peak memory; the ring alone with the share of its time it waited for k
    and v (a share: the time is the benchmark's to print, not a test's)."""
    bench = bench_in_process(monkeypatch)
    code, stdout, stderr = run_main(bench, "--world_sizes", "2", "--repeats", "1", "--cp", "1", "2", "--",
                                    "--model", "llama-tiny", "--seq_len", "32", "--max_steps", "6", "--log_every", "2")
    assert code == 0, stderr
    rows = re.findall(r"^ +(fsdp 2|fsdp 1 × cp 2 \w+) +[\d,]+ +[\d,]+ +[\d,]+ +([\d.]+) GiB +(\S+)$", stdout,
                      re.MULTILINE)
    assert [name for name, _, _ in rows] == ["fsdp 2", "fsdp 1 × cp 2 allgather", "fsdp 1 × cp 2 ulysses",
                                             "fsdp 1 × cp 2 ring"], stdout
    assert all(float(peak) > 0 for _, peak, _ in rows)
    assert [wait for _, _, wait in rows[:3]] == ["-"] * 3 and 0 <= int(rows[3][2][:-1]) < 100, stdout
