"""What a new user met in gpt/'s first hour, each red before its fix: a finished run run again said nothing of being
finished; a warmup as long as the run was taken in silence; the files the documented commands write were not
ignored by git. (A mistyped option under torchrun: tests/test_gpt.py; a small corpus's splits:
tests/test_gpt_prepare.py.)"""
import subprocess

import pytest
from harness import torchrun_in_process
from test_gpt import REPO, strict_records

SHORT = ["--seq_len", "16", "--batch_size", "2", "--val_tokens", "64", "--log_every", "2", "--out_dir", "out"]


def test_a_finished_run_run_again_says_it_had_finished_and_trains_nothing(tmp_path):
    first = torchrun_in_process(1, "gpt/train.py", *SHORT, "--max_steps", "4", "--warmup_steps", "2", cwd=tmp_path)
    assert first.codes == [0], first.stderr
    logged = strict_records(tmp_path / "out" / "metrics.jsonl")
    again = torchrun_in_process(1, "gpt/train.py", *SHORT, "--max_steps", "4", "--warmup_steps", "2", cwd=tmp_path)
    assert again.codes == [0], again.stderr
    assert "resuming from out/step_00000004: step 4 of 4: the run had finished, and nothing is trained (a larger " \
           "--max_steps trains on)" in again.stdouts[0], again.stdouts[0]
    assert strict_records(tmp_path / "out" / "metrics.jsonl") == logged and "step 4/4" not in again.stdouts[0]


@pytest.mark.parametrize(("warmup", "said"), [(4, True), (6, True), (3, False)])
def test_a_warmup_that_spans_the_whole_run_is_said(warmup, said, tmp_path):
    result = torchrun_in_process(1, "gpt/train.py", *SHORT, "--max_steps", "4", "--warmup_steps", str(warmup),
                                 "--lr", "1e-3", cwd=tmp_path)
    assert result.codes == [0], result.stderr
    peak = f"{1e-3 * min(1, 4 / warmup):.2e}"
    line = f"--warmup_steps {warmup} spans the whole run (--max_steps 4): the learning rate rises to {peak} at the " \
           "last step, with no decay"
    assert (line in result.stdouts[0]) == said, result.stdouts[0]


@pytest.mark.parametrize("path", ["data/mine/mine_train_000001.bin", "loss.png", "pp.png", "layouts.png",
                                  "out/step_00000300/manifest.json", "hf/llama-1b/config.json", "fox.txt",
                                  "gpt2-hf/model.safetensors", "llama-1b/tokenizer.json", "qwen3-0.6b/config.json"])
def test_what_the_documented_commands_write_is_ignored_by_git(path):
    """prepare.py's --out_dir data/..., plot.py's pictures, train.py's out/, hf.py export's hf/, the sampled text,
    the downloaded folders of docs/gpt_cluster.md and gpt_models.md."""
    ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
    assert ignored.returncode == 0, f"{path} is not in .gitignore"
