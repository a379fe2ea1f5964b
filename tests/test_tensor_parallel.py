"""tensor_parallel.py: Megatron's split by hand and torch's parallelize_module, with and without sequence
parallel, give the logits and every gradient of one process, with the collectives the design says; each rank
holds the parameters it should; a broken collective goes red; the script runs and refuses what it cannot split."""
import copy

import pytest
import torch
from harness import spawn
from launch import torchrun
from test_errors import assert_one_line, run_main

import tensor_parallel
from gpt.model import GPT, GPTConfig

LAYERS, BATCH = 2, 3
SIZES = {2: (4, 64, 32), 3: (6, 96, 30), 4: (4, 64, 32)}  # ranks: (n_head, n_embd, seq_len), each divisible


def saved_floats(block: torch.nn.Module, batch: int, seq: int, d: int) -> float:
    """What one block's forward keeps for backward (parameters aside), in units of the whole activation,
    seq_len × batch × n_embd floats (the first block under sequence parallel takes its slice itself)."""
    params, storages = {p.untyped_storage().data_ptr() for p in block.parameters()}, {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(torch.randn(batch, seq, d, requires_grad=True))
    return sum(storages.values()) / (batch * seq * d * 4)


def part(whole: torch.Tensor, local: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The part of a whole tensor that a rank holds: all of it, or its chunk along the dimension that differs."""
    dims = [d for d in range(whole.dim()) if whole.shape[d] != local.shape[d]]
    return whole.chunk(world_size, dims[0])[rank] if dims else whole


def every_layout(rank: int, world_size: int) -> dict:
    """Each layout's (error, collectives, floats held) and a broken one's error, in one process group."""
    n_head, n_embd, seq_len = SIZES[world_size]
    reference = GPT(GPTConfig(tensor_parallel.VOCAB_SIZE, seq_len, LAYERS, n_head, n_embd))
    reference.init_weights(seed=1)
    tokens = torch.randint(tensor_parallel.VOCAB_SIZE, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(2))
    models = {(how, sp): parallelize(copy.deepcopy(reference), sp) for sp in (False, True) for how, parallelize in
              (("by hand", tensor_parallel.tensor_parallel), ("torch", tensor_parallel.torch_tensor_parallel))}
    broken = {sp: tensor_parallel.tensor_parallel(copy.deepcopy(reference), sp) for sp in (False, True)}
    tensor_parallel.loss_of(reference, tokens)[0].backward()
    results = {}
    for (how, sp), model in models.items():
        error, counts = tensor_parallel.check_step(how, model, reference, tokens, rank, world_size)
        held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
        results[how, sp] = error, counts, held
    for sp in (False, True):  # a second backward without zero_grad: every gradient twice one process's
        tensor_parallel.loss_of(models["by hand", sp], tokens)[0].backward()
        whole = dict(reference.named_parameters())
        results["accumulated", sp] = max((p.grad - 2 * part(whole[name].grad, p.grad, rank, world_size)).abs().max()
                                         for name, p in models["by hand", sp].named_parameters()).item()
    for sp in (False, True):  # activations saved for backward by the first block, in floats per s·b·h
        results["saved", sp] = saved_floats(models["by hand", sp].blocks[0], BATCH, seq_len, n_embd)  # SP: it splits
    results["saved", None] = saved_floats(reference.blocks[0], BATCH, seq_len, n_embd)
    entry = dict(tensor_parallel.ENTRY)
    tensor_parallel.ENTRY[False] = (None, None)  # f without its all-reduce of the input's gradient
    tensor_parallel.ENTRY[True] = (tensor_parallel.all_gather, tensor_parallel.split)  # no reduce-scatter: no sum
    try:
        results["broken"] = [tensor_parallel.check_step("broken", broken[sp], reference, tokens, rank, world_size)[0]
                             for sp in (False, True)]
    finally:
        tensor_parallel.ENTRY.update(entry)
    return results


@pytest.fixture(scope="module")
def layouts() -> dict[int, list[dict]]:
    return {n: spawn(every_layout, n, timeout=120)[0] for n in SIZES}


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("how", ["by hand", "torch"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["TP", "TP+SP"])
def test_logits_and_every_gradient_are_one_process_s(layouts, world_size, how, sequence_parallel):
    """fp32, to 1e-5: the ranks' partial sums are added in another order than one process's whole sums
    (measured: 2e-7 to 4e-7 on the logits, 5e-8 on the gradients)."""
    for result in layouts[world_size]:
        assert result[how, sequence_parallel][0] <= tensor_parallel.TOLERANCE


@pytest.mark.parametrize("world_size", SIZES)
def test_the_collectives_are_the_design_s(layouts, world_size):
    """Per block: TP, an all-reduce after each row-parallel matrix (2 forward); backward, the conjugate f's
    all-reduce, once per region by hand, once per column-parallel matrix in torch's (q, k, v and fc: 4).
    SP: an all-gather into each region and a reduce-scatter out of it, forward and backward, and one all-gather
    of the last block's output (backward: of the first block's input gradient); by hand the norms' and biases'
    gradients from the sequence slices are all-reduced in backward (6 per block), torch defers those sums."""
    L = LAYERS
    design = {("by hand", False): ({"all_reduce": 2 * L}, {"all_reduce": 2 * L}),
              ("torch", False): ({"all_reduce": 2 * L}, {"all_reduce": 4 * L}),
              ("by hand", True): ({"all_gather": 2 * L + 1, "reduce_scatter": 2 * L},
                                  {"all_gather": 2 * L + 1, "all_reduce": 6 * L, "reduce_scatter": 2 * L}),
              ("torch", True): ({"all_gather": 2 * L + 1, "reduce_scatter": 2 * L},
                                {"all_gather": 2 * L + 1, "reduce_scatter": 2 * L})}
    for result in layouts[world_size]:
        for layout, (forward, backward) in design.items():
            assert result[layout][1] == {"forward": forward, "backward": backward}, layout


@pytest.mark.parametrize("world_size", SIZES)
def test_each_rank_holds_the_replicated_parameters_and_its_share_of_the_split_ones(layouts, world_size):
    """Embeddings, norms and the row-parallel biases whole on every rank; per block 12 d² + 7 d split N ways."""
    n_head, d, seq_len = SIZES[world_size]
    replicated = tensor_parallel.VOCAB_SIZE * d + seq_len * d + 2 * d + LAYERS * 6 * d
    split = LAYERS * (12 * d * d + 7 * d)
    for result in layouts[world_size]:
        for layout, value in result.items():
            if layout != "broken" and layout[0] not in ("saved", "accumulated"):
                assert value[2] == replicated + split // world_size, layout


@pytest.mark.parametrize("world_size", SIZES)
def test_activations_kept_for_backward_shrink_as_the_playbook_s_formula_says(layouts, world_size):
    """In s·b·h floats per block (fp32, no dropout; the fused attention keeps no s × s matrix): one process
    17 (norm inputs 2, norm outputs 2, q k v 3, attention out 2, fc out and GELU out 8); TP splits all but the
    norms' 4: 4 + 13 / t; SP also slices the norm inputs, but keeps the 2 all-gathered norm outputs whole
    (Megatron-LM keeps the slice and gathers again in backward): 2 / t + 2 + 13 / t. Within 10%: the norms'
    statistics and the attention's log-sum-exp are left out."""
    t = world_size
    for result in layouts[world_size]:
        for layout, formula in ((None, 17), (False, 4 + 13 / t), (True, 2 / t + 2 + 13 / t)):
            assert result["saved", layout] == pytest.approx(formula, rel=0.1), (layout, result["saved", layout])


@pytest.mark.parametrize("world_size", SIZES)
def test_two_backwards_without_zero_grad_accumulate_as_one_process_s(layouts, world_size):
    """Sequence parallel's sums of the norms' and biases' gradients take each backward's part, not .grad
    (which under accumulation already holds the sum of earlier backwards): red with a post-accumulate hook."""
    for result in layouts[world_size]:
        assert result["accumulated", False] <= 2 * tensor_parallel.TOLERANCE
        assert result["accumulated", True] <= 2 * tensor_parallel.TOLERANCE


@pytest.mark.parametrize("world_size", SIZES)
def test_a_missing_gradient_sum_is_caught(layouts, world_size):
    for result in layouts[world_size]:
        assert min(result["broken"]) > 100 * tensor_parallel.TOLERANCE


def test_the_script_checks_itself_at_four_ranks_and_exits_cleanly():
    result = torchrun(4, "tensor_parallel.py", "--sequence_parallel", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if "from one process" in line]
    assert len(lines) == 8 and all(float(line.split(": ")[1].split()[0]) <= 1e-5 for line in lines)
    assert "terminate called" not in result.stderr and "Warning" not in result.stderr


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "start this script with torchrun"),
    (["--n_layer", "0"], {}, "--n_layer must be above 0"),
    ([], {"RANK": "0", "WORLD_SIZE": "3"}, "3 ranks must divide --n_head 4"),
    (["--sequence_parallel", "--seq_len", "30"], {"RANK": "0", "WORLD_SIZE": "4"}, "--n_head 4 and --seq_len 30"),
    (["--n_embd", "66"], {"RANK": "0", "WORLD_SIZE": "2"}, "--n_head 4 must divide --n_embd 66"),
])
def test_bad_input_is_one_line(argv, env, message):
    assert_one_line(*run_main("tensor_parallel.py", *argv, env=env)[::2], message)
