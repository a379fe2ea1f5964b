"""gpt/ survives: sharded async checkpoints that resume at another world size or layout, a killed
worker under torchrun --max-restarts, SIGTERM, and bad checkpoints, each with one line.

Launches whose point is the launcher (restarts, signals) run torchrun whole; the rest run each
rank's main() in the harness (tests/harness.torchrun_in_process), as tests/test_gpt.py does."""
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import torchrun_in_process
from launch import REPO, TORCHRUN, Group, descendants, run

sys.path.insert(0, str(REPO))
from gpt.model import GPT  # noqa: E402

TRAIN = "gpt/train.py"
INJECT = {"PYTHONPATH": str(REPO / "tests" / "inject")}
# 24 steps, a checkpoint every 4, a log line and the LR of every step.
ARGV = ["--max_steps", "24", "--save_every", "4", "--log_every", "1", "--eval_every", "12", "--seq_len", "32",
        "--val_tokens", "512", "--warmup_steps", "4"]
# (--batch_size, --grad_accum) by ranks: a global batch of 12 sequences whatever the world size.
SPLIT = {1: ("2", "6"), 2: ("2", "3"), 3: ("2", "2"), 4: ("3", "1")}


def split(nproc: int) -> list[str]:
    return ["--batch_size", SPLIT[nproc][0], "--grad_accum", SPLIT[nproc][1]]


def launch(nproc: int, folder: Path, *argv: str, timeout: float = 90):
    return torchrun_in_process(nproc, TRAIN, *ARGV, *split(nproc), *argv, "--export", "model.pt", cwd=folder,
                               timeout=timeout)


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]


def weights(path: Path) -> dict[str, torch.Tensor]:
    return GPT.load(str(path)).state_dict()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, Path]:
    """{ranks: folder} of runs that nothing interrupts, ddp, at 2 and 3 ranks."""
    folders = {}
    for nproc in (2, 3):
        folder = tmp_path_factory.mktemp(f"whole{nproc}")
        result = launch(nproc, folder)
        assert result.codes == [0] * nproc, result.stderr
        folders[nproc] = folder
    return folders


def assert_bitwise(path: Path, reference: Path) -> None:
    mine, theirs = weights(path), weights(reference)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def test_checkpoints_are_whole_kept_and_listed_in_their_manifest(uninterrupted):
    out = uninterrupted[2] / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.toml", "lock", "metrics.jsonl", "step_00000020",
                                                     "step_00000024"]
    manifest = json.loads((out / "step_00000024" / "manifest.json").read_text())
    assert manifest["step"] == 24 and manifest["run"]["ranks"] == 2
    assert set(manifest["files"]) == {p.name for p in (out / "step_00000024").iterdir()} - {"manifest.json"}
    assert ".metadata" in manifest["files"] and "__1_0.distcp" in manifest["files"]


@pytest.mark.parametrize(("source", "ranks", "parallel"), [(2, 3, "ddp"), (2, 2, "fsdp"), (3, 4, "hsdp")])
def test_a_checkpoint_resumes_at_another_world_size_or_layout(source, ranks, parallel, uninterrupted, tmp_path):
    """The checkpoint of step 20 that an uninterrupted ddp run at `source` ranks wrote, resumed to
    step 24 at another world size or --parallel with the same global batch (DCP reshards): the
    steps after 20 differ from the uninterrupted run's only by how a differently split sum is
    rounded. Every step's loss within 1e-5, its LR exactly, each step logged once."""
    shutil.copytree(uninterrupted[source] / "out" / "step_00000020", tmp_path / "out" / "step_00000020")
    shutil.copy(uninterrupted[source] / "out" / "metrics.jsonl", tmp_path / "out")
    result = launch(ranks, tmp_path, "--parallel", parallel, *(["--shard_size", "2"] if parallel == "hsdp" else []))
    assert result.codes == [0] * ranks, result.stderr
    said = result.stdouts[0]
    assert "resuming from out/step_00000020: step 20 of 24" in said
    assert (f"ranks {ranks} (was {source})" in said) == (ranks != source)
    assert (f"--parallel {parallel} (was ddp)" in said) == (parallel != "ddp")
    logged = [r for r in records(tmp_path) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 25))  # each step once: the resumed run's from 21
    reference = [r for r in records(uninterrupted[source]) if "loss" in r]
    np.testing.assert_allclose([r["loss"] for r in logged], [r["loss"] for r in reference], rtol=1e-5)
    assert [r["lr"] for r in logged] == [r["lr"] for r in reference]
    assert weights(tmp_path / "model.pt").keys() == weights(uninterrupted[source] / "model.pt").keys()


def resumed_from(source: Path, ranks: int, folder: Path, *argv: str) -> list[dict]:
    """Step 20 of `source` resumed to step 24 in `folder` at `ranks` (argv: the split and the layout); the logs."""
    shutil.copytree(source / "out" / "step_00000020", folder / "out" / "step_00000020")
    shutil.copy(source / "out" / "metrics.jsonl", folder / "out")
    result = torchrun_in_process(ranks, TRAIN, *ARGV, *argv, "--export", "model.pt", cwd=folder, timeout=90)
    assert result.codes == [0] * ranks, result.stderr
    assert "resuming from out/step_00000020: step 20 of 24" in result.stdouts[0]
    return [r for r in records(folder) if "loss" in r]


# fsdp 2 × tp 2 on 4 ranks: 2 data-parallel ranks, one micro-step each (tp's are slow on CPUs: many small collectives)
TP = ["--parallel", "fsdp", "--tp", "2", "--batch_size", "6", "--grad_accum", "1"]
# pp 2 × fsdp 2 on 4 ranks: two pipelines of 2 stages, each step 3 micro-batches of 2 sequences
PP = ["--parallel", "fsdp", "--pp", "2", "--batch_size", "2", "--grad_accum", "3"]


def whole(tmp_path_factory, name: str, layout: list[str]) -> Path:
    """The folder of a run that nothing interrupts, at `layout` on 4 ranks."""
    folder = tmp_path_factory.mktemp(name)
    result = torchrun_in_process(4, TRAIN, *ARGV, *layout, "--export", "model.pt", cwd=folder, timeout=90)
    assert result.codes == [0] * 4, result.stderr
    return folder


@pytest.fixture(scope="module")
def uninterrupted_tp(tmp_path_factory) -> Path:
    return whole(tmp_path_factory, "whole_tp", TP)


@pytest.fixture(scope="module")
def uninterrupted_pp(tmp_path_factory) -> Path:
    return whole(tmp_path_factory, "whole_pp", PP)


@pytest.mark.parametrize(("source", "ranks", "layout"), [
    ("uninterrupted_pp", 4, ["--parallel", "fsdp", *split(4)]), ("uninterrupted_pp", 2, split(2)),
    ("uninterrupted_pp", 1, split(1)), ("uninterrupted_tp", 1, split(1))],
    ids=["pp 2 × fsdp 2 at fsdp4", "pp 2 × fsdp 2 at ddp2", "pp 2 × fsdp 2 at 1rank", "fsdp 2 × tp 2 at 1rank"])
def test_a_tp_or_pp_checkpoint_resumes_in_the_other_layouts(source, ranks, layout, request, tmp_path):
    """Step 20 of pp 2 × fsdp 2 resumed at fsdp 4, at ddp on 2 ranks and in one process, and of fsdp 2 × tp 2 in
    one process: the steps after 20 within 1e-5 of the run that wrote it, as between other layouts (DCP reshards
    the tp shards too; a pipeline's names are the unstaged model's, the head's optimizer state under wte.weight,
    as one process lists the tied matrix)."""
    folder = request.getfixturevalue(source)
    logged = resumed_from(folder, ranks, tmp_path, *layout)
    reference = [r for r in records(folder) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 25))
    np.testing.assert_allclose([r["loss"] for r in logged], [r["loss"] for r in reference], rtol=1e-5)
    assert [r["lr"] for r in logged] == [r["lr"] for r in reference]


def test_a_checkpoint_resumed_in_a_v_keeps_the_tied_matrix_one(tmp_path):
    """One process's step 4 of the mini model (4 blocks) resumed at pp 2 under DualPipeV, whose rank 0 holds the
    first stage and the last: the embedding and the head, each given the tied matrix's saved moments, stay two
    copies of one matrix, equal bit for bit (not two optimizers stepping one shared state), and the run ends
    within 1e-5 of one process's."""
    argv = ["--model", "mini", "--max_steps", "8", "--save_every", "4", "--log_every", "1", "--eval_every", "100",
            "--seq_len", "32", "--val_tokens", "512", "--warmup_steps", "4", "--batch_size", "2", "--grad_accum", "4",
            "--export", "model.pt"]
    (tmp_path / "one").mkdir()
    one = torchrun_in_process(1, TRAIN, *argv, cwd=tmp_path / "one", timeout=90)
    assert one.codes == [0], one.stderr
    shutil.copytree(tmp_path / "one" / "out" / "step_00000004", tmp_path / "pp" / "out" / "step_00000004")
    pp = torchrun_in_process(2, TRAIN, *argv, "--parallel", "fsdp", "--pp", "2", "--pp_schedule", "DualPipeV",
                             cwd=tmp_path / "pp", timeout=90)
    assert pp.codes == [0, 0], pp.stderr
    assert "resuming from out/step_00000004: step 4 of 8" in pp.stdouts[0]
    exported = torch.load(tmp_path / "pp" / "model.pt", weights_only=True)["model"]
    assert torch.equal(exported["wte.weight"], exported["lm_head.weight"])
    reference = weights(tmp_path / "one" / "model.pt")
    for name, value in weights(tmp_path / "pp" / "model.pt").items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-5, msg=name)


def test_a_ddp_checkpoint_resumes_at_pp_by_fsdp_by_tp(uninterrupted, tmp_path):
    """A ddp checkpoint (2 ranks) resumed at pp 2 × fsdp 2 × tp 2 (8 ranks: each stage's weights split over tp and
    sharded over fsdp, the last stage's head loading the tied matrix), within 1e-5 of the run that wrote it."""
    logged = resumed_from(uninterrupted[2], 8, tmp_path, "--parallel", "fsdp", "--pp", "2", "--tp", "2",
                          "--batch_size", "3", "--grad_accum", "2")
    reference = [r for r in records(uninterrupted[2]) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 25))
    np.testing.assert_allclose([r["loss"] for r in logged], [r["loss"] for r in reference], rtol=1e-5)


@pytest.mark.parametrize(("nproc", "model"), [(3, "tiny")])
def test_a_worker_killed_at_a_random_step_costs_nothing(nproc, model, request, tmp_path):
    """torchrun --max-restarts 3, ddp on 3 ranks, fp32: one worker SIGKILLed as it starts a step drawn at random.
    The restarted job resumes from the last checkpoint, and ends with the weights of a run that nothing
    interrupted, bit for bit; every step's learning rate is logged once, and the same. (pp 2 × fsdp 2 and fsdp 2
    × tp 2 passed it too, and llama-tiny at 2 ranks, before the suite's budget; ddp's restart on two hosts:
    test_multinode.py; the Llama family's resume after a signal: the SIGTERM test below.) GPT-2's tiny at 3 ranks."""
    argv = [*split(nproc), "--model", model]
    reference = request.getfixturevalue("uninterrupted" if model == "tiny" else "uninterrupted_llama")[nproc]
    rank, step = random.randrange(nproc), random.randrange(2, 25)
    result = run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "3", TRAIN, *ARGV,
                  *argv, "--out_dir", str(tmp_path / "out"), "--export", str(tmp_path / "model.pt")],
                 env={**INJECT, "KILL_RANK": str(rank), "KILL_AT": f"step:{step}"}, timeout=150)
    assert result.returncode == 0, f"rank {rank} at step {step}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert f"[inject] SIGKILL rank {rank} at step {step}" in result.stdout
    # The last checkpoint before the kill, or the one before it if the kill came during its commit.
    resumed = [int(s) for s in re.findall(r"resuming from \S+/step_(\d+): ", result.stdout)]
    last = (step - 1) // 4 * 4
    assert len(resumed) <= 1 and (resumed or [0])[0] in (last, max(0, last - 4)), (step, resumed)  # [] from 0
    assert_bitwise(tmp_path / "model.pt", reference / "model.pt")
    logged = [r for r in records(tmp_path) if "loss" in r]
    assert [r["lr"] for r in logged] == [r["lr"] for r in records(reference) if "loss" in r]
    assert [r["step"] for r in logged] == list(range(1, 25))


@pytest.fixture(scope="module")
def uninterrupted_llama(tmp_path_factory) -> dict[int, Path]:
    """{2: folder} of llama-tiny's run (ddp, 2 ranks) that nothing interrupts."""
    folder = tmp_path_factory.mktemp("whole_llama")
    result = launch(2, folder, "--model", "llama-tiny")
    assert result.codes == [0, 0], result.stderr
    return {2: folder}


@pytest.mark.parametrize(("to", "model"), [("all", "tiny"), ("one worker of 3", "tiny"), ("all", "llama-tiny")])
def test_sigterm_saves_the_step_in_flight_and_the_same_command_finishes_the_run(to, model, request, tmp_path):
    """SIGTERM mid-run to torchrun and to every worker, as Slurm sends it before a preemption (so each worker gets
    it twice: torchrun passes its own on), or to one worker alone (the others learn of it at the next step's
    agreement; here the last of 3): every rank stops after the same step, saves it, and exits within torchrun's
    30 s. The same command resumes from that step, not an older one, and ends with the weights of the module's
    run that nothing stopped. The stopped run's steps take 0.25 s longer (tests/inject), so that a signal after
    step 6 lands well before step 24. GPT-2's tiny, and the Llama family's (its untied head, its optimizer state)."""
    nproc = 2 if to == "all" else 3
    uninterrupted = request.getfixturevalue("uninterrupted" if model == "tiny" else "uninterrupted_llama")
    argv = [*ARGV, *split(nproc), "--save_every", "1000", "--model", model]
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), TRAIN, *argv, "--out_dir",
               str(tmp_path / "out"), "--export", str(tmp_path / "model.pt")]
    group = Group(tmp_path)
    torchrun = group.start(command, env={**INJECT, "SLOW_STEP": "0.25"})
    group.wait_for(0, "step 6/", timeout=60)
    workers = sorted(descendants(torchrun.pid))  # torchrun starts the workers in rank order
    for pid in [torchrun.pid, *workers] if to == "all" else workers[-1:]:
        os.kill(pid, signal.SIGTERM)
    signalled = time.monotonic()
    group.wait(timeout=40)
    assert time.monotonic() - signalled < 30  # inside torchrun's shutdown window: no SIGKILL came
    stopped = re.search(r"stopped by SIGTERM after step (\d+): saved (\S+);", group.stdout(0))
    assert stopped, group.stdout(0)[-2000:] + group.stderr(0)[-2000:]
    step = int(stopped[1])
    last_logged = max(int(s) for s in re.findall(r"^step (\d+)/24 \| loss", group.stdout(0), re.MULTILINE))
    assert 6 <= step == last_logged < 24 and stopped[2].endswith(f"step_{step:08d}")  # the step in flight, saved
    assert not (tmp_path / "model.pt").exists()  # --export is for the model at --max_steps
    # The same command again (its ranks' main() in the harness: torchrun's part, the signal, is done)
    rerun = torchrun_in_process(nproc, TRAIN, *command[command.index(TRAIN) + 1:], cwd=tmp_path, timeout=120)
    assert rerun.codes == [0] * nproc, rerun.stderr[-3000:]
    assert f"step {step} of 24" in rerun.stdouts[0]
    assert_bitwise(tmp_path / "model.pt", uninterrupted[nproc] / "model.pt")


def snapshot(folder: Path) -> dict[str, bytes]:
    """OUT_DIR's files but those each run that starts training writes: its log, its lock, and the options it ran
    with (config.toml)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name not in ("metrics.jsonl", "lock", "config.toml")}


@pytest.mark.parametrize(("damage", "said"), [
    ("flip", "checkpoint out/step_00000024: __1_0.distcp is damaged: its size or sha256 is not the manifest's"),
    ("delete", "checkpoint out/step_00000024: __0_0.distcp is missing"),
    ("truncate", "checkpoint out/step_00000024: its manifest.json cannot be read (JSONDecodeError"),
    ("no manifest", "checkpoint out/step_00000024: its manifest.json cannot be read (FileNotFoundError"),
    ("step as text", "checkpoint out/step_00000024: its manifest.json cannot be read (ValueError: its field 'step'"),
    ("model", "checkpoint out/step_00000024 is of another model"),
    ("older", "checkpoint out/step_00000024: rank ?: RuntimeError: Missing key in checkpoint state_dict: "
              "optim.param_groups."),
    ("lock", "out is in use by another job (it holds out/lock)"),
    ("nan", "are not finite at step 2?: stopped without saving; the last checkpoint, step_00000020, is untouched"),
    ("inf weights", "are not finite at step 21: stopped without saving; the last checkpoint, step_00000020, is "
                    "untouched"),
])
def test_a_bad_checkpoint_or_run_is_one_line_and_loses_nothing(damage, said, uninterrupted, tmp_path):
    """Each on a copy of a finished run's OUT_DIR: one line from rank 0, every rank exits non-zero,
    and every checkpoint file is as it was. `nan`: the run resumed from step 20 with a learning
    rate that blows up within a few steps (`?` in the line stands for one character), which must
    not be saved over step 20; `inf weights`: a weight decay that steps the weights to inf at once, with a
    finite loss and gradient, and a save due after that step."""
    shutil.copytree(uninterrupted[2] / "out", tmp_path / "out")
    checkpoint = tmp_path / "out" / "step_00000024"
    extra = []
    if damage == "flip":
        data = bytearray((checkpoint / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (checkpoint / "__1_0.distcp").write_bytes(data)
    elif damage == "delete":
        (checkpoint / "__0_0.distcp").unlink()
    elif damage == "truncate":
        manifest = (checkpoint / "manifest.json").read_text()
        (checkpoint / "manifest.json").write_text(manifest[: len(manifest) // 2])
    elif damage == "no manifest":
        (checkpoint / "manifest.json").unlink()
    elif damage == "step as text":
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "step": "24"}))
    elif damage == "model":
        extra = ["--model", "small"]
    elif damage == "older":  # an older train.py saved the optimizer's param_groups as one object, not by name
        metadata = pickle.loads((checkpoint / ".metadata").read_bytes())
        for key in [k for k in metadata.state_dict_metadata if k.startswith("optim.param_groups.")]:
            del metadata.state_dict_metadata[key]
        (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        manifest["files"][".metadata"] = {"size": (checkpoint / ".metadata").stat().st_size,
                                          "sha256": hashlib.sha256((checkpoint / ".metadata").read_bytes()).hexdigest()}
        (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "nan":
        shutil.rmtree(checkpoint)
        extra = ["--lr", "1e6", "--grad_clip", "0"]  # at 1e3 the loss reached 5.6e7, not inf, by step 24 (this CPU)
    elif damage == "inf weights":  # step 21's loss and gradient are finite; AdamW's decay of 1 - lr × 1e300 is not
        shutil.rmtree(checkpoint)
        extra = ["--weight_decay", "1e300", "--save_every", "1"]
    before = snapshot(tmp_path / "out")
    holder = open(tmp_path / "out" / "lock", "w")  # noqa: SIM115
    if damage == "lock":
        import fcntl
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another job holds it
    try:
        result = torchrun_in_process(2, TRAIN, *ARGV, *split(2), *extra, cwd=tmp_path, timeout=60)
    finally:
        holder.close()
    assert result.codes[0] == 1 and all(result.codes), result.codes
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(re.escape(said).replace(r"\?", "."), errors[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(tmp_path / "out") == before  # nothing saved over, nothing lost


def test_a_save_that_fails_is_one_line_and_the_checkpoints_before_it_stay_whole(tmp_path):
    """A full disk under rank 1 from step 8's save on: DCP's error, raised on every rank at the next
    save, becomes one line; step 4's checkpoint is whole and nothing claims step 8. A check file that a
    killed job left goes when the lock is taken."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / ".probe-0123456789ab").touch()
    result = torchrun_in_process(2, "gpt_disk_full.py", *ARGV, *split(2), cwd=tmp_path, timeout=60)
    assert result.codes[0] == 1 and all(result.codes), result.codes
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: the checkpoint of step 8 could not be saved (rank 1: OSError: [Errno 28] No space "
                      "left on device); step_00000004 and those before it are whole"], result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("step_*")) == ["step_00000004", "step_00000008.tmp"]
    assert (tmp_path / "out" / "step_00000004" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob(".probe-*"))


def test_an_out_dir_that_a_rank_does_not_share_is_refused_before_any_step(tmp_path):
    """Rank 1 on a folder of its own would write its shards where rank 0 never sees them: every
    checkpoint would lack them. Said in one line at the start; the folder keeps no file of the check."""
    result = torchrun_in_process(2, "gpt_private_out_dir.py", *ARGV, *split(2), cwd=tmp_path, timeout=60)
    assert result.codes[0] == 1 and all(result.codes), result.codes
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --out_dir out: the file that rank 0 wrote there is not seen: checkpoints need a "
                      f"folder that every rank shares (found by rank 1 on {socket.gethostname()} (node 0))"], \
        result.stderr
    assert list((tmp_path / "out").iterdir()) == []


def test_a_rank_given_other_options_stops_the_job_before_out_dir(tmp_path):
    """Rank 2 of 3 given another --lr and --max_steps (a node whose command line differs): refused in one line
    by the rank that differs, before OUT_DIR exists; the others say they stopped for it. Unchecked, the ranks
    trained two schedules, or one hung at a collective the others skipped."""
    result = torchrun_in_process(3, "gpt_other_options.py", *ARGV, *split(3), cwd=tmp_path, timeout=60)
    assert result.codes == [1, 1, 1], result.stderr
    host = f"{socket.gethostname()} (node 0)"
    assert result.stderrs[2].strip() == "error: every rank must be given the same options: --max_steps 5 where " \
        f"rank 0 has 24; --lr 1e-06 where rank 0 has 0.003 (found by rank 2 on {host})", result.stderrs[2]
    assert result.stderrs[0].strip() == f"stopped: rank 2 on {host} found an error" and not result.stderrs[1]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["OSError", "ValueError"])
def test_a_rank_that_fails_mid_run_is_named_by_the_others(kind, tmp_path):
    """Rank 1 fails on its own in its third step: its traceback (an OSError), or nothing (a ValueError, the kind
    of bad input's one line, which rank 0 prints where every rank meets one), and the cause in torchrun's error
    file; rank 0, whose next collective fails on the closed connection, says in one line which rank failed and
    why, not the connection's error. No checkpoint is written over."""
    result = torchrun_in_process(2, "gpt_fails_mid_run.py", *ARGV, *split(2), cwd=tmp_path, env={"FAIL_WITH": kind},
                                 timeout=60)
    assert result.codes == [1, 1], result.stderr
    cause = "OSError: [Errno 5] Input/output error" if kind == "OSError" else "ValueError: a value that only rank 1 met"
    if kind == "OSError":
        assert cause in result.stderrs[1]  # its traceback
    else:
        assert "Traceback" not in result.stderrs[1] and cause not in result.stderrs[1], result.stderrs[1]
    host = f"{socket.gethostname()} (node 0)"
    assert result.stderrs[0].strip().splitlines()[-1] == f"stopped: rank 1 on {host} failed: {cause}", \
        result.stderrs[0]
    assert "Traceback" not in result.stderrs[0]


def test_a_rank_that_hangs_gets_no_healthy_rank_blamed(tmp_path):
    """Rank 1 stops answering for 6 s in its third step (--timeout 3): rank 0's collective times out with no
    failure noted, and it says so in one line, naming no rank (it found nothing itself), not as its own error
    with a traceback; rank 1, back, finds rank 0 gone and says the same."""
    result = torchrun_in_process(2, "gpt_fails_mid_run.py", *ARGV, *split(2), "--timeout", "3", cwd=tmp_path,
                                 env={"FAIL_WITH": "hang"}, timeout=60)
    assert result.codes == [1, 1], result.stderr
    for stderr in result.stderrs:
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("stopped: a collective failed, and no rank noted a failure (a peer killed, stopped "
                               "or hung, or its host lost): "), stderr
        assert "Traceback" not in stderr and "(rank 0 on" not in stderr, stderr


def test_a_file_system_without_locks_is_said_in_one_line_and_the_job_goes_on(tmp_path):
    result = torchrun_in_process(2, "gpt_no_flock.py", *ARGV, *split(2), "--max_steps", "4", cwd=tmp_path,
                                 timeout=60)
    assert result.codes == [0, 0], result.stderr
    assert result.stdout.count("no lock on out: its file system does not support flock (ENOLCK); make sure no "
                               "other job writes there") == 1
    assert (tmp_path / "out" / "step_00000004" / "manifest.json").exists()


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_after_a_resume_the_optimizer_state_lives_where_a_fresh_runs_does(parallel, uninterrupted, tmp_path):
    """Adam's `step` on the CPU (unless fused: on the GPU), its moments beside their parameters: a
    resumed run whose `step` sat on the GPU would sync on it twice per parameter per step
    (pytorch/pytorch#128208). On a CPU-only machine every device is the CPU, so this shows the
    path and the dtypes; on a GPU, the devices too."""
    shutil.copytree(uninterrupted[2] / "out" / "step_00000020", tmp_path / "out" / "step_00000020")
    result = torchrun_in_process(2, "gpt_optimizer_state.py", *ARGV, *split(2), "--parallel", parallel,
                                 cwd=tmp_path, timeout=60)
    assert result.codes == [0, 0], result.stderr
    report = json.loads(result.stdouts[0].split("[optimizer state] ", 1)[1].splitlines()[0])
    assert report["resumed"] == report["fresh"]
    assert {key for entry in report["resumed"] for key in entry} == {"step", "exp_avg", "exp_avg_sq"}
    assert "resuming from out/step_00000020" in result.stdouts[0]


def test_restarts_on_several_nodes_on_torchruns_shared_store_are_refused_in_one_line():
    """The agents of several nodes do not agree on the attempt's number, so the per-attempt keys cannot
    keep a restart apart there: without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 train.py refuses at start."""
    code = "import sys; sys.path.insert(0, 'gpt'); import train; train.attempt_store(0)"
    env = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "3"}
    result = run([sys.executable, "-c", code], env=env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == ("error: torchrun --max-restarts on several nodes needs "
                                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every node "
                                     "(pytorch/pytorch#135712)")


def test_a_kill_9_of_torchrun_stops_its_workers_which_save_the_step_in_flight(tmp_path):
    """torchrun starts each worker in a session of its own, so nothing reaches them when it dies; Linux's
    parent-death signal does: a SIGTERM, which stops the run as a preemption does."""
    group = Group(tmp_path)
    agent = group.start([TORCHRUN, "--standalone", "--nproc-per-node", "2", TRAIN, *ARGV, *split(2),
                         "--max_steps", "100000", "--out_dir", str(tmp_path / "out")])
    group.wait_for(0, "step 3/", timeout=90)
    workers = descendants(agent.pid)
    assert workers
    os.kill(agent.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
              for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")
             and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]]
    for pid in alive:  # a failing test leaves no process behind
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived torchrun"
    assert any(name.startswith("step_") for name in os.listdir(tmp_path / "out"))  # the step in flight, saved


def test_the_time_a_save_takes_on_the_training_path_counts_in_the_tokens_per_second(tmp_path):
    """tests/gpt_slow_save.py adds 1 s to every save's part on the training path: the log interval that
    follows a save took at least that long, so its tokens/s is at most its tokens over 1 s (a bound,
    not a timing: a sleep lasts at least what it asks). Red when the save is left out of the interval."""
    result = torchrun_in_process(2, "gpt_slow_save.py", *ARGV, *split(2), "--max_steps", "8", cwd=tmp_path,
                                 timeout=60)
    assert result.codes == [0, 0], result.stderr
    logged = {r["step"]: r["tokens_per_s"] for r in records(tmp_path) if "tokens_per_s" in r}
    tokens_per_step = 12 * 32  # ARGV's global batch of 12 sequences of 32 tokens
    assert logged[5] <= tokens_per_step / 1.0  # step 5's interval holds the save of step 4


@pytest.mark.parametrize(("max_steps", "stopped_after"), [(2, None), (3, 2)])
def test_a_stop_agreed_at_the_last_step_lets_the_run_finish_and_export(max_steps, stopped_after, tmp_path):
    """SIGTERM as step 1 starts: the agreement sent after step 1 carries it and is read after step 2
    (StopRequest's first intervals are one step each). With --max_steps 2 the run is done there, so it
    ends as any run does (exit 0, --export written), not as a stop; with 3 it stops after step 2."""
    result = torchrun_in_process(1, "gpt_late_signal.py", *ARGV, *split(1), "--max_steps", str(max_steps),
                                 "--export", "model.pt", cwd=tmp_path, env={"SIGNAL_AT": "1"}, timeout=60)
    stopped = re.findall(r"stopped by SIGTERM after step (\d+)", result.stdout)
    if stopped_after is None:
        assert result.codes == [0] and not stopped and (tmp_path / "model.pt").exists(), result.stdout
    else:
        assert result.codes == [128 + signal.SIGTERM] and stopped == [str(stopped_after)], result.stdout
        assert not (tmp_path / "model.pt").exists()


def test_a_signal_during_an_evaluation_stops_after_it_at_once(tmp_path):
    """An evaluation can be long, and the next agreement intervals away: a blocking agreement follows
    each evaluation, so a SIGTERM during the one at step 8 stops every rank after step 8 and saves it."""
    result = torchrun_in_process(2, "gpt_late_signal.py", *ARGV, *split(2), "--eval_every", "8", cwd=tmp_path,
                                 env={"SIGNAL_AT": "0", "SIGNAL_IN_EVAL": "1"}, timeout=60)
    assert result.codes == [128 + signal.SIGTERM] * 2, result.stderr
    assert re.findall(r"stopped by SIGTERM after step (\d+)", result.stdouts[0]) == ["8"], result.stdouts[0]
    assert (tmp_path / "out" / "step_00000008" / "manifest.json").is_file()
