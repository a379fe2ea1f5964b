"""bench_by_hand.py: one run at tiny sizes whose JSON holds every figure, recomputable from the rounds' times,
the collectives each row makes, rows that train the same model, and a trace of the hand-written DDP whose
all-reduces start while backward runs. No speed is asserted: speed is what the benchmark prints, never a
test's assertion."""
import json
import sys

import pytest
import torch
from harness import torchrun_in_process
from launch import REPO

sys.path.insert(0, str(REPO))  # the scripts live at the repository root
import bench_by_hand  # noqa: E402
import benchtools  # noqa: E402

RANKS = 2
TINY = ["--batch-size", "8", "--bucket-mb", "1", "25", "--warmup", "2", "--steps", "2", "--rounds", "2"]
ROWS = ["DDP by hand@1", "torch DDP@1", "DDP by hand@25", "torch DDP@25", "ZeRO-1 by hand", "ZeRO-2 by hand",
        "ZeroRedundancyOptimizer", "ZeRO-3 by hand", "FSDP2"]  # in the order they take turns
PNG = b"\x89PNG\r\n\x1a\n"


def test_each_by_hand_row_races_its_torch_counterpart():
    assert bench_by_hand.comparisons([1.0, 25.0]) == [
        ("DDP by hand@1", "torch DDP@1", 1.10), ("DDP by hand@25", "torch DDP@25", 1.10),
        ("ZeRO-1 by hand", "ZeroRedundancyOptimizer", None), ("ZeRO-2 by hand", "ZeroRedundancyOptimizer", 1.2),
        ("ZeRO-3 by hand", "FSDP2", None)]
    assert bench_by_hand.ratio(by_hand=11.0, torch_own=10.0) == pytest.approx(1.1)
    assert bench_by_hand.label("DDP by hand@0.5") == "DDP by hand, 0.5 MiB buckets"
    assert bench_by_hand.calls({"all_reduce": 1, "broadcast": 8}) == "1 AR 8 BC"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, object, str]:
    """One run at tiny sizes with a trace: (the JSON report, the trace folder, rank 0's stderr)."""
    traces = tmp_path_factory.mktemp("traces")
    result = torchrun_in_process(RANKS, "bench_by_hand.py", *TINY, "--json", "--trace", str(traces), timeout=150)
    assert result.codes == [0] * RANKS, result.stderr
    assert result.stdouts[1] == ""  # every rank holds the report, and rank 0 alone prints it
    return json.loads(result.stdouts[0]), traces, result.stderrs[0]


def test_every_figure_is_there_and_recomputes_from_the_rounds(run):
    report, _, _ = run
    assert report["world_size"] == RANKS and report["backend"] == "gloo" and "torch 2." in report["machine"]
    assert report["model"] == "wide" and report["parameters"] == 2_121_729
    assert report["gradient_bytes"] == 4 * report["parameters"] and report["batch"] == 8
    assert report["bucket_mb"] == [1.0, 25.0] and report["zero_bucket_mb"] == 4
    rounds = report["rounds_ms"]
    assert list(rounds) == ROWS
    assert all(len(times) == 2 and all(t > 0 for t in times) for times in rounds.values()), rounds
    assert all(report["step_ms"][row] == benchtools.spread(times) for row, times in rounds.items())
    figures = report["by_hand_over_torch"]
    assert [(f["by_hand"], f["torch"], f["limit"]) for f in figures] == bench_by_hand.comparisons([1.0, 25.0])
    for figure in figures:  # within each round, then spread: never a ratio of two medians
        expected = benchtools.per_round(bench_by_hand.ratio, rounds[figure["by_hand"]], rounds[figure["torch"]])
        assert figure["ratio"] == pytest.approx(expected)


def test_every_row_trains_the_same_model(run):
    """The same weights, data and steps in every row: after the warm-up the weights agree with torch DDP's,
    bit for bit in practice at 2 ranks (sums of two numbers do not depend on their order)."""
    report, _, _ = run
    assert list(report["weights_apart"]) == ROWS
    assert max(report["weights_apart"].values()) <= 1e-6, report["weights_apart"]


def test_the_collectives_of_each_row(run):
    """Counted from the profiler, one step per row. DDP by hand all-reduces each of its buckets once, and cuts
    them as torch's DDP does: a bucket closes once it reaches the cap, the parameter that crosses it included.
    ZeroRedundancyOptimizer broadcasts each parameter from the rank that owns it."""
    report, _, _ = run
    calls = report["collectives_per_step"]
    assert list(calls) == ROWS
    assert report["trace_buckets"] >= 3  # the traced DDP is DDP by hand at 1 MiB: several buckets
    # By hand also broadcasts rank 0's bucket order once a step (a few bytes), so that every rank cuts the same.
    assert calls["torch DDP@1"] == {"all_reduce": report["trace_buckets"]} and report["trace_buckets"] == 3
    assert calls["DDP by hand@1"] == {"all_reduce": 3, "broadcast": 1}
    assert calls["torch DDP@25"] == {"all_reduce": 1}  # 8.5 MB: one bucket
    assert calls["DDP by hand@25"] == {"all_reduce": 1, "broadcast": 1}
    # The ZeRO rows at 4 MiB: 3 buckets; stage 1 and 2 all-gather every slice in one call per step.
    assert calls["ZeroRedundancyOptimizer"] == {"all_reduce": 3, "broadcast": 8}
    assert calls["ZeRO-1 by hand"] == {"all_reduce": 3, "broadcast": 1, "all_gather": 1}
    assert calls["ZeRO-2 by hand"] == {"all_reduce": 3, "all_gather": 1}
    for row in ("ZeRO-3 by hand", "FSDP2"):  # gloo's reduce-scatter: an all_reduce
        assert set(calls[row]) == {"all_reduce", "all_gather"}, (row, calls[row])


def test_the_table_prints_each_comparison_with_its_target(run, capsys):
    report, _, _ = run
    bench_by_hand.print_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"# bench_by_hand.py: gloo, {RANKS} ranks") and "2,121,729 parameters" in lines[0]
    assert lines[1] == f"# {report['machine']}"
    assert "by hand / torch" in lines[4] and "target" in lines[4]
    rows = lines[5:-1]
    assert len(rows) == len(report["by_hand_over_torch"])
    for line, figure in zip(rows, report["by_hand_over_torch"], strict=True):
        r = figure["ratio"]
        assert line.startswith(f"  {bench_by_hand.label(figure['by_hand'])} ")
        assert f"{report['step_ms'][figure['by_hand']]['median']:.2f}" in line
        assert f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]" in line
        if figure["limit"] is None:
            assert "≤" not in line
        else:
            assert line.endswith(f"≤ {figure['limit']:.2f}: {'met' if r['median'] <= figure['limit'] else 'MISSED'}")
    assert lines[-1].startswith("# every row trains the same model")


def test_trace_shows_the_hand_written_all_reduces_running_during_backward(run):
    """Each of the traced steps all-reduces every bucket once (gloo's own spans, on its thread: the benchmark
    adds no span of its own around the launch), and on every rank some step's first all-reduce starts before
    that step's backward has ended. Not every step: on 2 busy cores gloo's thread may start late."""
    report, traces, _ = run
    for rank in range(RANKS):
        with open(traces / f"rank{rank}.json") as f:
            lanes = benchtools.trace_lanes(json.load(f))
        assert len(lanes["forward"]) == len(lanes["optimizer"]) == bench_by_hand.TRACE_STEPS
        assert len(lanes["all-reduce"]) == bench_by_hand.TRACE_STEPS * report["trace_buckets"]
        step_ends = [start for start, _ in lanes["optimizer"]]
        overlapped = []
        for before, end in zip([0.0, *step_ends], step_ends, strict=False):
            backward_end = max(t for s, t in lanes["backward"] if before <= s < end)
            starts = [s for s, _ in lanes["all-reduce"] if before <= s < end]
            assert len(starts) == report["trace_buckets"], (rank, before, end)
            overlapped.append(min(starts) < backward_end)
        assert any(overlapped), (rank, overlapped)


def test_rank_0_draws_its_trace_or_says_how_to_install_matplotlib(run):
    _, traces, stderr = run
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "rank0.png not drawn: pip install -r requirements-plot.txt" in stderr
    else:
        assert (traces / "rank0.png").read_bytes()[:8] == PNG
    assert not (traces / "rank1.png").exists()


def main_fails(monkeypatch, capsys, *argv: str) -> str:
    """bench_by_hand.main() in this process, as torchrun would start rank 0 of 2: it must stop with status 2
    before any process group exists. Returns what it wrote on stderr."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["bench_by_hand.py", *argv])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            bench_by_hand.main()
    finally:
        torch.set_num_threads(threads)  # main() gave this process its share of the cores
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_what_cannot_work_is_one_line_before_anything_is_measured(monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    err = main_fails(monkeypatch, capsys, "--trace", str(tmp_path / "file" / "traces"))
    assert err == f"error: --trace {tmp_path}/file/traces: cannot create the folder: Not a directory\n"
    err = main_fails(monkeypatch, capsys, "--batch-size", str(2**20))
    assert err.startswith(f"error: batches of {2**20} samples on 2 process(es) need ") and err.count("\n") == 1
    err = main_fails(monkeypatch, capsys, "--warmup", "1")  # argparse's usage, then its one error line
    assert err.splitlines()[-1].endswith("--warmup must be 2 or more: the DDPs rebuild their buckets after the first "
                                         "step")
    err = main_fails(monkeypatch, capsys, "--bucket-mb", "0")
    assert err.splitlines()[-1].endswith("argument --bucket-mb: must be from 0.001 to 1024, got 0")
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(sys, "argv", ["bench_by_hand.py"])
    with pytest.raises(SystemExit):
        bench_by_hand.main()
    err = capsys.readouterr().err
    assert err.startswith("error: RANK=None, LOCAL_RANK='0', WORLD_SIZE='2', LOCAL_WORLD_SIZE='2': start this "
                          "script with torchrun") and err.count("\n") == 1
    for name in ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):  # no launcher at all: plain python
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit):
        bench_by_hand.main()
    assert capsys.readouterr().err == "error: start this script with torchrun, e.g. torchrun --standalone " \
                                      "--nproc-per-node 2 bench_by_hand.py\n"
