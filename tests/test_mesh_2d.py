"""mesh_2d.py: FSDP2 × tensor parallel on a 2 × 2 mesh of 4 ranks trains to one process's weights, each rank
holding the share of the parameters and of Adam's state its place on the mesh gives it; without the data-
parallel dimension's averaging the run fails its own check."""
import re
import sys

import pytest
import torch
from harness import spawn
from test_errors import assert_one_line, run_main
from workers import failure

import mesh_2d
from gpt.model import GPT, GPTConfig

HELD = re.compile(r"^\[rank (\d)/4\] mesh \(dp (\d), tp (\d)\) \| parameters ([\d,]+) bytes \| optimizer state "
                  r"([\d,]+) bytes$", re.MULTILINE)


def train(rank: int, world_size: int, argv: list[str]) -> dict[str, torch.Tensor]:
    """mesh_2d.py's train() with argv parsed as the script parses it: the whole weights, on every rank."""
    sys.argv = ["mesh_2d.py", *argv]
    return mesh_2d.train(mesh_2d.parse_args(), rank, world_size)


def both(rank: int, world_size: int) -> dict:
    """The default 2 × 2 mesh, one row of 4 (tensor parallel only), and a broken run, in one process group."""
    results = {"weights": train(rank, world_size, [])}
    results["one row"] = train(rank, world_size, ["--tp", "4", "--steps", "3"])
    original = mesh_2d.parallelize

    def without_gradient_sync(model, mesh):  # FSDP2 skips its reduce-scatter of the gradients down the column
        original(model, mesh).set_requires_gradient_sync(False)
        return model
    results["broken"] = failure(lambda: train(rank, world_size, ["--steps", "2"]), mesh_2d, "parallelize",
                                without_gradient_sync)
    return results


@pytest.fixture(scope="module")
def run() -> tuple[list[dict], list[str]]:
    return spawn(both, 4, timeout=120)


def test_the_mesh_trains_to_one_process_s_weights(run):
    """10 AdamW steps at lr 3e-3, to 1e-4: each row's gradients are the mean of two halves' where one process
    takes one mean, in fp32, and Adam divides each number's gradient by its own RMS, so a near-zero
    gradient's tiny difference changes its step (measured 2.6e-5)."""
    model = GPT(GPTConfig(mesh_2d.VOCAB_SIZE, 32, 2, 4, 64))
    model.init_weights(seed=0)
    tokens = torch.randint(mesh_2d.VOCAB_SIZE, (8, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):
        mesh_2d.loss_of(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    for result in run[0]:
        assert set(result["weights"]) == {name for name, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            assert torch.allclose(result["weights"][name], p.detach(), atol=1e-4, rtol=0), name


def test_each_rank_holds_its_share_of_the_parameters_and_of_adam_s_state(run):
    """Per block 12 d² + 7 d numbers are split along the row and down the column (by 4); the embeddings, the
    norms and the row-parallel biases (6 d per block) only down the column (by 2). Adam: two numbers each."""
    d, layers = 64, 2
    split = layers * (12 * d * d + 7 * d)
    whole_along_row = mesh_2d.VOCAB_SIZE * d + 32 * d + 2 * d + layers * 6 * d
    places = set()
    for rank, dp, tp, parameters, state in [HELD.findall(stdout)[0] for stdout in run[1]]:  # not the broken run's
        assert int(parameters.replace(",", "")) == 4 * (split // 4 + whole_along_row // 2)
        assert int(state.replace(",", "")) == 2 * int(parameters.replace(",", ""))
        places.add((int(dp), int(tp)))
        assert int(rank) == 2 * int(dp) + int(tp)  # rows of consecutive ranks: tp is the inner dimension
    assert places == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_without_the_data_parallel_average_the_run_fails_its_check(run):
    assert all("weights differ from one process's" in result["broken"] for result in run[0])


def test_one_row_of_four_trains_too(run):
    """--tp 4: tensor parallel only; its own check passed (it raises past 1e-4), and every rank gathered the same."""
    assert all(set(result["one row"]) == set(run[0][0]["weights"]) for result in run[0])
    for result in run[0][1:]:
        assert all(torch.equal(result["one row"][name], t) for name, t in run[0][0]["one row"].items())


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "start this script with torchrun"),
    (["--tp", "3"], {"RANK": "0", "WORLD_SIZE": "4"}, "--tp 3 must divide the 4 ranks"),
    (["--steps", "0"], {}, "--steps must be above 0"),
    (["--steps", "100"], {}, "--steps 100: at most 10"),
])
def test_bad_input_is_one_line(argv, env, message):
    assert_one_line(*run_main("mesh_2d.py", *argv, env=env)[::2], message)
