"""singlenode_cpu.py's --precision bf16, --clip_grad_norm and --compile, each proved against a run
without it; all the runs in turn in one process group of 2, so that the processes start once."""
import re
import sys

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from launch import epoch_losses
from reference import train_reference

import singlenode_cpu
from data import LOSS_FLOOR

WORLD_SIZE = 2
# The default data set, one epoch: 64 steps per rank, enough to come within 10% of the floor.
FULL = ["--max_epochs", "1", "--batch_size", "32"]
# Tiny and uneven, as in conftest.ARGV: the sampler pads, the last batch is short.
SMALL = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
CLIP = 0.1  # below the gradients' norm at every step of SMALL (0.8 to 3.2): every step is clipped
COMPILED_STEP = re.compile(r"compile: the first forward and backward took (\d+\.\d) s")


def runs(checkpoint: str) -> dict[str, list[str]]:
    one_epoch = [*SMALL[:1], "1", *SMALL[2:]]
    return {
        "fp32": FULL,
        "bf16": [*FULL, "--precision", "bf16"],
        "eager": SMALL,
        "clip": [*SMALL, "--clip_grad_norm", str(CLIP)],
        "compile": [*SMALL, "--compile"],
        "compile, 1 epoch": [*one_epoch, "--compile", "--checkpoint", checkpoint],
        "compile, resumed": [*SMALL, "--compile", "--checkpoint", checkpoint],
    }


def train_runs(rank: int, world_size: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    """singlenode_cpu's train() for each run in turn: {run: {"weights", "stdout", "graphs"}}, where
    graphs counts the graphs that dynamo compiled during the run."""
    import contextlib
    import io

    from torch._dynamo.utils import counters  # what torch's own tests count compiles with

    results = {}
    for name, argv in runs.items():
        torch.compiler.reset()  # forget earlier runs' compiled code, as a new process would
        sys.argv = ["singlenode_cpu.py", *argv]
        args = singlenode_cpu.parse_args()
        graphs = counters["stats"]["unique_graphs"]
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            model = singlenode_cpu.train(args, rank, rank, world_size, torch.device("cpu"))
        results[name] = {"weights": model.state_dict(), "stdout": stdout.getvalue(),
                         "graphs": counters["stats"]["unique_graphs"] - graphs}
        dist.barrier()  # rank 0 has closed the checkpoint before any rank reads it in the next run
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{run: every rank's result}, and the checkpoint that the compiled runs wrote."""
    checkpoint = tmp_path_factory.mktemp("compile") / "ckpt.pt"
    by_rank, _ = spawn(train_runs, WORLD_SIZE, runs(str(checkpoint)), timeout=120)
    return {name: [by_rank[rank][name] for rank in range(WORLD_SIZE)] for name in by_rank[0]}, checkpoint


def parse(argv: list[str]):
    sys_argv, sys.argv = sys.argv, ["singlenode_cpu.py", *argv]
    try:
        return singlenode_cpu.parse_args()
    finally:
        sys.argv = sys_argv


def test_every_rank_ends_with_identical_weights_in_every_run(results):
    """With bf16, clipping and compile too, every replica takes the same steps."""
    runs_, _ = results
    for name, ranks in runs_.items():
        for rank in range(1, WORLD_SIZE):
            for key, tensor in ranks[0]["weights"].items():
                assert torch.equal(ranks[rank]["weights"][key], tensor), (name, rank, key)


def test_bf16_reaches_the_floor_and_autocast_really_ran(results):
    runs_, _ = results
    fp32, bf16 = runs_["fp32"][0], runs_["bf16"][0]
    (_, fp32_val), = epoch_losses(fp32["stdout"]).values()
    (_, bf16_val), = epoch_losses(bf16["stdout"]).values()
    assert bf16_val <= 1.15 * LOSS_FLOOR
    assert bf16_val == pytest.approx(fp32_val, rel=0.01)
    # bf16 keeps 8 bits of mantissa: its steps differ from fp32's far beyond fp32 rounding.
    largest = max((bf16["weights"][key] - tensor).abs().max().item() for key, tensor in fp32["weights"].items())
    assert largest > 1e-4


def test_clipping_the_averaged_gradient_equals_one_process_clipping_the_global_batch(results):
    """Every rank clips the all-reduced gradient, which is the gradient of the global batch: one
    process with that batch, clipping it, takes the same steps. And the clip did change them."""
    runs_, _ = results
    clipped, _ = train_reference(parse([*SMALL, "--clip_grad_norm", str(CLIP)]), WORLD_SIZE)
    unclipped, _ = train_reference(parse(SMALL), WORLD_SIZE)
    for key, tensor in clipped.items():
        torch.testing.assert_close(runs_["clip"][0]["weights"][key], tensor, rtol=0, atol=1e-5, msg=key)
    assert max((clipped[key] - unclipped[key]).abs().max().item() for key in clipped) > 1e-2


def test_the_compiled_run_trains_as_the_eager_one_to_float_rounding(results):
    """Not bit for bit: inductor writes its own kernels for the tanh's derivative and the bias
    gradients' sums over the batch, which add up in another order than eager's (the matrix
    products it leaves to the same library calls). The forward pass alone matches to the bit."""
    runs_, _ = results
    eager, compiled = runs_["eager"][0], runs_["compile"][0]
    assert eager["graphs"] == 0 and compiled["graphs"] >= 1  # it really compiled
    assert len(COMPILED_STEP.findall(compiled["stdout"])) == 1
    assert COMPILED_STEP.search(runs_["compile"][1]["stdout"]) is None  # rank 0 alone says so
    printed, expected = epoch_losses(compiled["stdout"]), epoch_losses(eager["stdout"])
    assert sorted(printed) == sorted(expected) == [0, 1]
    for epoch, losses in expected.items():
        assert printed[epoch] == pytest.approx(losses, abs=2e-6)
    for key, tensor in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][key], tensor, rtol=0, atol=1e-5, msg=key)


def test_a_compiled_run_saves_plain_keys_and_resumes_bit_for_bit(results):
    runs_, checkpoint = results
    resumed = runs_["compile, resumed"][0]
    assert "resuming from" in resumed["stdout"] and sorted(epoch_losses(resumed["stdout"])) == [1]
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 2 and saved["config"]["clip_grad_norm"] is None
    assert list(saved["model"]) == list(runs_["eager"][0]["weights"])  # no "_orig_mod." in the keys
    for key, tensor in runs_["compile"][0]["weights"].items():
        assert torch.equal(resumed["weights"][key], tensor), key


def test_the_gpu_step_unscales_before_it_clips():
    """singlenode_gpu.py's step, run on a CPU with a GradScaler that multiplies the loss by 1024:
    the same steps, bit for bit, as singlenode_cpu.py's step with no scaler (a power of 2 scales
    exactly), because the gradients are unscaled before their norm is clipped. Clipped while still
    scaled, they would be cut 1024 times too short."""
    from torch.utils.data import DataLoader

    import singlenode_gpu
    from data import make_datasets
    from model import build_model

    train_set, _ = make_datasets(301, 50)
    weights = []
    for step in ("gpu", "cpu"):
        torch.manual_seed(0)
        model = build_model("mlp")
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        loader = DataLoader(train_set, batch_size=7)
        if step == "gpu":
            scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
            singlenode_gpu.train_one_epoch(model, loader, optimizer, torch.device("cpu"), torch.float32, scaler, CLIP)
            assert scaler.get_scale() == 1024.0  # no step skipped, the scale never changed
        else:
            singlenode_cpu.train_one_epoch(model, loader, optimizer, torch.device("cpu"), torch.float32, CLIP)
        weights.append(model.state_dict())
    for key, tensor in weights[1].items():
        assert torch.equal(weights[0][key], tensor), key
