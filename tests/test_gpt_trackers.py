"""train.py --tensorboard and --wandb (gpt/trackers.py): every number of every record metrics.jsonl holds is a
scalar at its step in TensorBoard's event files (read back by tensorboard's own EventAccumulator) and in the W&B
run's history (an offline run's .wandb files, read back below), once, across a resume that logs again steps the
stopped run had logged; one W&B run id across it; no wandb-core process left; without the package, one line that
says how to install it."""
import glob
import importlib.util
import json
import os
import shutil
import signal
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from harness import torchrun_in_process
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_gpt import import_gpt, strict_records
from wandb.proto import wandb_internal_pb2

trackers = import_gpt("trackers")
RUN = ["--seq_len", "16", "--batch_size", "2", "--grad_accum", "2", "--val_tokens", "64", "--log_every", "1",
       "--eval_every", "3", "--max_steps", "8", "--save_every", "4", "--out_dir", "out"]
PP = ["--parallel", "fsdp", "--pp", "2"]


def logged(folder) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) pairs as TensorBoard shows them."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(path: str):
    """The Record protobufs of a .wandb file: W&B's LevelDB-style log (a 7-byte header, ":W&B", 0xBEE1, version
    0; then 32 KiB blocks of chunks, each a crc32 of its type and data, its length and its type: whole, first,
    middle or last), as wandb-core writes it; every checksum checked."""
    data = open(path, "rb").read()
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), data[:7]
    at, chunks = 7, []
    while at + 7 <= len(data):
        left = 32768 - at % 32768
        crc, length, kind = struct.unpack("<IHB", data[at:at + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled trailer
            at += left
            continue
        body = data[at + 7:at + 7 + length]
        assert zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, f"{path}: a bad checksum at {at}"
        at, chunks = at + 7 + length, chunks + [body]
        if kind in (1, 4):  # whole, or the last of a record's chunks
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            yield record


def wandb_runs(out_dir) -> list[dict]:
    """Each offline run's id, config, history ({step: {name: value}}, W&B's own _names left out) and exit code,
    in the order they ran."""
    runs = []
    for path in sorted(glob.glob(str(out_dir / "wandb" / "offline-run-*" / "*.wandb"))):
        run = {"history": {}, "exit": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"] = record.run.run_id
                run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in
                       record.history.item}
                assert row.pop("_step") == record.history.step.num
                run["history"][record.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "exit":
                run["exit"] = record.exit.exit_code
        runs.append(run)
    return runs


def wandb_cores(marker: str) -> list[int]:
    """The wandb-core processes started by a run whose environment holds marker (a test's own folder)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if b"wandb-core" not in file.read().split(b"\0")[0]:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as file:
                if marker.encode() in file.read():
                    found.append(int(pid))
        except OSError:  # ended meanwhile
            pass
    return found


def test_every_record_is_a_scalar_at_its_step_once_across_a_resume(tmp_path):
    """pp 2 on 2 ranks (its records hold a list, each stage's wait, and a dict, the micro-batches each held), 8
    steps, a checkpoint at 4 and 8; the one at 8 removed (as if the run had died after logging step 8, before
    saving it), the run resumed from 4 with another --lr (said, applied) and on to step 10: steps 5 to 8 logged
    again, with other values, which replace the first run's in TensorBoard as in metrics.jsonl. W&B's history only
    grows: the same run takes steps 9 and 10 from the resumed run, and keeps the first run's 1 to 8."""
    env = {"WANDB_MODE": "offline", "TEST_FOLDER": str(tmp_path)}
    first = torchrun_in_process(2, "gpt/train.py", *RUN, *PP, "--tensorboard", "--wandb", "gpt-test", cwd=tmp_path,
                                env=env, timeout=120)
    assert first.codes == [0, 0], first.stderr
    before = strict_records(tmp_path / "out" / "metrics.jsonl")
    shutil.rmtree(tmp_path / "out" / "step_00000008")
    again = torchrun_in_process(2, "gpt/train.py", *RUN, *PP, "--tensorboard", "--wandb", "gpt-test", "--lr", "1e-3",
                                "--max_steps", "10", cwd=tmp_path, env=env, timeout=120)
    assert again.codes == [0, 0] and "resuming from out/step_00000004" in again.stdouts[0], again.stderr
    records = strict_records(tmp_path / "out" / "metrics.jsonl")
    assert [r["loss"] for r in records if 4 < r["step"] <= 8 and "loss" in r] != \
        [r["loss"] for r in before if r["step"] > 4 and "loss" in r]  # other values: the resumed run's to show
    expected = {}
    for record in records:
        for name, value in trackers.scalars(record).items():
            expected.setdefault(name, []).append((record["step"], float(np.float32(value))))
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "pp_wait/1", "pp_held/0"} <= set(expected)
    assert logged(tmp_path / "out" / "tensorboard") == expected
    history = {}
    for record in [r for r in before if r["step"] <= 8] + [r for r in records if r["step"] > 8]:
        history.setdefault(record["step"], {}).update(trackers.scalars(record))
    runs = wandb_runs(tmp_path / "out")
    assert [run["id"] for run in runs] == [(tmp_path / "out" / "wandb_id").read_text().strip()] * 2
    assert {**runs[0]["history"], **runs[1]["history"]} == history and min(runs[1]["history"]) == 9
    assert [(run["config"]["max_steps"], run["config"]["lr"], run["config"]["ranks"]) for run in runs] == \
        [(8, 3e-3, 2), (10, 1e-3, 2)]  # the options each ran
    assert [run["exit"] for run in runs] == [0, 0] and wandb_cores(str(tmp_path)) == []


def test_a_wandb_core_ended_by_a_signal_stops_w_and_b_alone(tmp_path):
    """A signal to every process of a job (Slurm's scancel sends one) ends wandb-core too, which W&B's next log
    call meets as a lost connection: the run goes on, says it once, and loses no record."""
    def kill_the_core():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (tmp_path / "out" / "metrics.jsonl").exists():
            time.sleep(0.05)
        while time.monotonic() < deadline and not (cores := wandb_cores(str(tmp_path))):
            time.sleep(0.05)
        for pid in cores:
            os.kill(pid, signal.SIGTERM)
    killer = threading.Thread(target=kill_the_core)
    killer.start()
    result = torchrun_in_process(1, "gpt/train.py", *RUN, "--max_steps", "60", "--save_every", "0", "--wandb",
                                 "gpt-test", cwd=tmp_path, env={"WANDB_MODE": "offline", "TEST_FOLDER": str(tmp_path)},
                                 timeout=120)
    killer.join()
    assert result.codes == [0], result.stderr
    said = [line for line in result.stdouts[0].splitlines() if line.startswith("W&B stopped at step")]
    assert len(said) == 1 and said[0].endswith("metrics.jsonl goes on"), result.stdouts[0]
    assert [r["step"] for r in strict_records(tmp_path / "out" / "metrics.jsonl") if "loss" in r] == \
        list(range(1, 61))
    assert "Traceback" not in result.stderr, result.stderr


def test_a_w_and_b_that_cannot_start_is_one_line_and_nothing_is_written(tmp_path):
    """Online with no API key (and no network here): wandb.init's error, said once, before anything is written."""
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "WANDB_CONFIG_DIR": str(tmp_path / "config"),
           "NETRC": str(tmp_path / "netrc"), "TEST_FOLDER": str(tmp_path)}
    result = torchrun_in_process(2, "gpt/train.py", *RUN, "--wandb", "gpt-test", cwd=tmp_path, env=env, timeout=120)
    assert result.codes == [1, 1], result.stderr
    assert result.stderr.splitlines()[0].startswith("error: --wandb gpt-test: UsageError: No API key configured. "
                                                    "Use `wandb login` to log in."), result.stderr
    assert os.listdir(tmp_path / "out") == ["lock"]  # the lock every run takes, and nothing else
    assert wandb_cores(str(tmp_path)) == []


def test_a_folder_after_it_is_where_the_events_go(tmp_path):
    result = torchrun_in_process(1, "gpt/train.py", *RUN, "--max_steps", "2", "--tensorboard", "tb/run1",
                                 cwd=tmp_path, timeout=120)
    assert result.codes == [0], result.stderr
    assert [step for step, _ in logged(tmp_path / "tb" / "run1")["loss"]] == [1, 2]
    assert not (tmp_path / "out" / "tensorboard").exists()


@pytest.mark.parametrize("option, package, argv", [("--tensorboard", "tensorboard", ["--tensorboard"]),
                                                   ("--wandb", "wandb", ["--wandb", "p"])])
def test_without_the_package_it_says_how_to_install_it(monkeypatch, capsys, option, package, argv):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else
                        find_spec(name, *a))
    monkeypatch.setattr("sys.argv", ["train.py"])
    with pytest.raises(SystemExit) as stopped:
        import_gpt().parse_args(argv)
    assert stopped.value.code == 2 and capsys.readouterr().err == \
        f"train.py: error: {option} needs the {package} package: pip install -r requirements-tracking.txt\n"


def test_a_tensorboard_folder_that_cannot_be_made_is_one_line_before_training(tmp_path):
    (tmp_path / "tb").write_text("a file, not a folder")
    result = torchrun_in_process(1, "gpt/train.py", *RUN, "--tensorboard", "tb/run1", cwd=tmp_path, timeout=120)
    assert result.codes == [1] and result.stderr == "error: --tensorboard tb/run1: Not a directory\n" and \
        "step 1" not in result.stdouts[0], result.stdouts[0] + result.stderr
