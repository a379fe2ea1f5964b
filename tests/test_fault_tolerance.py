"""Kill, stop or crowd a training job and lose nothing; without restarts, fail fast."""
import os
import random
import signal
import time

import pytest
import torch
from conftest import ARGV
from docs_blocks import documented, rerun
from harness import run_ranks
from launch import REPO, TORCHRUN, Group, epoch_losses, python, run
from test_train import parse
from workers import train_script, train_script_per_rank

import common
from model import build_model

# conftest's 3 epochs of 301 samples: over 3 ranks 101 each, 7 per batch: 15 steps per epoch, and
# 17 validation samples on rank 0 (3 batches); over 2 ranks 151 each: 22 steps per epoch.
ARGV = [*ARGV, "--timeout", "20"]
INJECT = {"PYTHONPATH": str(REPO / "tests" / "inject")}
# torchrun's default, set explicitly: its rendezvous store is shared with the workers and outlives a
# restart. The scripts must restart on it without the workaround that once had to be set here.
SHARED_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}

# One job, three kills under --max-restarts 3, a different moment in each of its first three attempts;
# the fourth finishes. (rank to kill, KILL_AT) for attempts 0, 1 and 2:
KILL_CHAIN = [
    ("2", "init:1"),  # start-up: as it joins the process group
    ("1", "eval:5"),  # validation: epoch 1's second batch, with epoch 0 saved
    ("0", "save:1"),  # resumed at epoch 1: between writing epoch 1's checkpoint and renaming it
]


def random_moments(count: int) -> dict[str, tuple[str, str]]:
    """`count` moments drawn at random: a rank, and a time after it starts or a step, a validation
    batch or a checkpoint write of the first attempt. RESTART_TRIALS=10 draws ten."""
    draw = random.Random()
    moments = {}
    while len(moments) < count:
        kind, limit = draw.choice([("time", 3.0), ("step", 45), ("eval", 9), ("save", 3), ("init", 1)])
        at = f"{kind}:{round(draw.uniform(0.2, limit), 2) if kind == 'time' else draw.randint(1, limit)}"
        rank = "0" if kind == "save" else str(draw.randrange(3))  # rank 0 alone writes
        moments[f"rank {rank} at {at}"] = (rank, at)
    return moments


# The chain as docs/checkpoints.md shows it, with the output the docs test compares.
DOCUMENTED = ("PYTHONPATH=tests/inject KILL_RANK=2,1,0 KILL_AT=init:1,eval:5,save:1 torchrun --standalone "
              "--nproc-per-node 3 --max-restarts 3 singlenode_cpu.py " + " ".join(ARGV) + " --checkpoint ckpt.pt")


def check_restarted(code: int, stdout: str, folder, kills: list[tuple[str, str]], ddp_runs) -> None:
    """torchrun's documented restart command at 3 ranks, with a worker killed at each of `kills` in
    turn, ended as if nothing happened, bit for bit."""
    assert code == 0, stdout[-3000:]
    for rank, moment in kills:
        assert f"[inject] SIGKILL rank {rank} at {moment.replace(':', ' ')}" in stdout  # it did happen
    assert sorted(epoch_losses(stdout)) == [0, 1, 2]  # each epoch completed exactly once
    saved = torch.load(folder / "ckpt.pt", weights_only=True)
    assert saved["epoch"] == 3
    uninterrupted, _ = ddp_runs[3]
    for name, tensor in uninterrupted[0].items():
        assert torch.equal(saved["model"][name], tensor), name
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt.pt"]  # no .tmp, no .lock


def test_three_killed_workers_in_a_row_cost_nothing_under_max_restarts(ddp_runs):
    """Run as the docs show it (rerun once, shared with tests/test_docs_output.py), on torchrun's
    shared rendezvous store unless the environment says otherwise."""
    documented(DOCUMENTED)
    output, = rerun(DOCUMENTED)
    check_restarted(output.codes[0], output.text, output.cwd, KILL_CHAIN, ddp_runs)
    assert output.text.count("resuming from") == 2  # attempts 2 and 3; epoch 0 was not saved before attempt 1
    assert f"removed {(output.cwd / 'ckpt.pt').resolve()}.tmp, left by a checkpoint write that did not finish" in \
        output.text


@pytest.mark.parametrize("moment", random_moments(int(os.environ.get("RESTART_TRIALS", "1"))).items(),
                         ids=lambda item: item[0])
def test_a_worker_killed_at_a_random_moment_costs_nothing(moment, ddp_runs, tmp_path):
    rank, at = moment[1]
    result = run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "3", "--max-restarts", "3",
         "singlenode_cpu.py", *ARGV, "--checkpoint", str(tmp_path / "ckpt.pt")],
        env={**INJECT, **SHARED_STORE, "KILL_RANK": rank, "KILL_AT": at}, timeout=150,
    )
    check_restarted(result.returncode, result.stdout + result.stderr[-3000:], tmp_path, [moment[1]], ddp_runs)


def test_a_stop_signal_keeps_the_checkpoint_whole_and_the_rerun_resumes(ddp_runs, tmp_path):
    """SIGTERM to torchrun (what Slurm and Kubernetes send before a preemption) while rank 0 writes
    a checkpoint: every process ends within seconds, the write finishes, no .tmp is left, and the
    same command resumes. Every write takes longer than --timeout, and the runs go on regardless:
    rank 0 writes in the background."""
    checkpoint = tmp_path / "ckpt.pt"
    argv = [*ARGV, "--timeout", "2", "--checkpoint", str(checkpoint)]
    command = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "singlenode_cpu.py", *argv]
    slow = {**INJECT, "SLOW_SAVE": "3"}
    group = Group(tmp_path)
    group.start(command, env=slow)
    group.wait_for(0, "[inject] a checkpoint write that takes", timeout=60)
    group.procs[0].send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    assert group.wait(timeout=3 + 10) == [1]  # the write in flight, then every process is gone; torchrun exits 1
    assert time.monotonic() - stopped < 3 + 5
    stdout = group.stdout(0)
    assert f"rank 0 stopped by SIGTERM: every epoch printed above is saved in {checkpoint}, and the same " \
           "command resumes from there" in stdout
    done = sorted(epoch_losses(stdout))
    assert done == list(range(len(done))) and len(done) >= 1  # the write in flight completed
    assert torch.load(checkpoint, weights_only=True)["epoch"] == len(done)
    assert not (tmp_path / "ckpt.pt.tmp").exists() and not (tmp_path / "ckpt.pt.lock").exists()

    rerun = run(command, env=slow, timeout=120)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resuming from {checkpoint}: {len(done)} of 3 epochs done" in rerun.stdout
    assert sorted(epoch_losses(rerun.stdout)) == list(range(len(done), 3))
    saved = torch.load(checkpoint, weights_only=True)
    uninterrupted, _ = ddp_runs[2]
    for name, tensor in uninterrupted[0].items():
        assert torch.equal(saved["model"][name], tensor), name


def test_one_job_per_checkpoint_and_no_orphans_when_torchrun_is_killed(tmp_path):
    """A second job on a checkpoint in use stops at once with one line per rank, and the first goes
    on, its checkpoint writes untouched. kill -9 of the first job's torchrun ends its worker too,
    after its write in flight, and leaves the checkpoint free for a relaunch."""
    checkpoint = tmp_path / "ckpt.pt"
    argv = ["singlenode_cpu.py", "--train_size", "64", "--val_size", "16", "--checkpoint", str(checkpoint)]
    group = Group(tmp_path)
    first = group.start([TORCHRUN, "--standalone", "--nproc-per-node", "1", *argv, "--max_epochs", "100000"],
                        env={**INJECT, "SLOW_SAVE": "0.5"})  # a .tmp is there most of the time
    group.wait_for(0, "epoch 0 |", timeout=60)
    holder = (tmp_path / "ckpt.pt.lock").read_text()

    second = run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *argv], timeout=60)
    assert second.returncode == 1  # torchrun's code for failed workers; each of them exited 2
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: another job is using checkpoint {checkpoint} ({holder} holds {checkpoint}.lock): "
                      "wait for it to finish or stop it, or pass another --checkpoint"] * 2
    assert 'singlenode_cpu.py", line' not in second.stderr  # no traceback of ours (torchrun adds its own)
    saved_before = len(epoch_losses(group.stdout(0)))
    group.wait_for(0, f"epoch {saved_before} |", timeout=30)  # the first job saves on, undisturbed

    os.kill(first.pid, signal.SIGKILL)  # torchrun alone: its worker lives in a session of its own
    group.wait(timeout=0.5 + 10)  # the worker notices, finishes its write, and is gone
    assert f"rank 0 stopped by SIGTERM: every epoch printed above is saved in {checkpoint}" in group.stdout(0)
    assert torch.load(checkpoint, weights_only=True)["epoch"] >= saved_before + 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt.pt"]


def test_without_restarts_torchrun_fails_fast_and_names_the_dead_worker(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    started = time.monotonic()
    result = run(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", "singlenode_cpu.py", *ARGV,
         "--checkpoint", str(checkpoint)],
        env={**INJECT, "KILL_RANK": "1", "KILL_AT": "step:25"}, timeout=60,
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


def checkpoint_at(path, epoch: int, world_size: int, nan: bool = False) -> bytes:
    """Write a checkpoint that conftest's ARGV would resume from (untrained weights, `epoch` done);
    return its bytes."""
    args = parse(ARGV)
    torch.manual_seed(args.seed)
    model = build_model(args.model)
    if nan:
        with torch.no_grad():
            model.net[0].weight[0, 0] = float("nan")
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    path.parent.mkdir(exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                "config": common.run_config(args, world_size)}, path)
    return path.read_bytes()


def test_ranks_that_see_different_checkpoints_all_stop_before_training(tmp_path):
    """Each rank's own copy of the path, as on nodes that do not share storage: rank 0 finds epoch 2,
    rank 1 nothing, rank 2 epoch 1. Without the check rank 1 would train from scratch beside the
    others and rank 0 would save the mixture. Every rank stops with one line; nothing changes."""
    paths = [tmp_path / f"node{rank}" / "ckpt.pt" for rank in range(3)]
    before = checkpoint_at(paths[0], epoch=2, world_size=3)
    paths[1].parent.mkdir()
    checkpoint_at(paths[2], epoch=1, world_size=3)
    argv_by_rank = [[*ARGV, "--checkpoint", str(path)] for path in paths]
    codes, _, stdouts, stderrs = run_ranks(train_script_per_rank, 3, "singlenode_cpu", argv_by_rank, timeout=60)
    assert codes == [2, 2, 2]
    for rank, stderr in enumerate(stderrs):
        assert stderr.startswith(f"error: rank 1 finds no checkpoint: a fresh start at {paths[rank]}, rank 0 finds "
                                 "epoch 2, sha256 ") and stderr.count("\n") == 1, stderr
    assert all(epoch_losses(out) == {} for out in stdouts)  # no epoch trained
    assert paths[0].read_bytes() == before
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["ckpt.pt", "ckpt.pt", "node0", "node1", "node2"]


def test_non_finite_weights_in_a_checkpoint_stop_every_rank_and_the_file_stays(tmp_path):
    path = tmp_path / "ckpt.pt"
    before = checkpoint_at(path, epoch=1, world_size=3, nan=True)
    codes, _, stdouts, stderrs = run_ranks(train_script, 3, "singlenode_cpu", [*ARGV, "--checkpoint", str(path)],
                                           timeout=60)
    assert codes == [1, 1, 1]
    assert stderrs == ["error: the loss or the weights stopped being finite in epoch 1, by step 1 of 15: stopped "
                       "before saving (a learning rate too high, or weights that were not finite in the "
                       "checkpoint)\n"] * 3
    assert "epoch 1 |" not in stdouts[0]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
