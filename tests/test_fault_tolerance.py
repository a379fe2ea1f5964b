"""Kill a worker under torchrun --max-restarts and lose nothing; without restarts, fail fast."""
import time

import pytest
import torch
from conftest import ARGV
from launch import REPO, TORCHRUN, epoch_losses, python, run

# conftest's 3 epochs of 301 samples over 2 ranks: 151 each, 7 per batch: 22 steps per epoch.
ARGV = [*ARGV, "--timeout", "20"]
STEPS_PER_EPOCH = 22
INJECT = {"PYTHONPATH": str(REPO / "tests" / "inject")}
# torchrun shares its rendezvous store with the workers by default, and a restarted gloo group can
# then read its dead predecessors' addresses and fail to connect (pytorch/pytorch#135712). The
# README's fault-tolerance command sets this too.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

KILLS = {
    # moment: (rank to kill, KILL_AT)
    "early in an epoch": ("1", f"step:{2 * STEPS_PER_EPOCH + 1}"),  # the first step of epoch 2
    "mid-epoch": ("0", f"step:{STEPS_PER_EPOCH + STEPS_PER_EPOCH // 2}"),  # halfway through epoch 1
    "during the checkpoint write": ("0", "save:2"),  # epoch 1's save, between the write and the rename
}


@pytest.fixture
def uninterrupted(ddp_runs) -> dict:
    weights, _ = ddp_runs[2]
    return weights[0]


@pytest.mark.parametrize("moment", KILLS)
def test_a_killed_worker_costs_nothing_under_max_restarts(moment, uninterrupted, tmp_path):
    rank, kill_at = KILLS[moment]
    checkpoint = tmp_path / "ckpt.pt"
    result = run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
         "singlenode_cpu.py", *ARGV, "--checkpoint", str(checkpoint)],
        env={**INJECT, **RESTARTABLE, "KILL_RANK": rank, "KILL_AT": kill_at}, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"[inject] SIGKILL rank {rank}" in result.stdout  # the fault did happen
    assert "resuming from" in result.stdout
    assert sorted(epoch_losses(result.stdout)) == [0, 1, 2]  # each epoch completed exactly once
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 3
    for name, tensor in uninterrupted.items():
        assert torch.equal(saved["model"][name], tensor), name
    assert not (tmp_path / "ckpt.pt.tmp").exists()
    if moment == "during the checkpoint write":
        assert f"removed {checkpoint}.tmp, left by a checkpoint write that did not finish" in result.stdout


def test_without_restarts_torchrun_fails_fast_and_names_the_dead_worker(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    started = time.monotonic()
    result = run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "singlenode_cpu.py", *ARGV,
         "--checkpoint", str(checkpoint)],
        env={**INJECT, "KILL_RANK": "1", "KILL_AT": f"step:{STEPS_PER_EPOCH + 3}"}, timeout=60,
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 20 + 15  # the --timeout, plus start-up and shutdown
    assert "Signal 9 (SIGKILL) received by PID" in result.stderr
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 1  # epoch 0's checkpoint survives


def test_mp_spawn_fails_fast_with_one_line_naming_the_dead_rank(tmp_path):
    started = time.monotonic()
    result = python("mp_spawn.py", "--nprocs", "2", *ARGV, env={**INJECT, "KILL_RANK": "1", "KILL_AT": "step:5"})
    assert result.returncode == 1
    assert time.monotonic() - started < 20 + 15
    assert "error: rank 1 was killed by signal SIGKILL; mp.spawn stopped the other processes" in result.stderr
    assert "Traceback" not in result.stderr
