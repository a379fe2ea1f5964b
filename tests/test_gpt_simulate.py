"""gpt/simulate.py: what each rank of a layout holds and sends in one step, counted in a real run (gloo) and
simulated in one process (torch's fake process group); the two equal, and both equal the formulas: the
bytes of each rank's shards, and the collectives tensor parallel's plan and FSDP make, counted by hand.

The formulas are written here from the model's shapes, not read from the code they check."""
import functools
import json
import math
import sys

import pytest
import torch
from harness import python_in_process, torchrun_in_process
from launch import REPO
from test_gpt import import_gpt

sys.path.insert(0, str(REPO))
from gpt.model import CONFIGS, GPT, GPTConfig  # noqa: E402

SIMULATE = "gpt/simulate.py"
TINY = ["--model", "tiny", "--vocab_size", "64", "--seq_len", "32", "--batch_size", "2"]
# (ranks, layout): every dimension a mesh can have, each size dividing every shape (no padding to count).
LAYOUTS = {"fsdp 4": (4, ["--parallel", "fsdp"]), "tp 2": (2, ["--parallel", "fsdp", "--tp", "2"]),
           "hsdp 2 × 2 × tp 2": (8, ["--parallel", "hsdp", "--shard_size", "2", "--tp", "2"])}


@functools.cache
def simulated(ranks: int, *argv: str) -> list[dict]:
    result = python_in_process(SIMULATE, "--ranks", str(ranks), *argv, "--json", cwd=REPO, timeout=180)
    assert result.codes == [0], result.stderr[-3000:]
    return json.loads(result.stdout)


def test_the_simulation_counts_what_a_real_run_sends():
    """hsdp 2 × 2 × tp 2: 8 real ranks on gloo, and each of the 8 simulated in one process: every rank's bytes
    held, and its count and bytes of each collective on each mesh dimension, equal."""
    ranks, layout = LAYOUTS["hsdp 2 × 2 × tp 2"]
    real = torchrun_in_process(ranks, SIMULATE, *TINY, *layout, "--json", timeout=120)
    assert real.codes == [0] * ranks, real.stderr
    counted = json.loads(real.stdouts[0])
    assert set(counted[0]["sent"]) == {"replicate", "shard", "tp"}
    assert counted == simulated(ranks, *TINY, *layout, "--every_rank")


def test_a_recomputed_forward_is_counted_as_a_real_run_sends_it():
    """--activation_checkpoint under tp 2: each block's forward runs again in its backward, and with it tp's
    collectives: sequence parallel's all-gather before attention and before the MLP, and the reduce-scatter after
    attention (torch's checkpoint stops early, before the MLP's). Real (selective, 2 ranks on gloo) and simulated
    equal; full recomputes the same collectives as selective (which recomputes all that it does not keep)."""
    ranks, layout = LAYOUTS["tp 2"]
    real = torchrun_in_process(ranks, SIMULATE, *TINY, *layout, "--activation_checkpoint", "selective", "--json",
                               timeout=120)
    assert real.codes == [0] * ranks, real.stderr
    selective = simulated(ranks, *TINY, *layout, "--activation_checkpoint", "selective", "--every_rank")
    assert json.loads(real.stdouts[0]) == selective
    none = simulated(ranks, *TINY, *layout)[0]["sent"]["tp"]  # as test_each_ranks_bytes_and_collectives_equal...
    full = simulated(ranks, *TINY, *layout, "--activation_checkpoint", "full")[0]["sent"]["tp"]
    assert full == selective[0]["sent"]["tp"]
    blocks, bsh = CONFIGS["tiny"]["n_layer"], 4 * 2 * 32 * CONFIGS["tiny"]["n_embd"]  # fp32, batch 2, seq 32
    assert full == {"all-gather": [none["all-gather"][0] + 2 * blocks, none["all-gather"][1] + 2 * blocks * bsh],
                    "reduce-scatter": [none["reduce-scatter"][0] + blocks, none["reduce-scatter"][1] + blocks * bsh],
                    "all-reduce": none["all-reduce"]}


@pytest.mark.parametrize("argv", [["--pp_schedule", "GPipe"],
                                  ["--parallel", "fsdp", "--pp", "2", "--precision", "fp16"],
                                  ["--parallel", "ddp", "--tp", "2"], ["--parallel", "ddp", "--pp", "2"],
                                  ["--parallel", "ddp", "--ep", "2"],
                                  ["--parallel", "fsdp", "--shard_size", "2"],
                                  ["--parallel", "fsdp", "--pp", "2", "--pp_schedule", "ZBVZeroBubble",
                                   "--activation_checkpoint", "selective"],
                                  ["--parallel", "hsdp", "--tp", "2", "--pp", "2", "--pp_schedule", "Interleaved1F1B",
                                   "--activation_checkpoint", "full", "--precision", "bf16"]])
def test_simulate_refuses_what_train_refuses(argv, capsys):
    """One function decides for both (parallelize.refused_layout): the same line, or both take the layout."""
    said = []
    for parse in (import_gpt().parse_args, import_gpt("simulate").parse_args):
        try:
            parse(argv + (["--ranks", "8"] if parse.__module__ == "simulate" else []))
            said.append(None)
        except SystemExit:
            said.append(capsys.readouterr().err.splitlines()[-1].split("error: ", 1)[1])
    assert said[0] == said[1], said
    assert (said[0] is None) == ("--activation_checkpoint" in argv and "full" in argv)


def test_a_pipeline_is_simulated_as_a_real_run_counts_it_and_as_the_formulas_say():
    """pp 3 × fsdp 2, the mini GPT (4 blocks: stages of 2, 1 and 1), 3 micro-batches of 2 × 32 tokens: 6 real ranks
    on gloo, and each simulated (every stage's shapes given up front), count the same, rank by rank. On the pp
    dimension, each stage sends each micro-batch's activation forward and its gradient back (2 × 32 × 128 floats)
    to its neighbours; the first and the last all-reduce their shards of the tied matrix's gradient (a group of
    their two ranks, "tied"), every stage the clipping norm's square over the pipeline. Within a stage, FSDP
    gathers each block and the stage's other parameters once a step (kept from the first forward to the step's
    end), and reduce-scatters their gradients once."""
    argv = ["--model", "mini", "--vocab_size", "64", "--seq_len", "32", "--batch_size", "2", "--parallel", "fsdp",
            "--pp", "3", "--grad_accum", "3"]
    real = torchrun_in_process(6, SIMULATE, *argv, "--json", timeout=120)
    assert real.codes == [0] * 6, real.stderr
    counted = json.loads(real.stdouts[0])
    assert counted == simulated(6, *argv, "--every_rank")
    params = shapes(GPTConfig(vocab_size=64, seq_len=32, **CONFIGS["mini"]))
    stages = [[n for n in params if n.startswith(("wte", "wpe", "blocks.0.", "blocks.1."))],
              [n for n in params if n.startswith("blocks.2.")],
              [n for n in params if n.startswith(("blocks.3.", "ln_f", "wte"))]]  # the head: wte's copy
    activation, m = 2 * 32 * 128 * 4, 3
    for rank, figures in enumerate(counted):
        stage = rank // 2  # pp outermost: ranks 0 and 1 hold stage 0
        whole = 4 * sum(params[n] for n in stages[stage])
        assert figures["mesh"] == {"pp": 3, "shard": 2}
        assert figures["held"]["parameters"] == whole // 2
        neighbours = (stage > 0) + (stage < 2)
        assert figures["sent"]["pp"] == {"send": [neighbours * m, neighbours * m * activation],
                                         "recv": [neighbours * m, neighbours * m * activation],
                                         "all-reduce": [1, 4]}, rank  # the clipping norm's square
        # the tied matrix: its shard's gradient, all-reduced between the first and the last stage (2 ranks)
        assert figures["sent"].get("tied") == ({"all-reduce": [1, params["wte.weight"] * 4 // 2]} if stage != 1
                                               else None), rank
        assert figures["wire"].get("tied") == (params["wte.weight"] * 4 // 2 if stage != 1 else None), rank
        rest = any(not n.startswith("blocks.") for n in stages[stage])  # embeddings, norm, head: none in the middle
        groups = len([n for n in stages[stage] if n.endswith("ln_1.weight")]) + rest  # each block, and the rest
        clipped = len(stages[stage]) - (stage == 2)  # the head's copy of the tied matrix is counted once, on wte
        assert figures["sent"]["shard"] == {"all-gather": [groups, whole], "reduce-scatter": [groups, whole],
                                            "all-reduce": [1, 4 * clipped]}, rank


def split_by_tp(name: str) -> bool:
    """Whether tensor parallel splits this parameter: all but the norms' and the row-parallel layers' biases."""
    return not (".ln_" in name or name.startswith("ln_f") or name.endswith(("attn.o.bias", "mlp.proj.bias")))


def shapes(config: GPTConfig) -> dict[str, int]:
    """The GPT's parameters and their sizes, the tied head once, written out from gpt/model.py's shapes."""
    h, v, s = config.n_embd, config.vocab_size, config.seq_len
    block = {"ln_1.weight": h, "ln_1.bias": h, "ln_2.weight": h, "ln_2.bias": h, "mlp.fc.weight": 4 * h * h,
             "mlp.fc.bias": 4 * h, "mlp.proj.weight": 4 * h * h, "mlp.proj.bias": h,
             **{f"attn.{x}.weight": h * h for x in "qkvo"}, **{f"attn.{x}.bias": h for x in "qkvo"}}
    return {"wte.weight": v * h, "wpe.weight": s * h, "ln_f.weight": h, "ln_f.bias": h,
            **{f"blocks.{i}.{k}": n for i in range(config.n_layer) for k, n in block.items()}}


def plan(config: GPTConfig, batch: int, mesh: dict[str, int]) -> tuple[int, dict]:
    """(bytes of rank 0's parameters, {dimension: {collective: [count, bytes]}}) in fp32, from the shapes: FSDP
    gathers each block in the forward and again in the backward (freed between) but the last (kept for its backward,
    which comes next), the root (embeddings, final norm, tied head) once; it reduce-scatters each group's gradients
    once, and HSDP all-reduces each group's shard across the replicas. Tensor parallel with sequence parallel: per
    block, an all-gather before attention and the MLP and a reduce-scatter after each (b × s × h), and the reverse
    in the backward; wte's and wpe's outputs reduce-scattered, the head's input gathered (and the reverse in the
    backward); the norms' gradients, summed over the sequence's shards, all-reduced (4 a block, 2 for ln_f); the
    loss on the vocabulary's shards, 3 all-reduces of b × s (the max, the sum of exponentials, the target's logit).
    Clipping: the norm of each parameter, all-reduced once over each dimension that splits parameters."""
    L, h, s = config.n_layer, config.n_embd, config.seq_len
    tp, shard = mesh.get("tp", 1), mesh.get("shard", 1)
    local = {name: n // (tp if split_by_tp(name) else 1) for name, n in shapes(config).items()}  # one tp rank's
    block = sum(n for name, n in local.items() if name.startswith("blocks.0."))
    root = sum(n for name, n in local.items() if not name.startswith("blocks."))
    per_rank = 4 * sum(local.values()) // shard
    sent = {}
    if shard > 1:  # a shard group of one rank (tp alone) sends nothing
        sent["shard"] = {"all-gather": [2 * L, 4 * ((2 * L - 1) * block + root)],
                         "reduce-scatter": [L + 1, 4 * (L * block + root)], "all-reduce": [1, 4 * len(local)]}
    if "replicate" in mesh:
        sent["replicate"] = {"all-reduce": [L + 1, per_rank]}
    if tp > 1:
        bsh = 4 * batch * s * h
        sent["tp"] = {"all-gather": [4 * L + 3, (4 * L + 2) * bsh + 4 * s * h],
                      "reduce-scatter": [4 * L + 3, (4 * L + 2) * bsh + 4 * s * h],
                      "all-reduce": [4 * L + 2 + 3 + 1, 4 * (4 * L + 2) * h + 3 * 4 * batch * s + 4 * len(local)]}
    return per_rank, sent


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_ranks_bytes_and_collectives_equal_the_formulas(layout):
    ranks, argv = LAYOUTS[layout]
    every = simulated(ranks, *TINY, *argv, *(["--every_rank"] if ranks == 8 else []))  # 8: the real run's, cached
    assert all(rank == every[0] for rank in every)  # no rank holds or sends more: every shape divides
    figures = every[0]
    config = GPTConfig(vocab_size=64, seq_len=32, **CONFIGS["tiny"])
    params, sent = plan(config, 2, figures["mesh"])
    assert figures["held"] == {"parameters": params, "gradients": params, "optimizer": 2 * params}
    assert figures["sent"] == sent
    # The Playbook's ZeRO-3 rule, Ψ / (shard × tp) per rank, less what tp leaves whole on each of its ranks (norms
    # and two biases a block): within 1% at these sizes.
    psi = 4 * sum(shapes(config).values())
    assert math.isclose(params, psi / (figures["mesh"].get("shard", 1) * figures["mesh"].get("tp", 1)), rel_tol=2e-2)


def test_gpt2_at_1024_ranks_is_simulated_and_still_equals_the_formulas():
    """GPT-2 124M on hsdp 16 × 16 × tp 4: 1,024 ranks, each a process a laptop could not start, in one process."""
    (figures,) = simulated(1024, "--model", "gpt2", "--parallel", "hsdp", "--shard_size", "16", "--tp", "4",
                           "--batch_size", "1")
    assert figures["mesh"] == {"replicate": 16, "shard": 16, "tp": 4}
    params, sent = plan(GPTConfig(vocab_size=50304, seq_len=1024, **CONFIGS["gpt2"]), 1, figures["mesh"])
    assert figures["held"]["parameters"] == params
    assert figures["sent"] == sent


def test_a_pipeline_at_1024_ranks_is_simulated_and_equals_the_formulas():
    """GPT-2 124M on pp 4 × fsdp 64 × tp 4, 4 micro-batches of one sequence. Rank 0 holds the first stage (the
    embeddings and 3 blocks): it sends each micro-batch's activation (1024 / 4 tokens under sequence parallel,
    × 768) to stage 1 and receives its gradient back; all-reduces its shard of the tied matrix with the last stage
    (tp's 50304 / 4 rows, then FSDP's chunk of them: the first ranks' chunks round up), on a group of two ranks,
    and the clipping norm's square over the pipeline; FSDP gathers each of its 4 groups once in the step."""
    (figures,) = simulated(1024, "--model", "gpt2", "--parallel", "fsdp", "--tp", "4", "--pp", "4", "--batch_size",
                           "1", "--grad_accum", "4")
    assert figures["mesh"] == {"pp": 4, "shard": 64, "tp": 4}
    activation, rows = 1024 // 4 * 768 * 4, math.ceil(50304 // 4 / 64)
    assert figures["sent"]["pp"] == {"send": [4, 4 * activation], "recv": [4, 4 * activation], "all-reduce": [1, 4]}
    assert figures["sent"]["tied"] == {"all-reduce": [1, rows * 768 * 4]}
    assert figures["wire"]["tied"] == rows * 768 * 4  # a pair's all-reduce: each sends the tensor once, in a ring
    assert figures["sent"]["shard"]["all-gather"][0] == 3 + 1


@pytest.mark.parametrize(("argv", "error"), [
    (["--ranks", "1024", "--model", "gpt2", "--tp", "8"], "error: --tp 8 does not divide the model's n_head, 12"),
    (["--ranks", "2", "--parallel", "ddp"], "ddp holds the whole model on every rank"),
    (["--ranks", "6", "--model", "moe-tiny", "--ep", "3"], "error: --ep 3 does not divide the model's 4 experts")])
def test_a_layout_that_cannot_be_built_is_one_line(argv, error):
    result = python_in_process(SIMULATE, *argv, cwd=REPO, timeout=60)  # a traceback shows there as in a shell
    assert result.codes[0] != 0 and error in result.stderr, result.stderr
    said = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert len(said) == 1 and "Traceback" not in result.stderr, result.stderr


def test_plot_draws_each_layouts_bytes_from_simulate_json(tmp_path):
    """gpt/plot.py --layouts: one bar per file, named for it, stacked to the bytes the file says a rank holds."""
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "gpt"))
    try:
        from plot import plot_layouts
    finally:
        sys.path.remove(str(REPO / "gpt"))
    files = []
    for name, (ranks, argv) in LAYOUTS.items():
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(simulated(ranks, *TINY, *argv, *(["--every_rank"] if ranks == 8 else []))))
    figure = plot_layouts([str(f) for f in files], str(tmp_path / "layouts.png"))
    held = figure.axes[0]
    assert [t.get_text() for t in held.get_xticklabels()] == list(LAYOUTS)
    tops = [max(bar.get_y() + bar.get_height() for bar in held.patches if bar.get_x() <= i < bar.get_x() + 1)
            for i in range(len(LAYOUTS))]
    for top, file in zip(tops, files, strict=True):
        assert math.isclose(top, sum(json.loads(file.read_text())[0]["held"].values()) / 2**30, rel_tol=1e-9)


def llama_shapes(config: GPTConfig) -> dict[str, tuple[int, bool]]:
    """The Llama family's parameters: {name: (size, whether tp splits it)}, written out from gpt/model.py's shapes:
    q and o of n_head heads, k and v of n_kv_head, SwiGLU's three matrices, the norms' gains (QK-norm's of head_dim,
    whole on every tp rank), an untied head of its own (split by tp over the vocabulary, as the embedding)."""
    h, v, f = config.n_embd, config.vocab_size, config.ffn_hidden
    q, kv = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    block = {"ln_1.weight": (h, False), "ln_2.weight": (h, False), "attn.q.weight": (q * h, True),
             "attn.k.weight": (kv * h, True), "attn.v.weight": (kv * h, True), "attn.o.weight": (h * q, True),
             "mlp.gate.weight": (f * h, True), "mlp.fc.weight": (f * h, True), "mlp.proj.weight": (h * f, True),
             **({"attn.q_norm.weight": (config.head_dim, False), "attn.k_norm.weight": (config.head_dim, False)}
                if config.qk_norm else {})}
    head = {} if config.tie_head else {"lm_head.weight": (v * h, True)}
    return {"wte.weight": (v * h, True), "ln_f.weight": (h, False), **head,
            **{f"blocks.{i}.{k}": n for i in range(config.n_layer) for k, n in block.items()}}


def llama_bytes(config: GPTConfig, mesh: dict[str, int]) -> int:
    """Rank 0's parameters' bytes in fp32: each parameter's tp share, then FSDP's shard of it (every size divides)."""
    tp, shard = mesh.get("tp", 1), mesh.get("shard", 1)
    return sum(4 * n // (tp if split else 1) // shard for n, split in llama_shapes(config).values())


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3-tiny"])
def test_the_llama_family_is_simulated_as_a_real_run_holds_and_sends_it(model):
    """fsdp 2 × tp 2 on 4 real ranks and simulated: every rank's bytes and collectives equal; the bytes held equal
    the shapes' (the smaller k and v, SwiGLU's three matrices, llama-tiny's untied head, qwen3-tiny's QK-norm)."""
    argv = ["--model", model, "--vocab_size", "64", "--seq_len", "32", "--batch_size", "2", "--parallel", "fsdp",
            "--tp", "2"]
    real = torchrun_in_process(4, SIMULATE, *argv, "--json", timeout=120)
    assert real.codes == [0] * 4, real.stderr
    counted = json.loads(real.stdouts[0])
    assert counted == simulated(4, *argv, "--every_rank")
    params = llama_bytes(GPTConfig(vocab_size=64, seq_len=32, **CONFIGS[model]), counted[0]["mesh"])
    assert counted[0]["held"] == {"parameters": params, "gradients": params, "optimizer": 2 * params}


def test_llama_3_1_8b_at_1024_ranks_holds_what_its_shapes_say():
    """Llama 3.1 8B (vocab 128256, 8192 tokens) on hsdp 16 × 16 × tp 4: rank 0 holds 1/64 of its 8.03B weights."""
    (figures,) = simulated(1024, "--model", "llama3.1-8b", "--vocab_size", "128256", "--seq_len", "8192", "--parallel",
                           "hsdp", "--shard_size", "16", "--tp", "4", "--batch_size", "1", "--precision", "bf16")
    assert figures["mesh"] == {"replicate": 16, "shard": 16, "tp": 4}
    config = GPTConfig(vocab_size=128256, seq_len=8192, **CONFIGS["llama3.1-8b"])
    assert figures["held"]["parameters"] == llama_bytes(config, figures["mesh"])
    assert sum(n for n, _ in llama_shapes(config).values()) == 8_030_261_248  # the hub's count for the model
    assert figures["sent"]["replicate"]["all-reduce"][1] == figures["held"]["parameters"]  # the gradients' shard, fp32


MOE = ["--vocab_size", "64", "--seq_len", "32", "--batch_size", "2", "--parallel", "fsdp", "--ep", "2"]


def moe_plan(config: GPTConfig, layers: int, tokens: int, micro_batches: int, ep: int, expert_shard: int,
             precision: int = 4) -> tuple[int, list]:
    """(bytes of a rank's experts' parameters in fp32, [count, bytes] of its all-to-alls in a step), from the
    shapes: each of its MoE `layers`' experts (3 projections, experts × expert_hidden × n_embd) split over ep, then
    expert_shard; each layer's all-to-alls in each micro-batch, routed evenly (`tokens` a rank routes, top_k choices
    each): the counts (int64, one per expert), the chosen rows out and back, and the two gradients the other way."""
    experts = layers * 3 * config.n_expert * config.expert_hidden * config.n_embd * 4 // (ep * expert_shard)
    rows = tokens * config.top_k * config.n_embd * precision
    return experts, [5 * layers * micro_batches, layers * micro_batches * (8 * config.n_expert + 4 * rows)]


@pytest.mark.parametrize("layout", [["--pp", "2", "--grad_accum", "2"], ["--tp", "2"]])
def test_a_mixture_of_experts_is_simulated_as_a_real_run_holds_and_sends_it(layout):
    """moe-mini (DeepSeek's options: a shared expert, a dense first block, the bias) with ep 2 from fsdp's ranks:
    at pp 2 (the routing's sums sent on beside the activations) on 4 real ranks and simulated, both routed evenly
    (simulated tensors hold no values to route by), every rank's figures equal; at pp 2 and at tp 2 (each tp rank
    routes its share of the sequence), each rank's experts' bytes and all-to-alls equal the shapes'."""
    argv = ["--model", "moe-mini", *MOE, *layout]
    figures = simulated(4, *argv, "--every_rank")
    config = GPTConfig(vocab_size=64, seq_len=32, **CONFIGS["moe-mini"])
    if "--pp" in layout:  # one real run: tp's collectives are counted for real by the tests above
        real = torchrun_in_process(4, SIMULATE, *argv, "--json", timeout=120)
        assert real.codes == [0] * 4, real.stderr
        counted = json.loads(real.stdouts[0])
        for rank, (mine, theirs) in enumerate(zip(counted, figures, strict=True)):
            # the one difference: a real run's experts take torch._grouped_mm, which keeps its int32 offsets for the
            # backward (one per local expert, for each of the 3 projections); the fake tensors', a loop, none
            blocks = range(rank // 2 * 2, rank // 2 * 2 + 2)  # its stage's (pp outermost: ranks 0 and 1, stage 0)
            offsets = [3 * 4 * config.n_expert // 2 if block >= config.first_dense else 0 for block in blocks]
            assert mine.pop("activations") == [n + o for n, o in zip(theirs["activations"], offsets, strict=True)]
        assert counted == [{k: v for k, v in theirs.items() if k != "activations"} for theirs in figures]
    pp = "--pp" in layout
    for rank, mine in enumerate(figures):
        layers = mine["moe_layers"]  # pp: its stage's, 1 (after the dense first block) or 2
        experts, sent = moe_plan(config, layers, 2 * 32 // (1 if pp else 2), 2 if pp else 1, 2,
                                 mine["mesh"]["expert_shard"])
        assert mine["experts"] == experts and mine["sent"]["ep"]["all-to-all"] == sent, rank
    stages = {rank // 2 if pp else 0: mine["moe_layers"] for rank, mine in enumerate(figures)}
    assert sum(stages.values()) == config.n_layer - config.first_dense


def test_a_group_that_is_two_dimensions_is_named_for_both():
    """fsdp 2 with ep 2: the shard group and the ep group are both the world's, so FSDP's gathers and the experts'
    all-to-alls share one row name, "shard = ep", not the experts' alone."""
    (figures,) = simulated(2, "--model", "moe-tiny", *MOE)
    assert set(figures["sent"]) == {"shard = ep"}
    config = GPTConfig(vocab_size=64, seq_len=32, **CONFIGS["moe-tiny"])
    assert figures["sent"]["shard = ep"]["all-to-all"] == moe_plan(config, 2, 64, 1, 2, 1)[1]
    assert figures["sent"]["shard = ep"]["all-gather"][0] == 4  # FSDP's: 2 blocks twice, less the last, and the root


def test_qwen3_30b_a3b_at_1024_ranks_holds_and_sends_what_its_shapes_say():
    """Qwen3-30B-A3B (128 experts, 8 a token) on hsdp 16 × 64 with ep 8, in bf16, 4,096 tokens a rank: each rank
    holds 16 of each layer's experts, an eighth of them (expert_shard 8); each layer sends 4 × 4,096 × 8 rows of
    2,048 bf16 values and 128 counts; the FLOPs per token are the active parameters' (test_gpt_moe.py checks them
    against transformers' count)."""
    (figures,) = simulated(1024, "--model", "qwen3-30b-a3b", "--vocab_size", "151936", "--seq_len", "4096",
                           "--parallel", "hsdp", "--shard_size", "64", "--ep", "8", "--precision", "bf16")
    assert figures["mesh"] == {"replicate": 16, "shard": 64, "expert_shard": 8, "ep": 8}
    config = GPTConfig(vocab_size=151936, seq_len=4096, **CONFIGS["qwen3-30b-a3b"])
    experts, sent = moe_plan(config, 48, 4096, 1, 8, 8, precision=2)
    assert figures["experts"] == experts == 48 * 3 * 128 * 768 * 2048 * 4 // 64
    assert figures["sent"]["ep"]["all-to-all"] == sent == [5 * 48, 48 * (8 * 128 + 4 * 4096 * 8 * 2048 * 2)]
    with torch.device("meta"):
        assert figures["flops_per_token"] == GPT(config).flops_per_token()


CP = ["--model", "llama-tiny", "--vocab_size", "64", "--seq_len", "32", "--batch_size", "2", "--parallel", "fsdp"]


@pytest.mark.parametrize(("method", "tp"), [("allgather", 1), ("ulysses", 1), ("ring", 2)])
def test_context_parallel_is_simulated_as_a_real_run_counts_it(method, tp):
    """cp 2 on 4 real ranks and simulated, each method (allgather and ulysses at shard 2 × cp 2, the ring at cp 2 ×
    tp 2): every rank's bytes held, its collectives (FSDP's on shard_cp, attention's on cp: the all-gathers and
    reduce-scatters, the all-to-alls, the ring's sends and receives; tp's) and the activations each block keeps for
    its backward, equal; the weights sharded over shard × cp (and split over tp), not replicated over cp."""
    argv = [*CP, "--cp", "2", "--cp_method", method, "--tp", str(tp)]
    real = torchrun_in_process(4, SIMULATE, *argv, "--json", timeout=120)
    assert real.codes == [0] * 4, real.stderr
    counted = json.loads(real.stdouts[0])
    shard = 4 // (2 * tp)
    assert counted[0]["mesh"] == {"shard": shard, "cp": 2, **({"tp": tp} if tp > 1 else {}), "shard_cp": 2 * shard}
    assert set(counted[0]["sent"]) == {"shard_cp", "cp", *(["tp"] if tp > 1 else [])}
    assert counted == simulated(4, *argv, "--every_rank")
    params = llama_bytes(GPTConfig(vocab_size=64, seq_len=32, **CONFIGS["llama-tiny"]), {"shard": 2 * shard, "tp": tp})
    assert counted[0]["held"]["parameters"] == params


@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_methods_bytes_per_block_are_its_formula(cp):
    """llama-tiny (4 q heads, 2 k and v heads of 16), 2 sequences of 32 tokens on 8 simulated ranks: per block, in
    fp32, with T = 32 / cp tokens a rank and kv(h) = 2 × h × T × 16 × 4 bytes, a tensor of h heads of a rank's
    tokens. allgather: k and v gathered (cp × kv(2) each), their gradients reduce-scattered back; ulysses: q, k, v
    and the output each through an all-to-all, forward and backward (k and v repeated to 4 heads where cp does not
    divide 2); ring: k and v sent cp - 1 times forward, again in the backward, beside the sums of their gradients,
which go one step more (home): 2 (cp - 1) + 2 (cp - 1) + 2 cp sends, each kv(2)."""
    config = CONFIGS["llama-tiny"]
    layers, heads, kv_heads, dim = config["n_layer"], config["n_head"], config["n_kv_head"], 16

    def part(h: int) -> int:
        return 2 * h * (32 // cp) * dim * 4
    kv = kv_heads if kv_heads % cp == 0 else heads
    gathered = [2, 2 * cp * part(kv_heads)]
    expected = {"allgather": {"all-gather": gathered, "reduce-scatter": gathered},
                "ulysses": {"all-to-all": [8, 4 * part(heads) + 4 * part(kv)]},
                "ring": {"send": [6 * cp - 4, (6 * cp - 4) * part(kv_heads)],
                         "recv": [6 * cp - 4, (6 * cp - 4) * part(kv_heads)]}}
    for method, per_block in expected.items():
        (figures,) = simulated(8, *CP, "--cp", str(cp), "--cp_method", method)
        assert figures["sent"]["cp"] == {kind: [layers * n for n in pair] for kind, pair in per_block.items()}, method


def test_a_ranks_activations_fall_with_cp():
    """The activations a rank keeps for its backward (measured: the bytes autograd saves inside each block, each
    storage once), for 2 sequences of 64 tokens: at cp 4 under half of one rank's at cp 1, whichever the method, so
    a sequence whose activations exceed what one rank may hold (here, half of them) trains under cp 4."""
    argv = [*CP[:5], "64", *CP[6:]]
    whole = sum(simulated(4, *argv)[0]["activations"])
    for method in ("allgather", "ulysses", "ring"):
        by_cp = [sum(simulated(4, *argv, "--cp", str(cp), "--cp_method", method)[0]["activations"]) for cp in (2, 4)]
        assert whole > by_cp[0] > by_cp[1] and by_cp[1] < whole / 2, (method, whole, by_cp)
