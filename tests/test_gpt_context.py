"""gpt/'s context parallel (--cp, gpt/context.py): each sequence split over the cp ranks, head-tail, trains what one
process trains on whole sequences, with the tolerances of tests/test_gpt.py, for GPT-2 (learned positions) and the
Llama family (rotary, grouped-query heads); red when the chunks, a rank's positions or the gathered keys' mask are
wrong; a checkpoint resumes across cp degrees; a layout --cp cannot take is one line."""
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from harness import torchrun_in_process
from test_gpt import ARGV, FOLDERS, SPLITS, assert_same_training, import_gpt, run_split, strict_records

from gpt.model import GPT

# (--parallel, ranks, --batch_size, --grad_accum, more): 12 sequences of 32 tokens a step, as SPLITS, in micro-batches
# of 6 but under pp (a cp or tp rank's collectives are many and small: each micro-batch costs); each method at
# cp 2 and at cp 3 or 4, with tp 2 and with pp 2, with both families (tiny: GPT-2's learned positions, 2 heads;
# llama-tiny and qwen3-tiny: rotary, 4 q heads on 2 k and v heads, which ulysses repeats at cp 4, and at cp 2 under
# tp 2); fsdp 2 × cp 2 (shard and cp both above 1): the checkpoint test's run, against one process's
context = import_gpt("context")  # gpt/context.py, which imports gpt/model.py as `model`
positions, ring_attention = context.positions, context.ring_attention
LAYOUTS = {
    "tiny": [("fsdp", 2, 6, 2, "--cp", "2"), ("fsdp", 4, 6, 2, "--cp", "4"),
             ("fsdp", 2, 6, 2, "--cp", "2", "--cp_method", "ulysses"),
             ("fsdp", 4, 6, 2, "--cp", "4", "--cp_method", "ring", "--activation_checkpoint", "selective"),
             ("fsdp", 4, 6, 2, "--cp", "2", "--tp", "2", "--cp_method", "ring"),
             ("fsdp", 4, 2, 6, "--cp", "2", "--pp", "2", "--cp_method", "ulysses")],
    "llama-tiny": [("hsdp", 4, 3, 2, "--shard_size", "1", "--cp", "2", "--activation_checkpoint", "full"),
                   ("fsdp", 4, 6, 2, "--cp", "4", "--cp_method", "ulysses"),
                   ("fsdp", 4, 6, 2, "--cp", "4", "--cp_method", "ring", "--activation_checkpoint", "full"),
                   ("fsdp", 4, 6, 2, "--cp", "2", "--tp", "2", "--cp_method", "ulysses"),
                   ("fsdp", 4, 2, 6, "--cp", "2", "--pp", "2")],
    "qwen3-tiny": [("fsdp", 3, 6, 2, "--cp", "3", "--seq_len", "36"), ("fsdp", 4, 6, 2, "--cp", "2", "--tp", "2"),
                   ("fsdp", 4, 2, 6, "--cp", "2", "--pp", "2", "--cp_method", "ring")],
}

def one_process(model: str, *more: str):
    return run_split("ddp", *SPLITS[0], "--model", model, *more)


def test_each_rank_holds_chunks_i_and_2n_minus_1_minus_i_and_all_together_the_sequence():
    assert positions(16, 2, 0, "cpu").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 2, 1, "cpu").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    held = torch.cat([positions(36, 3, r, "cpu") for r in range(3)])
    assert sorted(held.tolist()) == list(range(36))
    # balanced: each rank's queries see as many keys as another's, under the causal mask
    assert len({int((positions(36, 3, r, "cpu") + 1).sum()) for r in range(3)}) == 1


@pytest.mark.parametrize(("model", "layout"), [(m, layout) for m, layouts in LAYOUTS.items() for layout in layouts],
                         ids=[f"{m}-{' '.join(map(str, layout))}" for m, layouts in LAYOUTS.items()
                              for layout in layouts])
def test_context_parallel_trains_what_one_process_trains_on_whole_sequences(model, layout):
    """Every logged loss and gradient norm, the validation losses and the exported weights."""
    more = layout[layout.index("--seq_len"):][:2] if "--seq_len" in layout else ()
    reference = one_process(model, *more)
    other = run_split(*layout, "--model", model)
    method = layout[layout.index("--cp_method") + 1] if "--cp_method" in layout else "allgather"
    assert f"{layout[0]} on {layout[1]} ranks (" in other[2] and f", cp by {method}, " in other[2].splitlines()[0]
    cp, tp = (int(layout[layout.index(flag) + 1]) if flag in layout else 1 for flag in ("--cp", "--tp"))
    repeated = f"k and v heads{' a tp rank' if tp > 1 else ''} do not split over {cp} ranks: repeated" in other[2]
    assert repeated == (method == "ulysses" and 2 // tp % cp > 0), other[2]  # said, where done: 2 k and v heads
    assert not any("cp_wait" in r for r in other[0] if "val_loss" in r)  # training's share, not evaluation's
    waits = [r.get("cp_wait") for r in other[0] if "loss" in r]  # the ring's time waiting for k and v, logged
    assert all(w is not None and 0 < w < 1 for w in waits) if method == "ring" else waits == [None] * len(waits)
    assert_same_training(reference, other, f"{model}: {layout}")


@pytest.mark.parametrize("mutant", ["chunks", "positions", "mask", "merge"])
def test_the_proof_fails_when_the_chunks_the_positions_the_mask_or_the_merge_are_wrong(mutant):
    """tests/gpt_cp_mutant.py: the sequence cut into plain halves, not head-tail (each rank's mask still of the
    head-tail places); the tokens' positions each rank's own 0, 1, ... (rotary tables of the wrong places); the
    gathered keys masked as if in the sequence's order; the ring's partial results averaged, not weighted by their
    log-sum-exp: not one process's training."""
    folder = Path(tempfile.mkdtemp(dir=FOLDERS.name))
    method = "ring" if mutant == "merge" else "allgather"
    result = torchrun_in_process(2, "tests/gpt_cp_mutant.py", *ARGV, "--parallel", "fsdp", "--cp", "2", "--cp_method",
                                 method, "--batch_size", "2", "--grad_accum", "6", "--model", "llama-tiny", "--out_dir",
                                 "out", "--export", "model.pt", cwd=folder, env={"CP_MUTANT": mutant}, timeout=120)
    assert result.codes == [0, 0], result.stderr  # it runs: the failure below is the numbers'
    broken = strict_records(folder / "out" / "metrics.jsonl"), GPT.load(str(folder / "model.pt")).state_dict(), ""
    with pytest.raises(AssertionError):
        assert_same_training(one_process("llama-tiny"), broken, mutant)


def test_a_checkpoint_at_cp_2_resumes_at_cp_4_and_in_one_process(tmp_path):
    """llama-tiny, 8 steps at fsdp 2 × cp 2 with a checkpoint at step 4, resumed at cp 4 and by one process: every
    later record within 1e-5 of the whole run's (sums split otherwise)."""
    argv = [*ARGV, "--model", "llama-tiny", "--save_every", "4", "--out_dir", "out"]
    runs = {}
    for name, nproc, more in (("whole", 4, ["--parallel", "fsdp", "--cp", "2", "--batch_size", "2", "--grad_accum",
                                            "3"]),
                              ("cp4", 4, ["--parallel", "fsdp", "--cp", "4", "--batch_size", "6", "--grad_accum", "2"]),
                              ("one", 1, ["--batch_size", "6", "--grad_accum", "2"])):
        folder = tmp_path / name
        folder.mkdir()
        if name != "whole":
            shutil.copytree(tmp_path / "whole" / "out" / "step_00000004", folder / "out" / "step_00000004")
        result = torchrun_in_process(nproc, "gpt/train.py", *argv, *more, cwd=folder, timeout=120)
        assert result.codes == [0] * nproc, result.stderr
        assert (name == "whole") != ("resuming from out/step_00000004: step 4 of 8" in result.stdouts[0])
        runs[name] = [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "val_loss")}
                      for r in strict_records(folder / "out" / "metrics.jsonl") if r["step"] > 4]
    for name in ("cp4", "one"):
        assert [r["step"] for r in runs[name]] == [r["step"] for r in runs["whole"]]
        for mine, theirs in zip(runs[name], runs["whole"], strict=True):
            for key in mine.keys() - {"step"}:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=0), (name, key, mine, theirs)


@pytest.mark.parametrize(("argv", "error"), [
    (["--parallel", "ddp", "--cp", "2"], "--cp 2 needs --parallel fsdp or hsdp"),
    (["--parallel", "fsdp", "--cp", "0"], "--tp, --pp, --ep and --cp must be at least 1"),
    (["--parallel", "fsdp", "--cp", "2", "--compile"], "--cp 2 does not yet go with --compile"),
    (["--parallel", "fsdp", "--cp_method", "ring"], "--cp_method is for --cp above 1"),
], ids=["ddp", "zero", "compile", "method"])
def test_cp_options_that_do_not_go_together_are_refused_in_one_line(argv, error, capsys):
    """The options alone decide: argparse's one line and exit 2, before any process group (train.py's own
    parse_args, in this process)."""
    with pytest.raises(SystemExit) as stopped:
        import_gpt().parse_args(argv)
    said = capsys.readouterr().err.splitlines()[-1]
    assert stopped.value.code == 2 and said.split(": error: ", 1)[1].startswith(error), said


@pytest.mark.parametrize(("nproc", "argv", "error"), [
    (2, ["--parallel", "fsdp", "--cp", "2", "--seq_len", "30"], "--cp 2: 2 × 2 does not divide --seq_len 30"),
    (3, ["--parallel", "fsdp", "--cp", "2"], "--cp 2 × --pp 1 × --tp 1 does not divide the 3 ranks"),
    (4, ["--parallel", "fsdp", "--cp", "4", "--cp_method", "ulysses"], "--cp 4 --cp_method ulysses: 4 does not divide "
                                                                        "the model's n_head, 2"),
], ids=["seq_len", "ranks", "heads"])
def test_a_cp_degree_that_does_not_fit_is_refused_in_one_line(nproc, argv, error, tmp_path):
    """With the model's shape or the ranks: the job's one error line (exit 1), nothing written."""
    result = torchrun_in_process(nproc, "gpt/train.py", *argv, "--max_steps", "1", cwd=tmp_path, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.codes == [1] * nproc and len(errors) == 1 and errors[0].startswith(f"error: {error}"), \
        result.stderr
    assert not list(tmp_path.iterdir())


def test_the_ring_refuses_attention_dropout():
    """train.py's models have none; a copy of gpt/ that adds it gets one line from the ring, not a silent drop."""
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="ring attention has no attention dropout"):
        ring_attention(None, q, q, q, 0.1)


def test_a_cp_ranks_tokens_that_tp_does_not_split_are_refused():
    """tp 4 × cp 2, 12 tokens: 2 × cp divides them and tp divides them, but a cp rank's 6 do not split over 4 tp
    ranks (sequence parallel): one line, before anything is built."""
    parallelize, model = import_gpt("parallelize"), import_gpt("model")
    args = import_gpt().parse_args(["--parallel", "fsdp", "--tp", "4", "--cp", "2", "--model", "mini"])
    with pytest.raises(ValueError, match=r"--cp 2 --tp 4: a cp rank's 6 tokens \(--seq_len / cp\) do not split"):
        parallelize.check_layout(args, model.GPTConfig(vocab_size=64, seq_len=12, **model.CONFIGS["mini"]), 8)
