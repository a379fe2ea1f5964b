"""grad_accumulation.py: k micro-batches with no_sync() take the steps of one batch k times larger,
with one all-reduce per optimizer step instead of k."""
import re

import pytest
import torch
from harness import spawn
from workers import train_scripts

WORLD_SIZE = 3
# 301 samples over 3 ranks: 101 each, in micro-batches of 7 (the last holds 3), so groups of 3
# micro-batches hold 21, 21, 21, 21 and 17 samples: the short group is weighed by samples too.
SIZES = ["--max_epochs", "2", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
ACCUMULATE = [*SIZES, "--batch_size", "7", "--accum_steps", "3"]
RUNS = [
    ("grad_accumulation", ACCUMULATE),
    ("grad_accumulation", [*ACCUMULATE, "--always_sync"]),
    ("singlenode_cpu", [*SIZES, "--batch_size", "21"]),  # no accumulation, a batch 3 times larger
]
COUNTS = re.compile(r"epoch (\d) \| .* \| (\d+) all-reduces of gradient buckets in (\d+) optimizer steps")


@pytest.fixture(scope="module")
def runs():
    """(weights of each run on every rank, rank 0's output of the three runs in turn)."""
    results, stdouts = spawn(train_scripts, WORLD_SIZE, RUNS, timeout=90)
    return results, stdouts[0]


def test_accumulation_takes_the_steps_of_a_batch_k_times_larger(runs):
    results, _ = runs
    no_sync, always_sync, large_batch = (results[0][i] for i in range(3))
    for name, tensor in large_batch.items():
        torch.testing.assert_close(no_sync[name], tensor, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(always_sync[name], tensor, rtol=0, atol=1e-5, msg=name)
    for rank in range(1, WORLD_SIZE):  # every replica took the same steps
        for name, tensor in no_sync.items():
            assert torch.equal(results[rank][0][name], tensor), (rank, name)


def test_no_sync_all_reduces_once_per_optimizer_step_instead_of_once_per_micro_batch(runs):
    _, stdout = runs
    counts = [tuple(map(int, match.groups())) for match in COUNTS.finditer(stdout)]
    # 15 micro-batches per epoch on each rank: 5 optimizer steps; the model's gradients fit one bucket.
    assert counts == [(0, 5, 5), (1, 5, 5), (0, 15, 5), (1, 15, 5)]
    assert "3 ranks × 3 micro-batches of 7 = 63 samples per optimizer step" in stdout
