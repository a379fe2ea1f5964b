"""bench_memory.py's table: the jobs' lines gathered, the paper's formulas beside them, and a
failed job said in one line. The jobs themselves are the scripts' own tests' (their lines are
parsed there with the same patterns); here subprocess.run is replaced by canned outputs."""
import subprocess
import sys

import pytest

import bench_memory

PSI = 2_121_729  # model.py's wide MLP


def test_the_formulas_are_the_papers():
    for n in (1, 2, 3, 4):
        ddp, zero, fsdp = (sum(bench_memory.predicted(PSI, m, n).values()) for m in ("DDP", "ZeRO-1", "FSDP2"))
        assert ddp == 16 * PSI
        assert zero == 8 * PSI + 8 * PSI / n
        assert fsdp == pytest.approx(16 * PSI / n)


def fake_run(outputs: dict[str, str], code: int = 0):
    def run(command, **kwargs):
        script = next(word for word in command if word.endswith(".py")).rsplit("/", 1)[1]
        method = "DDP" if "--no_zero" in command else {"zero_optimizer.py": "ZeRO-1", "fsdp2.py": "FSDP2"}[script]
        box = "=" * 60  # torchrun's report of a failed worker ends in one
        stderr = f"[rank0]: Traceback ...\nerror: it broke\n{box}\nRoot Cause (first observed failure):\n{box}"
        return subprocess.CompletedProcess(command, code, outputs[method], stderr)
    return run


def lines(world_size: int, held: list[tuple[int, int, int]], ms: float) -> str:
    out = [f"[rank {r}/{world_size}] bytes held: parameters {p:,} | gradients {g:,} | optimizer state {o:,}"
           for r, (p, g, o) in enumerate(held)]
    return "\n".join([*out, "epoch 0 | train_loss:1.0 val_loss:1.0",
                      f"step time: {ms:.2f} ms (median of 9 steps, rank 0)"])


def test_every_rank_of_every_method_is_a_row_with_its_prediction(monkeypatch, capsys):
    outputs = {"DDP": lines(2, [(4 * PSI, 4 * PSI, 8 * PSI)] * 2, 10.0),
               "ZeRO-1": lines(2, [(4 * PSI, 4 * PSI, 8_000_000), (4 * PSI, 4 * PSI, 8 * PSI - 8_000_000)], 12.5),
               "FSDP2": lines(2, [(2 * PSI, 2 * PSI, 4 * PSI)] * 2, 15.0)}
    monkeypatch.setattr(subprocess, "run", fake_run(outputs))
    monkeypatch.setattr(sys, "argv", ["bench_memory.py", "--world_sizes", "2"])
    bench_memory.main()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "rank" not in line]
    assert [(row[0], row[1]) for row in rows] == [("DDP", "0"), ("DDP", "1"), ("ZeRO-1", "0"), ("ZeRO-1", "1"),
                                                  ("FSDP2", "0"), ("FSDP2", "1")]
    # MB measured (predicted): parameters, gradients, optimizer state, total; then the step over DDP's
    assert rows[0][2:] == ["8.49", "(8.49)", "8.49", "(8.49)", "16.97", "(16.97)", "33.95", "(33.95)", "1.00"]
    assert rows[2][2:] == ["8.49", "(8.49)", "8.49", "(8.49)", "8.00", "(8.49)", "24.97", "(25.46)", "1.25"]
    assert rows[3][6:] == ["8.97", "(8.49)", "25.95", "(25.46)"]  # only rank 0 times the steps
    assert rows[4][2:] == ["4.24", "(4.24)", "4.24", "(4.24)", "8.49", "(8.49)", "16.97", "(16.97)", "1.50"]


def test_a_failed_job_is_one_line(monkeypatch, capsys):
    outputs = {method: "" for method in bench_memory.METHODS}
    monkeypatch.setattr(subprocess, "run", fake_run(outputs, code=1))
    monkeypatch.setattr(sys, "argv", ["bench_memory.py", "--world_sizes", "2"])
    with pytest.raises(SystemExit) as exit_info:
        bench_memory.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: the DDP job at 2 ranks failed (exit 1): error: it broke\n"
