"""bench_pipeline.py's table: each run's lines parsed into the median idle fraction, its range, the formula, the
step's time and the most micro-batches held; a failed run said in one line; bad options refused in one. The runs
themselves are pipeline_parallel.py's, whose lines its own tests parse; here subprocess.run returns canned ones."""
import subprocess

import pytest
from test_errors import assert_one_line, run_main


def canned(idle: dict[str, list[float]], code: int = 0):
    """A fake subprocess.run: each schedule's run prints its check lines and a step line per idle fraction."""
    original = subprocess.run

    def run(command, **kwargs):
        if "--schedule" not in command:  # platform.processor(), for the machine's line
            return original(command, **kwargs)
        schedule, stages = command[command.index("--schedule") + 1], int(command[command.index("--nproc-per-node") + 1])
        m = int(command[command.index("--micro_batches") + 1])
        k = 3 if schedule == "zb" else 1
        lines = [f"[rank {r}/{stages}] stage {r}, blocks 0: by hand 0.0e+00, torch's 0.0e+00 from one process | "
                 f"at most {stages - r if schedule == '1f1b' else m} of {m} micro-batches' activations kept"
                 for r in range(stages)]
        lines += [f"step {s} | loss 4.0 (one process: 4.0) | idle {value:.2f} of {100 + s} ms, "
                  f"(p-1)/({'3' * (k == 3)}m+p-1) = {(stages - 1) / (k * m + stages - 1):.2f}"
                  for s, value in enumerate(idle[schedule])]
        box = "=" * 60  # torchrun's report of a failed worker ends in one
        return subprocess.CompletedProcess(command, code, "\n".join(lines) + "\n", f"error: it broke\n{box}\n")
    return run


def test_each_row_is_its_runs_median_range_formula_time_and_most_held(monkeypatch):
    idle = {"gpipe": [0.5, 0.3, 0.4], "1f1b": [0.2, 0.4, 0.3], "zb": [0.1, 0.3, 0.2]}
    monkeypatch.setattr(subprocess, "run", canned(idle))
    code, stdout, stderr = run_main("bench_pipeline.py", "--stages", "2", "--micro_batches", "8", "--steps", "3")
    assert code == 0, stderr
    rows = [line.split("|") for line in stdout.splitlines()[2:]]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["2", "gpipe", "0.40 (0.30-0.50)", "0.11", "101", "8"],
        ["2", "1f1b", "0.30 (0.20-0.40)", "0.11", "101", "2"],
        ["2", "zb", "0.20 (0.10-0.30)", "0.04", "101", "8"]]


def test_a_failed_run_is_one_line(monkeypatch):
    monkeypatch.setattr(subprocess, "run", canned({"gpipe": []}, code=1))
    assert_one_line(*run_main("bench_pipeline.py", "--stages", "3")[::2], "gpipe at 3 stages failed: error: it broke")


@pytest.mark.parametrize("argv, message", [
    (["--stages", "1"], "argument --stages: must be from 2 to 8, got 1"),
    (["--n_embd", "30"], "--n_embd must be a multiple of 4"),
    (["--stages", "2", "4", "--micro_batches", "3"], "--micro_batches 3: 1F1B and zero bubble need one per stage"),
    (["--steps", "0"], "argument --steps: must be from 1 to 100, got 0"),
    (["--stages", "2", "--micro_batches", "5"], "--micro_batches 5 at 2 stages: not a multiple of 2"),
])
def test_bad_input_is_one_line(argv, message):
    assert_one_line(*run_main("bench_pipeline.py", *argv)[::2], message)
