"""train.py --tensorboard (gpt/trackers.py): every number of every record metrics.jsonl holds is a scalar at its
step in TensorBoard's event files, read back by tensorboard's own EventAccumulator, once, across a resume that logs
again steps the stopped run had logged; without the package, one line that says how to install it."""
import importlib.util
import shutil

import numpy as np
import pytest
from harness import torchrun_in_process
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_gpt import import_gpt, strict_records

trackers = import_gpt("trackers")
RUN = ["--seq_len", "16", "--batch_size", "2", "--grad_accum", "2", "--val_tokens", "64", "--log_every", "1",
       "--eval_every", "3", "--max_steps", "8", "--save_every", "4", "--out_dir", "out"]
PP = ["--parallel", "fsdp", "--pp", "2"]


def logged(folder) -> dict[str, list[tuple[int, float]]]:
    """Each scalar's (step, value) pairs as TensorBoard shows them."""
    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_every_record_is_a_scalar_at_its_step_once_across_a_resume(tmp_path):
    """pp 2 on 2 ranks (its records hold a list, each stage's wait, and a dict, the micro-batches each held), 8
    steps, a checkpoint at 4 and 8; the one at 8 removed (as if the run had died after logging step 8, before
    saving it), the run resumed from 4 with another --lr (said, applied): steps 5 to 8 logged again, with other
    values, which replace the first run's in TensorBoard as in metrics.jsonl."""
    first = torchrun_in_process(2, "gpt/train.py", *RUN, *PP, "--tensorboard", cwd=tmp_path, timeout=120)
    assert first.codes == [0, 0], first.stderr
    before = strict_records(tmp_path / "out" / "metrics.jsonl")
    shutil.rmtree(tmp_path / "out" / "step_00000008")
    again = torchrun_in_process(2, "gpt/train.py", *RUN, *PP, "--tensorboard", "--lr", "1e-3", cwd=tmp_path,
                                timeout=120)
    assert again.codes == [0, 0] and "resuming from out/step_00000004" in again.stdouts[0], again.stderr
    records = strict_records(tmp_path / "out" / "metrics.jsonl")
    assert [r["loss"] for r in records if r["step"] > 4 and "loss" in r] != \
        [r["loss"] for r in before if r["step"] > 4 and "loss" in r]  # other values: the resumed run's to show
    expected = {}
    for record in records:
        for name, value in trackers.scalars(record).items():
            expected.setdefault(name, []).append((record["step"], float(np.float32(value))))
    assert {"loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "pp_wait/1", "pp_held/0"} <= set(expected)
    assert logged(tmp_path / "out" / "tensorboard") == expected


def test_a_folder_after_it_is_where_the_events_go(tmp_path):
    result = torchrun_in_process(1, "gpt/train.py", *RUN, "--max_steps", "2", "--tensorboard", "tb/run1",
                                 cwd=tmp_path, timeout=120)
    assert result.codes == [0], result.stderr
    assert [step for step, _ in logged(tmp_path / "tb" / "run1")["loss"]] == [1, 2]
    assert not (tmp_path / "out" / "tensorboard").exists()


def test_without_tensorboard_it_says_how_to_install_it(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else
                        find_spec(name, *a))
    monkeypatch.setattr("sys.argv", ["train.py"])
    with pytest.raises(SystemExit) as stopped:
        import_gpt().parse_args(["--tensorboard"])
    assert stopped.value.code == 2 and capsys.readouterr().err == \
        "train.py: error: --tensorboard needs the tensorboard package: pip install -r requirements-tracking.txt\n"
