"""gpt/gpu_check.py, as far as a CPU reaches: its commands are ones train.py accepts, its argument
handling, and its readings of a run's output and of a --profile trace (a real one, from the CPU).
The checks themselves need CUDA: README.md says where they ran."""
import json
import shlex
import sys

import pytest
import torch
from harness import torchrun_in_process
from launch import REPO, run
from test_gpt import import_gpt

sys.path.insert(0, str(REPO))
from gpt.gpu_check import CHECKS, host_waits, recompiles_after_first_log  # noqa: E402

SCRIPT = str(REPO / "gpt" / "gpu_check.py")


def test_every_command_of_the_check_is_one_that_train_py_accepts():
    result = run([sys.executable, SCRIPT, "--dry_run", "--out", "somewhere"], timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["ddp", "fsdp", "fp16", "sigterm", "sigterm", "profile",
                                                     *["checkpoint"] * 3, "llama"]
    gpt_train = import_gpt()
    for line in lines:
        argv = shlex.split(line.split("gpt/train.py ", 1)[1])
        args = gpt_train.parse_args(argv)
        assert args.out_dir.startswith("somewhere/")
    only = run([sys.executable, SCRIPT, "--dry_run", "--only", "fp16"], timeout=60)
    assert [line.split(":")[0] for line in only.stdout.splitlines()] == ["fp16"] and set(CHECKS) > {"fp16"}


@pytest.mark.parametrize(("argv", "code", "said"), [
    (["--only", "nothing"], 2, "invalid choice: 'nothing'"),
    (["--timeout", "0"], 2, "--timeout must be above 0"),
    ([], 1, "error: no CUDA device: the GPU check needs one"),
])
def test_bad_options_and_a_machine_without_a_gpu_get_one_line(argv, code, said, tmp_path):
    if not argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    result = run([sys.executable, SCRIPT, *argv, "--out", str(tmp_path / "out")], timeout=60)
    assert result.returncode == code and said in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_profile_writes_a_trace_per_rank_with_each_step_and_the_host_waits_are_counted_in_them(tmp_path):
    """train.py --profile 11:14 at 2 ranks on the CPU: each rank's trace loads as JSON and holds the
    steps' ranges (no CUDA waits on a CPU); a wait placed inside step 12 is counted there alone."""
    result = torchrun_in_process(2, "gpt/train.py", "--max_steps", "16", "--seq_len", "16", "--log_every", "4",
                                 "--eval_every", "16", "--val_tokens", "64", "--profile", "11:14", "--out_dir", "out",
                                 cwd=tmp_path, timeout=120)
    assert result.codes == [0, 0], result.stderr
    traces = sorted((tmp_path / "out" / "profile").iterdir())
    assert [t.name for t in traces] == ["steps_11-14_rank0.json", "steps_11-14_rank1.json"]
    for trace in traces:
        assert host_waits(str(trace)) == {f"step {s}": 0 for s in range(11, 15)}
    events = json.loads(traces[0].read_text())
    step_12 = next(e for e in events["traceEvents"] if e.get("name") == "step 12")
    events["traceEvents"].append({"ph": "X", "name": "cudaStreamSynchronize", "ts": step_12["ts"] + 1, "dur": 1})
    traces[0].write_text(json.dumps(events))
    assert host_waits(str(traces[0])) == {"step 11": 0, "step 12": 1, "step 13": 0, "step 14": 0}


def test_a_recompilation_between_the_first_and_last_log_lines_is_found():
    output = ["Recompiling function forward (at start-up: allowed)", "step 10/30 | loss 9.1", "step 20/30 | loss 8.0",
              "V1127 ... Recompiling function forward in block.py", "step 30/30 | loss 7.5",
              "Recompiling function forward (evaluation: allowed)"]
    assert recompiles_after_first_log("\n".join(output)) == [output[3]]
    assert recompiles_after_first_log("\n".join(output[:3] + output[4:])) == []


def test_a_resume_inside_the_profiled_steps_traces_the_rest_and_one_past_them_says_so(tmp_path):
    argv = ("--seq_len", "16", "--log_every", "2", "--eval_every", "100", "--val_tokens", "64", "--out_dir", "out")
    first = torchrun_in_process(1, "gpt/train.py", *argv, "--max_steps", "4", cwd=tmp_path, timeout=60)
    assert first.codes == [0], first.stderr
    inside = torchrun_in_process(1, "gpt/train.py", *argv, "--max_steps", "8", "--profile", "3:6", cwd=tmp_path,
                                 timeout=60)
    assert inside.codes == [0], inside.stderr
    assert host_waits(str(tmp_path / "out" / "profile" / "steps_5-6_rank0.json")) == {"step 5": 0, "step 6": 0}
    past = torchrun_in_process(1, "gpt/train.py", *argv, "--max_steps", "10", "--profile", "3:6", cwd=tmp_path,
                               timeout=60)
    assert past.codes == [0] and "no profile: this run starts at step 9, past --profile 3:6" in past.stdouts[0]
