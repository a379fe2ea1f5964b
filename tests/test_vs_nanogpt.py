"""gpt/vs_nanogpt.py's plumbing, against a stand-in for nanoGPT's checkout with its interface
(tests/nanogpt_standin: the same --key=value overrides, data folder and step lines): both run on the same ids and
shape, the table and the ratio printed; a failed run, a folder without nanoGPT and bad options are one line each;
the GPU's busy share computed from a trace's kernels. The real comparison is the benchmark's (docs/gpt_speed.md)."""
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from test_errors import assert_one_line, run_main

REPO = Path(__file__).resolve().parent.parent
STANDIN = str(REPO / "tests" / "nanogpt_standin")
sys.path.insert(0, str(REPO / "gpt"))
import vs_nanogpt  # noqa: E402  (gpt/'s script; it imports no sibling)

sys.path.remove(str(REPO / "gpt"))


def test_both_run_on_the_same_ids_and_the_table_holds_their_tokens_per_second():
    code, stdout, stderr = run_main("vs_nanogpt", "--nanogpt", STANDIN, "--steps", "20", "--repeats", "1",
                                    "--device", "cpu", "--parallel", "fsdp")
    assert code == 0, stderr
    assert stdout.splitlines()[0] == ("tiny shape (2 layers, 64 wide, 2 heads, vocab 256), seq_len 64, batch 8, fp32, "
                                      "eager, cpu, gpt/ under fsdp, 20 steps, 1 run each")
    rows = {line.split()[0]: line.split()[1:] for line in stdout.splitlines()[2:4]}
    gpt, nanogpt = (float(rows[who][0].replace(",", "")) for who in ("gpt/train.py", "nanoGPT"))
    assert gpt > 0 and nanogpt > 0
    ratio = float(re.search(r"ratio gpt/ : nanoGPT ([\d.]+)", stdout).group(1))
    assert ratio == pytest.approx(gpt / nanogpt, abs=0.006)
    assert "gpt/ GPU busy - (no GPU kernels: a CPU)" in stdout


def test_a_failed_nanogpt_run_is_one_line():
    assert_one_line(*run_main("vs_nanogpt", "--nanogpt", STANDIN, "--steps", "20", "--repeats", "1", "--device",
                              "cpu", env={"STANDIN_FAIL": "1"})[::2],
                    "nanoGPT's train.py failed (exit 1): a broken checkout")


@pytest.mark.parametrize("argv, message", [
    (["--nanogpt", "/nonexistent"], "--nanogpt /nonexistent: no nanoGPT checkout there"),
    (["--nanogpt", STANDIN, "--steps", "5"], "--steps must be at least 20"),
    (["--nanogpt", STANDIN, "--batch_size", "0"], "--batch_size at least 1"),
    (["--nanogpt", STANDIN, "--device", "cpu", "--precision", "bf16"], "--precision bf16 is for a GPU"),
    (["--nanogpt", STANDIN, "--shape", "huge"], "argument --shape: invalid choice: 'huge'"),
    ([], "the following arguments are required: --nanogpt"),
])
def test_bad_options_are_one_line(argv, message):
    assert_one_line(*run_main("vs_nanogpt", *argv)[::2], message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU takes --device cuda")
def test_cuda_without_a_gpu_is_one_line():
    assert_one_line(*run_main("vs_nanogpt", "--nanogpt", STANDIN, "--device", "cuda")[::2], "no GPU is visible here")


def test_the_busy_share_is_the_union_of_the_kernels_over_their_span(tmp_path):
    """Kernels at 0-10 and 5-20 (overlapping, on two streams) and 30-40, a CPU op between: busy 30 of 40."""
    events = [{"cat": "kernel", "ts": 0, "dur": 10}, {"cat": "kernel", "ts": 5, "dur": 15},
              {"cat": "cpu_op", "ts": 20, "dur": 10}, {"cat": "kernel", "ts": 30, "dur": 10}]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    assert vs_nanogpt.busy_share(str(tmp_path / "trace.json")) == (0.75, 3)
    (tmp_path / "cpu.json").write_text(json.dumps({"traceEvents": events[2:3]}))
    assert vs_nanogpt.busy_share(str(tmp_path / "cpu.json")) is None


def test_runs_that_differ_by_more_than_twice_are_said_to_be_unreliable():
    assert vs_nanogpt.uneven({"gpt/train.py": [30_000, 36_000], "nanoGPT": [31_000, 29_000, 40_000]}) is None
    assert vs_nanogpt.uneven({"gpt/train.py": [30_000], "nanoGPT": [729, 16_361]}) == (
        "warning: nanoGPT's runs differ by more than 2x (729 to 16,361 tokens/s): other work had the cores; run "
        "again on idle ones")
