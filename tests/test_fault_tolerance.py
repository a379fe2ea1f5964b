"""A killed worker: torchrun restarts the job from the lesson's last checkpoint (the docstring's
command), and without restarts the job fails at once. Locks, signals and preemption: gpt/ (its tests)."""
import os
import random
import time

import pytest
import torch
from conftest import ARGV
from docs_blocks import documented, rerun
from launch import REPO, TORCHRUN, epoch_losses, python, run
from test_train import TOLERANCE

INJECT = {"PYTHONPATH": str(REPO / "tests" / "inject")}
# The docstring's restart command: torchrun's own store keeps a dead attempt's addresses, and a restarted
# gloo group can hang on them (pytorch/pytorch#135712); with this each attempt gets a store of its own.
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

# One job, three kills under --max-restarts 3, a different moment in each of its first three attempts;
# the fourth finishes. With conftest's ARGV at 3 ranks: 15 steps per epoch, 17 validation samples on rank 0.
KILL_CHAIN = [
    ("2", "init:1"),  # start-up: as it joins the process group
    ("1", "eval:5"),  # validation: epoch 1's second batch, with epoch 0 saved
    ("0", "save:1"),  # resumed at epoch 1: between writing epoch 1's checkpoint and renaming it
]
# The chain as docs/first_training.md shows it, with the output the docs test compares.
DOCUMENTED = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 PYTHONPATH=tests/inject KILL_RANK=2,1,0 "
              "KILL_AT=init:1,eval:5,save:1 torchrun --standalone --nproc-per-node 3 --max-restarts 3 "
              "singlenode_cpu.py " + " ".join(ARGV) + " --checkpoint restart.pt")


def check_restarted(code: int, stdout: str, folder, kills: list[tuple[str, str]], ddp_runs,
                    checkpoint: str = "ckpt.pt", ranks: int = 3) -> None:
    """The restart command at `ranks` ranks, with a worker killed at each of `kills` in turn, ended with each
    epoch printed once after its last attempt, and the uninterrupted run's weights (to the tolerance of
    test_train: a restarted DDP lays out its buckets afresh)."""
    assert code == 0, stdout[-3000:]
    for rank, moment in kills:
        assert f"[inject] SIGKILL rank {rank} at {moment.replace(':', ' ')}" in stdout  # it did happen
    epoch_losses(stdout)  # no epoch printed twice: the line comes once the epoch is saved
    saved = torch.load(folder / checkpoint, weights_only=True)
    assert saved["epoch"] == 3
    uninterrupted, _ = ddp_runs[ranks]
    for name, tensor in uninterrupted[0].items():
        torch.testing.assert_close(saved["model"][name], tensor, **TOLERANCE, msg=name)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(checkpoint)) == [checkpoint]  # no .tmp


def test_three_killed_workers_in_a_row_cost_only_the_epoch_in_flight(ddp_runs):
    """Run as the docs show it (rerun once, shared with tests/test_docs_output.py)."""
    documented(DOCUMENTED)
    output, = rerun(DOCUMENTED)
    check_restarted(output.codes[0], output.text, output.cwd, KILL_CHAIN, ddp_runs, "restart.pt")
    assert output.text.count("resuming from restart.pt: 1 of 3 epochs done") == 2  # epoch 1 saved only at the end


# One draw per run: under pytest-xdist every worker collects the tests, and all must draw the same one.
@pytest.mark.parametrize("moment", [random.Random(os.environ.get("PYTEST_XDIST_TESTRUNUID"))
                                    .choice(["step:20", "step:40", "eval:9", "time:2.5"])])
def test_a_worker_killed_at_a_random_moment_costs_only_the_epoch_in_flight(moment, ddp_runs, tmp_path):
    """At 2 ranks (the chain above runs at 3)."""
    rank = str(random.randrange(2))
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "singlenode_cpu.py",
                  *ARGV, "--checkpoint", str(tmp_path / "ckpt.pt")],
                 env={**FRESH_STORE, **INJECT, "KILL_RANK": rank, "KILL_AT": moment}, timeout=150)
    check_restarted(result.returncode, result.stdout + result.stderr, tmp_path, [(rank, moment)], ddp_runs, ranks=2)


def test_without_restarts_a_dead_worker_ends_the_job_at_once_and_keeps_the_checkpoint(tmp_path):
    """gloo notices a closed connection at once: the other ranks' next collective fails, well inside the
    default timeout (30 minutes), and torchrun names the dead worker."""
    checkpoint = tmp_path / "ckpt.pt"
    started = time.monotonic()
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", "singlenode_cpu.py", *ARGV,
                  "--checkpoint", str(checkpoint)], env={**INJECT, "KILL_RANK": "1", "KILL_AT": "step:25"}, timeout=60)
    assert result.returncode != 0
    assert time.monotonic() - started < 55  # 30 minutes the default timeout; the whole run took 15-34 s on 2 cores
    assert "Signal 9 (SIGKILL) received by PID" in result.stderr
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 1  # epoch 0's checkpoint survives


def test_mp_spawn_ends_every_process_when_one_dies():
    started = time.monotonic()
    result = python("mp_spawn.py", "--nprocs", "2", *ARGV, env={**INJECT, "KILL_RANK": "1", "KILL_AT": "step:5"})
    assert result.returncode != 0 and time.monotonic() - started < 55  # the whole run: 38 s on a loaded 2-core box
    assert "process 1 terminated with signal SIGKILL" in result.stderr
