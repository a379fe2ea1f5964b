"""gpt/'s mixtures of experts: the layer against a loop over tokens, its auxiliary loss against transformers', the
layouts against one process (the same micro-batches: the auxiliary loss is each one's), DeepSeek's bias, a capacity
that drops, a router so skewed that two experts take every token and two none, a resume across world sizes, and
Qwen3-MoE both ways. moe-tiny is Qwen3-MoE's shape (softmax, the top 2 of 4 renormalised, QK-norm, an untied
head); moe-mini DeepSeek-V3's (sigmoid scores scaled by 2.5, a shared expert, a dense first block, the bias)."""
import functools
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import torchrun_in_process
from test_gpt import (
    ARGV,
    LOSS_RTOL,
    assert_same_training,
    strict_records,
    text_file,  # noqa: F401 (a fixture)
)
from test_gpt_hf import export
from test_gpt_sample import import_gpt
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from gpt.data import batch_starts, load, windows
from gpt.model import CONFIGS, GPT, GPTConfig, MoE, grouped

FOLDERS = tempfile.TemporaryDirectory()
hf = import_gpt("hf")  # gpt/hf.py, which imports gpt/model.py as `model`


@functools.cache
def run(nproc: int, env: tuple = (), *argv: str) -> tuple[list[dict], dict[str, torch.Tensor], str]:
    """(metrics.jsonl's records, the exported state_dict, rank 0's stdout) of tests/gpt_moe_options.py (train.py
    with moe-tiny changed by `env`'s MOE_OPTIONS, its biases started at MOE_BIAS's) in a fresh folder."""
    folder = Path(tempfile.mkdtemp(dir=FOLDERS.name))
    result = torchrun_in_process(nproc, "tests/gpt_moe_options.py", *ARGV, *argv, "--out_dir", "out", "--export",
                                 "model.pt", cwd=folder, env=dict(env), timeout=120)
    assert result.codes == [0] * nproc, f"{result.codes}\n{result.stdout}\n{result.stderr}"
    return strict_records(folder / "out" / "metrics.jsonl"), GPT.load(str(folder / "model.pt")).state_dict(), \
        result.stdouts[0]


def split(parallel: str, nproc: int, batch_size: int, grad_accum: int, *more: str, model: str, env: tuple = ()):
    return run(nproc, env, "--parallel", parallel, "--batch_size", str(batch_size), "--grad_accum", str(grad_accum),
               "--model", model, *more)


def assert_same_routing(reference, other, what: str) -> None:
    """assert_same_training, and the same auxiliary loss, load and share dropped at every step."""
    assert_same_training(reference, other, what)
    for key in ("aux_loss", "expert_load", "dropped"):
        mine, theirs = ([r.get(key) for r in records if "loss" in r] for records in (other[0], reference[0]))
        assert (None in mine) == (None in theirs), (key, what)
        if None not in mine:
            np.testing.assert_allclose(mine, theirs, rtol=LOSS_RTOL, err_msg=f"{what}: {key}")


# ---------------------------------------------------------------------------------------------------------------
# The layer


def by_token(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """MoE's output, one token at a time, each expert a loop of its own; and the choices dropped."""
    c, out, taken, dropped = moe.config, [], [0] * moe.config.n_expert, 0
    capacity = math.ceil(c.capacity_factor * x.shape[0] * x.shape[1] * c.top_k / c.n_expert) if c.capacity_factor \
        else None
    for token in x.reshape(-1, x.shape[-1]):
        logits = moe.router.weight @ token
        scores = logits.softmax(-1) if c.router == "softmax" else logits.sigmoid()
        bias = moe.expert_bias if moe.expert_bias is not None else 0
        chosen = (scores + bias).topk(c.top_k).indices
        weights = scores[chosen] / (scores[chosen].sum() if c.norm_topk else 1) * c.route_scale
        y = moe.shared(token) if moe.shared is not None else torch.zeros_like(token)
        for e, w in zip(chosen.tolist(), weights, strict=True):
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                dropped += 1
                continue
            gate, fc, proj = (p[e] for p in (moe.experts.gate, moe.experts.fc, moe.experts.proj))
            y = y + w * (proj @ (F.silu(gate @ token) * (fc @ token)))
        out.append(y)
    return torch.stack(out).view(x.shape), dropped


LAYERS = {
    "qwen3-moe": {},
    "deepseek": dict(router="sigmoid", route_scale=2.5, n_shared_expert=1, bias_rate=1e-3),
    "capacity": dict(capacity_factor=1.0),
    "skewed": dict(top_k=1, norm_topk=False, bias_rate=1e-3),  # biased: every token to expert 2, 0, 1 and 3 empty
    "top-4-of-4": dict(top_k=4, norm_topk=False),
}


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS.keys())
def test_the_moe_layer_is_each_token_through_its_experts(options):
    """MoE.forward (the choices sorted by expert, one grouped product per projection, the weighted sum) against
    by_token's loop, forward and backward, with the dropped choices counted alike."""
    config = GPTConfig(64, 16, **{**CONFIGS["moe-tiny"], **options})
    torch.manual_seed(0)
    moe = MoE(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.3)
        if moe.expert_bias is not None:
            moe.expert_bias.copy_(torch.tensor([0, 0, 5.0, 0]) if config.top_k == 1 else torch.randn(4) * 0.1)
    x = torch.randn(3, 16, 64, requires_grad=True)
    y = moe(x)
    expected, dropped = by_token(moe, x)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    counts, _, lost = moe.routed
    assert lost.item() == dropped and counts.sum().item() == 48 * config.top_k
    if options.get("capacity_factor"):
        assert dropped > 0  # the test drops something
    if config.top_k == 1 and config.bias_rate:
        assert counts.tolist() == [0, 0, 48, 0]
    grads = torch.autograd.grad(y.square().sum(), [x, *moe.parameters()])
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, *moe.parameters()])
    for mine, theirs in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6 * theirs.abs().max().item())  # sums' rounding


@pytest.mark.parametrize("width", [16, 6], ids=["grouped", "loop"])  # 6 floats: rows not a multiple of 16 bytes
def test_the_grouped_product_is_a_product_per_expert_with_empty_experts(width):
    torch.manual_seed(0)
    x, w = torch.randn(10, width, requires_grad=True), torch.randn(4, 8, width, requires_grad=True)
    counts = [3, 0, 7, 0]
    y = grouped(x, w, counts)
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    torch.testing.assert_close(y, expected)
    g = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, [x, w], g), torch.autograd.grad(expected, [x, w], g))


def test_the_auxiliary_loss_is_transformers_load_balancing_loss():
    """GPT.aux_loss of a forward against transformers' load_balancing_loss_func of the same router logits (each MoE
    layer's, taken by a hook), moe-tiny, and with a dense first block (which has none; moe-mini's sigmoid router has
    its own, from the scores normalised); and it is what training adds: the mean of the per-token losses is the
    cross-entropy plus aux_loss_coef times it."""
    for options in ({}, {"n_layer": 3, "first_dense": 1}):
        config = GPTConfig(64, 16, **{**CONFIGS["moe-tiny"], **options})
        model = GPT(config)
        model.init_weights(0)
        logits = []
        for layer in model.moe_layers():
            layer.router.register_forward_hook(lambda module, args, out, kept=logits: kept.append(out))
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
        losses = model(x, x)
        theirs = load_balancing_loss_func(tuple(logits), config.n_expert, config.top_k)
        assert len(logits) == config.n_layer - config.first_dense
        assert model.aux_loss(x.numel()).item() == pytest.approx(theirs.item(), rel=1e-6)
        model.eval()
        ce = model(x, x).mean()
        assert losses.mean().item() == pytest.approx(ce.item() + config.aux_loss_coef * theirs.item(), rel=1e-6)


def test_the_config_refuses_what_it_cannot_route():
    gpt2 = dict(family="gpt2", qk_norm=False, head_dim=None, n_kv_head=None, tie_head=True)
    for options, error in ((dict(top_k=5), "top_k 5: from 1 to n_expert, 4"), (dict(router="relu"), "router 'relu'"),
                           (gpt2, "family llama"), (dict(first_dense=2), "first_dense 2: from 0 to n_layer - 1, 1"),
                           (dict(aux_loss_coef=-1.0), "aux_loss_coef -1.0: 0 or more"),
                           (dict(capacity_factor=float("inf")), "capacity_factor inf")):
        with pytest.raises(ValueError, match=error):
            GPTConfig(64, 16, **{**CONFIGS["moe-tiny"], **options})


def test_the_published_moe_shapes_have_transformers_parameter_counts():
    """qwen3-30b-a3b against Qwen3MoeForCausalLM of its config.json's numbers (on meta: no memory)."""
    theirs = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, tie_word_embeddings=False)
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(theirs).parameters())
        ours = GPT(GPTConfig(151936, 4096, **CONFIGS["qwen3-30b-a3b"]))
    assert ours.num_params() == count == 30_532_122_624
    # active: 8 of 128 experts a token; 6 FLOPs per active weight that multiplies (not the untied embedding)
    experts = sum(p.numel() for layer in ours.moe_layers() for p in layer.experts.parameters())
    active = count - 151936 * 2048 - experts * 120 // 128
    c = ours.config
    assert ours.flops_per_token() == 6 * active + 12 * c.n_layer * c.n_head * c.head_dim * c.seq_len


# ---------------------------------------------------------------------------------------------------------------
# Layouts against one process

# (--parallel, ranks, --batch_size, --grad_accum, more): 12 sequences a step, micro-batches of 2 or 1, of 6 under tp
LAYOUTS = {
    "moe-tiny": [("ddp", 2, 2, 3), ("fsdp", 3, 2, 2), ("hsdp", 4, 1, 3), ("fsdp", 2, 2, 3, "--ep", "2"),
                 ("fsdp", 4, 1, 3, "--ep", "4"), ("hsdp", 4, 1, 3, "--shard_size", "2", "--ep", "2"),
                 ("fsdp", 2, 6, 2, "--tp", "2"), ("fsdp", 2, 2, 6, "--pp", "2"),
                 ("fsdp", 4, 2, 3, "--pp", "2", "--ep", "2"), ("fsdp", 4, 2, 6, "--pp", "2", "--tp", "2"),
                 ("fsdp", 4, 6, 2, "--cp", "2", "--tp", "2", "--cp_method", "ring"),
                 ("fsdp", 4, 2, 3, "--cp", "2", "--ep", "2")],
    "moe-mini": [("fsdp", 2, 2, 3), ("hsdp", 4, 1, 3), ("fsdp", 4, 1, 3, "--ep", "2")],
    # moe-mini's options on moe-tiny's width (moe-mini under tp or pp parts from one process by more than the
    # tolerances after 8 steps at lr 3e-3, up to 1.2e-4 in its third block's attn.o at 2 steps of tp 2, ten times
    # fsdp's, as llama-mini's under tp: rounding that Adam magnifies until a token's choice flips): 4 blocks, the
    # dense first, the shared expert, sigmoid scores, the bias; a V schedule's 4 stages, the first all dense
    # (fsdp 4 × tp 2 × ep 2 with these options alone, and tp 2 with moe-tiny's alone: the suite's budget)
    "deepseek-tiny": [("fsdp", 4, 6, 1, "--tp", "2", "--ep", "2"),
                      ("fsdp", 2, 2, 6, "--pp", "2", "--pp_schedule", "ZBVZeroBubble"), ("fsdp", 3, 2, 6, "--pp", "3"),
                      ("fsdp", 4, 2, 6, "--cp", "2", "--pp", "2", "--cp_method", "ulysses"),
                      ("fsdp", 2, 2, 6, "--cp", "2", "--ep", "2")],
}
DEEPSEEK = (("MOE_OPTIONS", '{"n_layer": 4, "router": "sigmoid", "route_scale": 2.5, "n_shared_expert": 1, '
                            '"first_dense": 1, "bias_rate": 0.001}'),)
MODELS = {"moe-tiny": ("moe-tiny", ()), "moe-mini": ("moe-mini", ()), "deepseek-tiny": ("moe-tiny", DEEPSEEK)}
SKEWED = (("MOE_OPTIONS", '{"bias_rate": 0.001}'), ("MOE_BIAS", "[1.0, 1.0, 0.0, 0.0]"))
CAPACITY = (("MOE_OPTIONS", '{"capacity_factor": 1.0}'),)


@pytest.mark.parametrize(("name", "layout"), [(m, layout) for m, layouts in LAYOUTS.items() for layout in layouts],
                         ids=[f"{m}-{' '.join(map(str, layout))}" for m, layouts in LAYOUTS.items()
                              for layout in layouts])
def test_a_mixture_of_experts_trains_in_every_layout_what_one_process_trains(name, layout):
    """The same micro-batches (one process at the layout's --batch_size): the loss with its auxiliary term, the
    gradient's norm, the validation loss, the auxiliary loss and the load logged, and every exported weight and
    expert bias, within the GPT-2 proofs' tolerances."""
    model, env = MODELS[name]
    reference = split("ddp", 1, layout[2], 12 // layout[2], model=model, env=env)
    losses = [r["loss"] for r in reference[0] if "loss" in r]
    assert losses[-1] < losses[0] - 0.1 and "aux_loss" in reference[0][0]
    if name != "moe-tiny":  # the bias moved, by 1e-3 a step
        biases = [v for k, v in reference[1].items() if k.endswith("expert_bias")]
        assert len(biases) == 3 and all(b.abs().max() > 1e-3 for b in biases)
    assert_same_routing(reference, split(*layout, model=model, env=env), f"{name}: {layout}")


@pytest.mark.parametrize(("env", "layout"), [(SKEWED, ("fsdp", 3, 2, 2)), (SKEWED, ("fsdp", 2, 2, 3, "--ep", "2")),
                                             (CAPACITY, ("fsdp", 3, 2, 2)), (CAPACITY, ("fsdp", 2, 2, 3, "--ep", "2"))],
                         ids=["skewed", "skewed-ep2", "capacity", "capacity-ep2"])
def test_a_skewed_router_and_a_capacity_train_in_other_layouts_what_one_process_trains(env, layout):
    """moe-tiny whose biases start at 1 for experts 0 and 1: every token takes both, experts 2 and 3 none, so the load
    is 2 (the busiest expert's count over the mean) at the first step, and at ep 2 one rank gets every token, the
    other none; and a capacity factor of 1, which drops."""
    reference = split("ddp", 1, 2, 6, model="moe-tiny", env=env)
    first = reference[0][0]
    if env is SKEWED:
        assert first["expert_load"] == 2.0
    else:
        assert 0 < first["dropped"] < 0.5
    assert_same_routing(reference, split(*layout, model="moe-tiny", env=env), str(env))


def test_the_moe_proof_fails_when_each_rank_moves_the_bias_on_its_own_tokens():
    """tests/gpt_moe_options.py with MOE_NO_REDUCE: each rank's expert biases move by its own counts alone, so the
    ranks' routing parts from one process's."""
    env = (("MOE_OPTIONS", '{"bias_rate": 0.01}'), ("MOE_NO_REDUCE", "1"))
    reference = split("ddp", 1, 2, 6, model="moe-tiny", env=env[:1])
    broken = split("fsdp", 3, 2, 2, model="moe-tiny", env=env)  # it runs: the failure below is the numbers'
    with pytest.raises(AssertionError):
        assert_same_routing(reference, broken, "no reduction of routing")


@pytest.mark.parametrize("mutant", ["MOE_NO_TP_SUM", "MOE_NO_TP_ROUTING", "MOE_NO_PP_ROUTING", "MOE_NO_CP_ROUTING",
                                    "MOE_NO_CP_AUX_GRAD"])
def test_the_tp_pp_and_cp_proofs_fail_without_their_sums(mutant):
    """tests/gpt_moe_options.py at tp 2 with the experts' gradients not summed over the tp ranks (each rank's its
    half of the sequence's), or the routing's sums for the auxiliary loss left each rank's own; at pp 2 with the
    routing not sent on from stage to stage (the auxiliary loss of the last stage's layers alone): not one
    process's training; at cp 2 with each cp rank's routing its own, or summed for the auxiliary loss but its
    gradient not (each rank's share of it 1/cp of what FSDP's mean over the cp ranks needs)."""
    reference = split("ddp", 1, 2, 6, model="moe-tiny")
    layout = ("--pp" if "PP" in mutant else "--cp" if "CP" in mutant else "--tp", "2")
    broken = split("fsdp", 2, 2, 6, *layout, model="moe-tiny", env=((mutant, "1"),))  # it runs to its end
    with pytest.raises(AssertionError):
        assert_same_routing(reference, broken, mutant)


def test_the_ep_proof_fails_when_the_combine_is_out_of_order_or_the_splits_swapped():
    """tests/gpt_moe_options.py at fsdp 2 × ep 2 with ep_forward changed in one place: its results sent back in its
    experts' order, not the order received (each token gets other tokens' rows): not one process's training; its
    dispatch's split sizes swapped (each rank sends as many rows to a rank as it receives from it): refused by
    all_to_all_single, the run stopped."""
    reference = split("ddp", 1, 2, 6, model="moe-tiny")
    broken = split("fsdp", 2, 2, 3, "--ep", "2", model="moe-tiny", env=(("MOE_EP_MUTANT", "combine"),))  # it runs
    with pytest.raises(AssertionError):
        assert_same_routing(reference, broken, "combine")
    folder = Path(tempfile.mkdtemp(dir=FOLDERS.name))
    swapped = torchrun_in_process(2, "tests/gpt_moe_options.py", *ARGV, "--parallel", "fsdp", "--ep", "2",
                                  "--batch_size", "2", "--grad_accum", "3", "--model", "moe-tiny", "--out_dir", "out",
                                  cwd=folder, env={"MOE_EP_MUTANT": "splits"}, timeout=120)
    assert swapped.codes != [0, 0] and "Split sizes doesn't match total dim 0 size" in swapped.stderr


def test_a_moe_checkpoint_resumes_in_its_layout_bit_for_bit_and_across_ep_degrees(tmp_path):
    """moe-mini, 8 steps under fsdp 2 × ep 2, a checkpoint at step 4 (the expert biases in it); resumed by the same
    command (every later record and weight the same, bit for bit), at fsdp 4 × ep 4, at pp 2 × ep 2 and by one
    process (within 1e-5: a sum split otherwise); hf.py exports the checkpoint folder, read in one process."""
    argv = [*ARGV, "--model", "moe-mini", "--save_every", "4", "--export", "model.pt", "--out_dir", "out"]
    ep2 = ["--parallel", "fsdp", "--ep", "2", "--batch_size", "2", "--grad_accum", "3"]
    runs = {}
    for name, nproc, more in (("whole", 2, ep2), ("same", 2, ep2),
                              ("four", 4, ["--parallel", "fsdp", "--ep", "4", "--batch_size", "1", "--grad_accum",
                                           "3"]),
                              ("pp", 4, [*ep2, "--pp", "2"]),
                              ("one", 1, ["--batch_size", "2", "--grad_accum", "6"])):
        folder = tmp_path / name
        folder.mkdir()
        if name != "whole":
            shutil.copytree(tmp_path / "whole" / "out" / "step_00000004", folder / "out" / "step_00000004")
        result = torchrun_in_process(nproc, "gpt/train.py", *argv, *more, cwd=folder, timeout=120)
        assert result.codes == [0] * nproc, result.stderr
        assert (name == "whole") != ("resuming from out/step_00000004: step 4 of 8" in result.stdouts[0])
        runs[name] = [{k: v for k, v in r.items() if k in ("step", "loss", "grad_norm", "val_loss", "aux_loss",
                                                             "expert_load")}
                      for r in strict_records(folder / "out" / "metrics.jsonl") if r["step"] > 4]
    exported = {name: GPT.load(str(tmp_path / name / "model.pt")).state_dict() for name in runs}
    assert runs["same"] == runs["whole"]
    assert all(torch.equal(exported["same"][k], v) for k, v in exported["whole"].items())
    # micro-batches of 1 at fsdp 4: another auxiliary loss; the biases resumed all the same (not zeros)
    assert any(k.endswith("expert_bias") for k in exported["four"])
    for mine, theirs in [pair for name in ("one", "pp") for pair in zip(runs[name], runs["whole"], strict=True)]:
        for key in mine.keys() - {"step"}:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=0), (key, mine, theirs)
    config, state, _ = hf.read(str(tmp_path / "whole" / "out" / "step_00000008"))
    assert all(torch.equal(state[k], v) for k, v in exported["whole"].items())


def test_full_activation_checkpointing_under_ep_changes_nothing_bit_for_bit():
    """fsdp 2 × ep 2, --activation_checkpoint full against none: each block's forward, its all-to-alls included,
    runs again in the backward, on every rank alike; every record and weight the same."""
    layout = ("fsdp", 2, 2, 3, "--ep", "2")
    reference, checkpointed = (split(*layout, *more, model="moe-tiny") for more in ((), ("--activation_checkpoint",
                                                                                         "full")))
    timeless = [[{k: v for k, v in r.items() if k not in ("tokens_per_s", "peak_rss_gib")} for r in run[0]]
                for run in (reference, checkpointed)]
    assert timeless[0] == timeless[1]
    assert all(torch.equal(v, checkpointed[1][k]) for k, v in reference[1].items())


@pytest.mark.parametrize(("nproc", "argv", "error"), [
    (2, ["--parallel", "ddp", "--ep", "2"], "--ep 2 needs --parallel fsdp or hsdp"),
    (3, ["--parallel", "fsdp", "--ep", "3"], "--ep 3 does not divide the model's 4 experts"),
    (3, ["--parallel", "fsdp", "--ep", "2"], "--ep 2 does not divide the 3 ranks that shard the weights"),
    (4, ["--parallel", "hsdp", "--shard_size", "2", "--ep", "4"], "--ep 4 does not divide the 2 ranks that shard"),
    (2, ["--parallel", "fsdp", "--ep", "2", "--model", "llama-tiny"], "--ep 2: the model has no experts"),
    (2, ["--parallel", "fsdp", "--ep", "0"], "--tp, --pp, --ep and --cp must be at least 1"),
    (2, ["--parallel", "fsdp", "--ep", "2", "--activation_checkpoint", "selective"], "--ep 2 and --activation_check"),
], ids=["ddp", "experts", "ranks", "shard-size", "dense", "zero", "selective"])
def test_an_ep_degree_that_does_not_fit_is_refused_in_one_line(nproc, argv, error, tmp_path):
    """The layout's options alone (ddp, 0): argparse's error (exit 2, from each rank until issue 61); with the
    model's experts: the job's one error line (exit 1)."""
    result = torchrun_in_process(nproc, "gpt/train.py", "--model", "moe-tiny", *argv, "--max_steps", "1",
                                 cwd=tmp_path, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    if "ddp" in argv or "0" in argv or "selective" in argv:
        assert result.codes == [2] * nproc and f"train.py: error: {error}" in result.stderr, result.stderr
    else:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.codes == [1] * nproc and len(errors) == 1 and errors[0].startswith(f"error: {error}"), \
            result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag", ["--tp", "--cp"])
def test_a_capacity_under_tp_or_cp_is_refused_in_one_line(flag, tmp_path):
    result = torchrun_in_process(2, "tests/gpt_moe_options.py", "--model", "moe-tiny", "--parallel", "fsdp", flag,
                                 "2", "--max_steps", "1", cwd=tmp_path, env=dict(CAPACITY), timeout=60)
    assert result.codes == [1, 1] and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {flag} 2 and a capacity factor: each {flag[2:]} rank routes its share of the sequence"), result.stderr
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------------
# Qwen3-MoE both ways


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    """A Qwen3MoeForCausalLM saved by transformers with random weights: 4 experts, the top 2 renormalised, a dense
    first block (mlp_only_layers), grouped-query attention, theta 1e6, an untied head 25 times its scale."""
    config = Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                            router_aux_loss_coef=0.01, max_position_embeddings=64, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # the norms' gains off 1
                param.add_(torch.rand_like(param) - 0.5)
            elif "embed" in name or "lm_head" in name:
                param.mul_(25)
            elif name.endswith("mlp.gate.weight"):  # a router of real preferences, not transformers' zeros
                param.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("hf") / "qwen3_moe"
    model.save_pretrained(folder)
    return folder


def test_gpt_reads_a_qwen3_moe_and_computes_transformers_logits(qwen3_moe):
    ours = GPT(GPTConfig(256, 32, **hf.shape(str(qwen3_moe))))
    assert ours.config.n_expert == 4 and ours.config.first_dense == 1 and ours.config.aux_loss_coef == 0.01
    ours.load_state_dict(hf.from_hf(str(qwen3_moe), ours.config))
    theirs = AutoModelForCausalLM.from_pretrained(qwen3_moe).eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), theirs(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("nproc", "layout"), [(1, ("--batch_size", "4", "--grad_accum", "2")),
                                               (2, ("--parallel", "fsdp", "--ep", "2", "--batch_size", "2",
                                                    "--grad_accum", "2"))],
                         ids=["one process", "fsdp 2 × ep 2"])
def test_the_first_loss_from_a_qwen3_moe_is_transformers_loss(nproc, layout, qwen3_moe, text_file, tmp_path):  # noqa: F811
    """Step 1's logged loss: transformers' cross-entropy over the 8 windows plus router_aux_loss_coef times the mean,
    over the micro-batches (of the layout's --batch_size), of load_balancing_loss_func of its router logits."""
    result = torchrun_in_process(nproc, "gpt/train.py", "--data", str(text_file), "--init_from", str(qwen3_moe),
                                 "--seq_len", "32", "--max_steps", "1", "--log_every", "1", "--eval_every", "100",
                                 *layout, "--out_dir", "out", cwd=tmp_path, timeout=120)
    assert result.codes == [0] * nproc, result.stderr
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    tokens = load(str(text_file), None, None)
    x, y = windows(tokens.train, batch_starts(0, 0, len(tokens.train), 32, 8), 32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(qwen3_moe).eval()
    size = int(layout[layout.index("--batch_size") + 1])
    with torch.no_grad():
        ce = F.cross_entropy(theirs(x).logits.flatten(0, 1), y.flatten()).item()
        aux = np.mean([load_balancing_loss_func(theirs(x[i:i + size], output_router_logits=True).router_logits, 4,
                                                2).item() for i in range(0, 8, size)])
    assert logged["aux_loss"] == pytest.approx(aux, rel=1e-5)
    assert logged["loss"] == pytest.approx(ce + 0.01 * aux, rel=1e-5, abs=0)


def test_a_trained_moe_exports_to_qwen3_moe_and_back_bit_for_bit(tmp_path):
    """moe-tiny trained under fsdp 2 × ep 2 (tests above): transformers' logits from the exported folder equal ours
    within 1e-5; read back, every weight the same, bit for bit."""
    _, state, _ = split("fsdp", 2, 2, 3, "--ep", "2", model="moe-tiny")
    config = GPTConfig(**{**CONFIGS["moe-tiny"], "vocab_size": state["wte.weight"].shape[0], "seq_len": 32})
    ours = GPT(config)
    ours.load_state_dict(state)
    from gpt.model import export as save

    save(str(tmp_path / "model.pt"), config, state)
    assert "Qwen3MoeForCausalLM, 2 layers" in export(str(tmp_path / "model.pt"), str(tmp_path / "hf"))
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(x), theirs(x).logits, rtol=0, atol=1e-5)
    back = hf.from_hf(str(tmp_path / "hf"), config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())


def test_what_qwen3_moe_lacks_is_refused_in_one_line(qwen3_moe, tmp_path):
    """An export of DeepSeek's routing (moe-mini: sigmoid, shared expert, bias), nothing written; a folder whose dense
    blocks are not the first ones, refused before anything is read."""
    config = GPTConfig(64, 32, **CONFIGS["moe-mini"])
    model = GPT(config)
    from gpt.model import export as save

    save(str(tmp_path / "model.pt"), config, model.state_dict())
    with pytest.raises(ValueError, match="a mixture of experts with a sigmoid router, which Qwen3MoeForCausalLM lacks"):
        hf.export(str(tmp_path / "model.pt"), str(tmp_path / "hf"), None)
    assert not (tmp_path / "hf").exists()
    folder = tmp_path / "odd"
    shutil.copytree(qwen3_moe, folder)
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**settings, "mlp_only_layers": [1]}))
    with pytest.raises(ValueError, match=r"a qwen3_moe model with dense blocks other than the first \(mlp_only_layers"):
        hf.shape(str(folder))
    for odd, error in (({"mlp_only_layers": [0, 1, 2]}, "first_dense 3: from 0 to n_layer - 1, 2"),
                       ({"mlp_only_layers": 1}, "mlp_only_layers 1 and router_aux_loss_coef"),
                       ({"router_aux_loss_coef": -1}, "router_aux_loss_coef -1"),
                       ({"router_aux_loss_coef": "0.01"}, "router_aux_loss_coef '0.01'")):
        (folder / "config.json").write_text(json.dumps({**settings, **odd}))
        with pytest.raises(ValueError, match=error):
            hf.shape(str(folder))
