"""gpt/'s Llama family in every layout: what N ranks train is what one process trains, as tests/test_gpt.py shows
for GPT-2, with the same data, steps and tolerances. llama-tiny holds grouped-query attention (4 q heads on 2 k and
v heads), Llama 3's scaled rotary frequencies and an untied head; qwen3-tiny QK-norm, heads of 32 on a width of 64
(not width / heads) and a tied head; llama-mini's 4 blocks take the schedules of two stages a rank. transformers'
own Llama and Qwen3 against gpt/'s: tests/test_gpt_hf.py."""
import json
import shutil

import pytest
import torch
from harness import torchrun_in_process
from test_gpt import (
    ARGV,
    SPLITS,
    TP_SPLIT,
    assert_bit_for_bit,
    assert_same_training,
    import_gpt,
    run_split,
    train_script,
)

from gpt.model import CONFIGS, GPT, GPTConfig

LAYOUTS = {  # (--parallel, ranks, --batch_size, --grad_accum, more): 12 sequences a step, as SPLITS
    "llama-tiny": [("ddp", *SPLITS[2]), ("fsdp", *SPLITS[1]), ("fsdp", 2, *TP_SPLIT, "--tp", "2"),
                   ("fsdp", 2, 2, 6, "--pp", "2"), ("fsdp", 8, 3, 2, "--pp", "2", "--tp", "2")],
    "qwen3-tiny": [("fsdp", *SPLITS[2]), ("fsdp", 2, *TP_SPLIT, "--tp", "2"),
                   ("hsdp", 8, 3, 1, "--shard_size", "2", "--tp", "2")],
    "llama-mini": [("fsdp", 2, 3, 4, "--pp", "2", "--pp_schedule", "ZBVZeroBubble"),
                   ("fsdp", 4, 3, 4, "--pp", "2", "--tp", "2", "--pp_schedule", "Interleaved1F1B")],
}


def one_process(model: str):
    return run_split("ddp", *SPLITS[0], "--model", model)


@pytest.mark.parametrize(("model", "layout"), [(m, layout) for m, layouts in LAYOUTS.items() for layout in layouts],
                         ids=[f"{m}-{' '.join(map(str, layout))}" for m, layouts in LAYOUTS.items()
                              for layout in layouts])
def test_the_llama_family_trains_in_every_layout_what_one_process_trains(model, layout):
    reference = one_process(model)
    losses = [r["loss"] for r in reference[0] if "loss" in r]
    assert losses[-1] < losses[0] - 0.1  # it learned something
    assert f"gpt {model} (" in reference[2]
    assert_same_training(reference, run_split(*layout, "--model", model), f"{model}: {layout}")


def test_activation_checkpointing_under_tp_with_qk_norm_changes_no_loss_bit_for_bit():
    """qwen3-tiny at tp 2, selective and full against none: every record and weight equal (fp32 on a CPU)."""
    layout = ("fsdp", 2, *TP_SPLIT, "--tp", "2", "--model", "qwen3-tiny")
    reference = run_split(*layout)
    for mode in ("selective", "full"):
        checkpointed = run_split(*layout, "--activation_checkpoint", mode)
        timeless = [[{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "val_loss", "lr")}
                     for r in run[0]] for run in (reference, checkpointed)]
        assert_bit_for_bit((timeless[0], reference[1]), (timeless[1], checkpointed[1]), f"qwen3-tiny tp 2, {mode}")


def test_the_tensor_parallel_proof_fails_with_the_qk_norms_gradients_left_partial():
    """tests/gpt_tp_no_reduce.py (the all-reduce over the tp ranks of the norms' partial gradients left out) on
    qwen3-tiny: its q and k norms see each rank's own heads only, so their gradients are partial too."""
    broken = train_script("gpt_tp_no_reduce.py", 2, *ARGV, "--parallel", "fsdp", "--tp", "2", "--batch_size",
                          str(TP_SPLIT[0]), "--grad_accum", str(TP_SPLIT[1]), "--model", "qwen3-tiny")
    with pytest.raises(AssertionError):
        assert_same_training(one_process("qwen3-tiny"), broken, "qwen3-tiny tp without the norms' reduction")


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_llama_proof_fails_without_the_gradient_reduction(parallel):
    """tests/gpt_no_sync.py (every backward's gradient sync off) on llama-tiny at 2 ranks: each rank steps on its own
    sequences only, and the comparison with one process must fail."""
    broken = train_script("gpt_no_sync.py", 2, *ARGV, "--parallel", parallel, "--batch_size", "2", "--grad_accum", "3",
                          "--model", "llama-tiny")
    with pytest.raises(AssertionError):
        assert_same_training(one_process("llama-tiny"), broken, f"llama-tiny {parallel} without gradient sync")


def test_the_families_differ_by_their_options_and_keep_gpt2s_names():
    """GPT-2's parameter names as before; the Llama family's: no biases, no position table, SwiGLU's gate, q and k
    norms where QK-norm is on, an lm_head of its own where untied; the parameter counts of the published shapes
    (Llama 3.2 1B, Llama 3.1 8B, Qwen3 0.6B and 8B, at their vocabularies: the hub's figures)."""
    def names(model: str) -> set[str]:
        with torch.device("meta"):
            return {n.split(".", 2)[-1] if n.startswith("blocks.") else n
                    for n, _ in GPT(GPTConfig(64, 32, **CONFIGS[model])).named_parameters()}
    assert names("tiny") == {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", *(
        f"{m}.{w}" for m in ("ln_1", "ln_2", "attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc", "mlp.proj")
        for w in ("weight", "bias"))}
    llama = {"wte.weight", "ln_f.weight", *(f"{m}.weight" for m in ("ln_1", "ln_2", "attn.q", "attn.k", "attn.v",
                                                                     "attn.o", "mlp.gate", "mlp.fc", "mlp.proj"))}
    assert names("llama-tiny") == llama | {"lm_head.weight"}
    assert names("qwen3-tiny") == llama | {"attn.q_norm.weight", "attn.k_norm.weight"}
    published = {"llama3.2-1b": (128256, 1_235_814_400), "llama3.1-8b": (128256, 8_030_261_248),
                 "qwen3-0.6b": (151936, 596_049_920), "qwen3-8b": (151936, 8_190_735_360)}
    for model, (vocab, count) in published.items():
        with torch.device("meta"):
            assert GPT(GPTConfig(vocab, 4096, **CONFIGS[model])).num_params() == count, model


@pytest.mark.parametrize(("nproc", "model", "argv", "error"), [
    (4, "llama-tiny", ["--tp", "4"], "--tp 4 does not divide the model's n_kv_head, 2"),
    (2, "llama-tiny", ["--tp", "2", "--seq_len", "33"], "--tp 2 does not divide the model's seq_len, 33"),
], ids=["kv-heads", "seq"])
def test_tp_refuses_a_degree_that_does_not_divide_the_kv_heads(nproc, model, argv, error, tmp_path):
    result = torchrun_in_process(nproc, "gpt/train.py", "--parallel", "fsdp", "--model", model, *argv, "--max_steps",
                                 "1", cwd=tmp_path, timeout=60)
    assert result.codes == [1] * nproc and "Traceback" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [f"error: {error}"]
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_written_before_the_families_resumes():
    """A manifest's config without the family's fields (a GPT-2 run's before them) is the same model."""
    checks = import_gpt("checks")
    config = checks.GPTConfig(64, 32, **CONFIGS["tiny"])  # its own GPTConfig: gpt/model.py imported as `model`
    assert checks.same_config({"vocab_size": 64, "seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 64,
                              "dropout": 0.0}, config)
    assert not checks.same_config({"vocab_size": 64, "seq_len": 32, **CONFIGS["llama-tiny"]}, config)
    assert not checks.same_config({"no such": 1}, config)


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-tiny"])
def test_a_checkpoint_resumes_bit_for_bit_in_its_layout_and_within_1e_5_in_one_process(model, tmp_path):
    """8 steps at pp 2 × tp 2 (4 ranks: the untied head on the last stage only, tp's k and v heads), a checkpoint at
    step 4; that step resumed by the same command (every record after it the same, bit for bit, and the exported
    weights), and by one process (DCP reshards: within 1e-5, a sum split otherwise)."""
    argv = [*ARGV, "--model", model, "--save_every", "4", "--export", "model.pt"]
    layout = ["--parallel", "fsdp", "--pp", "2", "--tp", "2", "--batch_size", "6", "--grad_accum", "2"]
    runs = {}
    for name, nproc, more in (("whole", 4, layout), ("same", 4, layout), ("one", 1, ["--batch_size", "2",
                                                                                    "--grad_accum", "6"])):
        folder = tmp_path / name
        folder.mkdir()
        if name != "whole":
            shutil.copytree(tmp_path / "whole" / "out" / "step_00000004", folder / "out" / "step_00000004")
        result = torchrun_in_process(nproc, "gpt/train.py", *argv, *more, cwd=folder, timeout=120)
        assert result.codes == [0] * nproc, result.stderr
        assert (name == "whole") != ("resuming from out/step_00000004: step 4 of 8" in result.stdouts[0])
        runs[name] = [{k: v for k, v in json.loads(line).items() if k in ("step", "loss", "grad_norm", "val_loss")}
                      for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in runs["whole"] if r["step"] > 4]
    assert [r for r in runs["same"] if r["step"] > 4] == after
    exported = {name: GPT.load(str(tmp_path / name / "model.pt")).state_dict() for name in ("whole", "same", "one")}
    assert all(torch.equal(exported["same"][k], v) for k, v in exported["whole"].items())
    one = [r for r in runs["one"] if r["step"] > 4]
    assert [r["step"] for r in one] == [r["step"] for r in after]
    for mine, theirs in zip(one, after, strict=True):
        for key in mine.keys() - {"step"}:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=0), (mine, theirs)

