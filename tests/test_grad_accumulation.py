"""grad_accumulation.py: k micro-batches under no_sync() take the steps of one process with the global batch,
with one all-reduce per optimizer step instead of one per micro-batch."""
import ast
import contextlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from launch import REPO, epoch_losses
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import grad_accumulation
import single_process

# 300 samples: 150 or 100 on each of 2 or 3 ranks, so DistributedSampler repeats none and one process sees the
# same samples. Batches of 7 in 3 micro-batches of 3, 2 and 2 samples; each rank's last batch holds 3 or 2
# samples, so it is split into 3 or 2 micro-batches of one sample, weighed by their share all the same.
SIZES = ["--max_epochs", "2", "--train_size", "300", "--val_size", "50", "--lr", "0.01"]
ACCUMULATE = [*SIZES, "--batch_size", "7", "--accum_steps", "3"]
STEPS = {2: (22, 21 * 3 + 3), 3: (15, 14 * 3 + 2)}  # world size: (optimizer steps, micro-batches) per rank and epoch


def parse(module, argv: list[str]):
    saved, sys.argv = sys.argv, [f"{module.__name__}.py", *argv]
    try:
        return module.parse_args()
    finally:
        sys.argv = saved


def count_all_reduces(counter: list[int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: count the bucket, then all-reduce it as DDP does by default (the average)."""
    counter[0] += 1
    return allreduce_hook(None, bucket)


def accumulate_twice(rank: int, world_size: int) -> list[tuple[dict, int]]:
    """grad_accumulation's train() with ACCUMULATE, then again with no_sync() doing nothing, as a loop without it
    would: each run's final weights and the all-reduces of gradient buckets that its DDP started."""
    plain_ddp, counter = grad_accumulation.DDP, [0]

    def counted_ddp(module: torch.nn.Module) -> grad_accumulation.DDP:
        model = plain_ddp(module)
        model.register_comm_hook(counter, count_all_reduces)
        return model

    def run() -> tuple[dict, int]:
        counter[0] = 0
        return grad_accumulation.train(parse(grad_accumulation, ACCUMULATE), rank, world_size).state_dict(), counter[0]

    grad_accumulation.DDP = counted_ddp
    runs = [run()]
    plain_ddp.no_sync = lambda self: contextlib.nullcontext()  # in this worker only, which ends with the test
    return [*runs, run()]


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[list[tuple[dict, int]]], list[str]]]:
    """{world_size: (every rank's two runs, every rank's stdout)}, one process group each."""
    return {n: spawn(accumulate_twice, n, timeout=90) for n in (2, 3)}


def one_process(world_size: int, capsys: pytest.CaptureFixture) -> tuple[dict, str]:
    """single_process.py with the global batch, world_size × 7: its weights and its output."""
    capsys.readouterr()
    model = single_process.train(parse(single_process, [*SIZES, "--batch_size", str(world_size * 7)]))
    return model.state_dict(), capsys.readouterr().out


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulation_takes_the_steps_of_one_process_with_the_global_batch(runs, world_size, capsys):
    """Not bitwise: the micro-batches' gradients, and DDP's average of the ranks', sum in another order than one
    batch's mean; 1e-5 after 44 or 30 Adam steps. Without no_sync() the steps are the same: it saves only
    communication."""
    results, stdouts = runs[world_size]
    expected, printed = one_process(world_size, capsys)
    for run in (0, 1):
        for name, tensor in expected.items():
            torch.testing.assert_close(results[0][run][0][name], tensor, rtol=0, atol=1e-5, msg=(run, name))
        for rank in range(1, world_size):  # every replica took the same steps
            for name, tensor in results[0][run][0].items():
                assert torch.equal(results[rank][run][0][name], tensor), (run, rank, name)
    losses = epoch_losses(printed)  # the epoch means that each prints, to its last digit
    assert sorted(losses) == [0, 1]
    for run_output in stdouts[0].split("done |")[:2]:
        shown = epoch_losses(run_output)
        assert sorted(shown) == [0, 1] and all(shown[e] == pytest.approx(losses[e], abs=2e-6) for e in losses)


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_all_reduces_once_per_optimizer_step_instead_of_once_per_micro_batch(runs, world_size):
    results, _ = runs[world_size]
    steps, micro_batches = STEPS[world_size]
    for rank in range(world_size):  # the model's gradients fit in one bucket: one all-reduce per synced backward
        assert [count for _, count in results[rank]] == [2 * steps, 2 * micro_batches]


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's code, without comments (ast drops them)."""
    return {node.name: ast.dump(node) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)}


def test_what_accumulation_does_not_change_is_singlenode_cpus_code():
    lesson, reference = _functions(REPO / "grad_accumulation.py"), _functions(REPO / "singlenode_cpu.py")
    assert list(lesson) == list(reference)  # the same functions, in the same order
    for name in ("make_loaders", "evaluate", "epoch_means"):
        assert lesson[name] == reference[name], name
