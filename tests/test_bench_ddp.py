"""bench_ddp.py: the arithmetic of its figures on known inputs, one run at tiny sizes whose JSON holds
every figure, recomputable from the rounds' times, and its trace. No speed is asserted: speed is what
the benchmark prints, never a test's assertion."""
import json
import sys

import pytest
import torch
from harness import spawn, torchrun_in_process
from launch import REPO

sys.path.insert(0, str(REPO))  # the scripts live at the repository root
import bench_ddp  # noqa: E402
import benchtools  # noqa: E402

RANKS = 2
BATCH_SIZES = [8, 32]
TINY = ["--batch-sizes", *map(str, BATCH_SIZES), "--warmup", "2", "--steps", "2", "--rounds", "2"]
PNG = b"\x89PNG\r\n\x1a\n"


def test_spread_and_per_round():
    assert bench_ddp.spread([3.0, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    # A ratio is taken within each round, not between medians: rounds (2, 1), (4, 4), (9, 3).
    assert bench_ddp.per_round(lambda a, b: a / b, [2.0, 4.0, 9.0], [1.0, 4.0, 3.0]) == {
        "min": 1.0, "median": 2.0, "max": 3.0}
    with pytest.raises(ValueError):  # rounds that do not pair up are a bug, never a silent zip
        bench_ddp.per_round(lambda a, b: a / b, [1.0, 2.0], [1.0])


def test_overhead_and_efficiency():
    assert bench_ddp.overhead(plain=97.0, ddp=100.0) == pytest.approx(0.03)
    assert bench_ddp.efficiency(one_rank=90.0, n_ranks=100.0) == pytest.approx(0.9)


def all_reduces_per_step(rank: int, world_size: int) -> list[int]:
    """How many buckets bench_ddp.train_step all-reduces in each of 4 steps: 2 with all_reduce=True, then
    2 without (the compute row), counted by a communication hook that then all-reduces as DDP's default."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from data import FEATURES
    from model import build_model

    model = DDP(build_model(bench_ddp.MODEL))
    optimizer = torch.optim.Adam(model.parameters())
    buckets = []

    def count_and_all_reduce(process_group, bucket):
        buckets.append(bucket.index())
        return allreduce_hook(process_group, bucket)

    model.register_comm_hook(None, count_and_all_reduce)
    counts = []
    for all_reduce in (True, True, False, False):
        buckets.clear()
        bench_ddp.train_step(model, optimizer, torch.randn(8, FEATURES), torch.randn(8, 1), all_reduce=all_reduce)
        counts.append(len(buckets))
    return counts


def test_the_compute_row_skips_the_all_reduce_and_the_others_do_not():
    results, _ = spawn(all_reduces_per_step, RANKS, timeout=60)
    for counts in results:
        assert counts[0] >= 1 and counts[1] >= 1, counts  # every bucket all-reduced
        assert counts[2:] == [0, 0], counts  # under no_sync(): none


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, object, str]:
    """One run at tiny sizes with a trace: (the JSON report, the trace folder, rank 0's stderr)."""
    traces = tmp_path_factory.mktemp("traces")
    result = torchrun_in_process(RANKS, "bench_ddp.py", "--backend", "gloo", *TINY, "--json", "--trace", str(traces),
                                 timeout=150)
    assert result.codes == [0] * RANKS, result.stderr
    assert result.stdouts[1] == ""  # every rank holds the report, and rank 0 alone prints it
    return json.loads(result.stdouts[0]), traces, result.stderrs[0]


def test_every_figure_is_there_and_recomputes_from_the_rounds(run):
    report, _, _ = run
    assert report["world_size"] == RANKS and report["backend"] == "gloo" and "torch 2." in report["machine"]
    assert report["model"] == "wide" and report["parameters"] == 2_121_729
    assert report["gradient_bytes"] == 4 * report["parameters"]
    rounds = report["rounds_ms"]
    assert sorted(rounds) == sorted(f"{name}@{b}" for name in bench_ddp.ROWS for b in BATCH_SIZES)
    assert all(len(times) == 2 and all(t > 0 for t in times) for times in rounds.values()), rounds
    assert all(report["step_ms"][key] == bench_ddp.spread(times) for key, times in rounds.items())

    def recomputed(fn, *names: str, b: int) -> dict:
        return bench_ddp.per_round(fn, *(rounds[f"{name}@{b}"] for name in names))

    assert [row["batch"] for row in report["scaling"]] == BATCH_SIZES
    for row in report["scaling"]:
        b = row["batch"]
        assert row["overhead"] == pytest.approx(recomputed(bench_ddp.overhead, "plain", "one rank", b=b))
        assert row["efficiency"] == pytest.approx(recomputed(bench_ddp.efficiency, "one rank", "all ranks", b=b))
        assert row["contention"] == pytest.approx(recomputed(bench_ddp.efficiency, "one rank", "compute", b=b))
        assert row["communication"] == pytest.approx(recomputed(bench_ddp.efficiency, "compute", "all ranks", b=b))
        assert row["samples_per_s"] == pytest.approx(recomputed(lambda t, b=b: RANKS * b / t * 1e3, "all ranks", b=b))
        for one, alone, every in zip(rounds[f"one rank@{b}"], rounds[f"compute@{b}"], rounds[f"all ranks@{b}"],
                                     strict=True):  # efficiency = contention × communication, round by round
            assert bench_ddp.efficiency(one, every) == pytest.approx(
                bench_ddp.efficiency(one, alone) * bench_ddp.efficiency(alone, every))


def test_the_table_prints_a_row_per_batch_size_with_its_figures(run, capsys):
    report, _, _ = run
    bench_ddp.print_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"# bench_ddp.py: gloo, {RANKS} ranks") and "2,121,729 parameters" in lines[0]
    assert lines[1] == f"# {report['machine']}"
    assert "overhead" in lines[3] and "efficiency" in lines[3] and "communication" in lines[3]
    for line, row in zip(lines[4:], report["scaling"], strict=True):
        words = line.split()
        step = report["step_ms"][f"plain@{row['batch']}"]["median"]
        assert words[:2] == [str(row["batch"]), f"{step:.2f}"]
        efficiency = row["efficiency"]
        assert f"{efficiency['median']:.3f} [{efficiency['min']:.3f}, {efficiency['max']:.3f}]" in line
        assert words[-1] == f"{row['communication']['median']:.3f}"


def test_trace_shows_all_reduces_running_during_backward(run):
    _, traces, _ = run
    for rank in range(RANKS):
        with open(traces / f"rank{rank}.json") as f:
            lanes = benchtools.trace_lanes(json.load(f))
        assert len(lanes["optimizer"]) == bench_ddp.TRACE_STEPS
        assert len(lanes["forward"]) == bench_ddp.TRACE_STEPS
        # Every step all-reduces, and on every rank some step's first bucket starts its all-reduce
        # before that step's backward has ended. Not every step: the span is gloo's thread's own, and
        # on 2 busy cores that thread can start a few microseconds after a short backward's tail; with
        # no overlap, no step would show it.
        step_ends = [start for start, _ in lanes["optimizer"]]
        overlapped = []
        for before, end in zip([0.0, *step_ends], step_ends, strict=False):
            backward_end = max(t for s, t in lanes["backward"] if before <= s < end)
            starts = [s for s, _ in lanes["all-reduce"] if before <= s < end]
            assert starts, (rank, before, end)
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
    """bench_ddp.main() in this process, as torchrun would start rank 0 of 2: it must stop with status 2
    before any process group exists. Returns what it wrote on stderr."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py", "--backend", "gloo", *argv])
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as exit_info:
            bench_ddp.main()
    finally:
        torch.set_num_threads(threads)  # main() gave this process its share of the cores
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_what_cannot_work_is_one_line_before_anything_is_measured(monkeypatch, capsys, tmp_path):
    (tmp_path / "file").write_text("")
    err = main_fails(monkeypatch, capsys, "--trace", str(tmp_path / "file" / "traces"))
    assert err == f"error: --trace {tmp_path}/file/traces: cannot create the folder: Not a directory\n"
    err = main_fails(monkeypatch, capsys, "--batch-sizes", "8", str(2**24))
    assert err.startswith(f"error: batches of up to {2**24} samples on 2 process(es) need ") and err.count("\n") == 1
    err = main_fails(monkeypatch, capsys, "--warmup", "1")  # argparse's usage, then its one error line
    assert err.splitlines()[-1].endswith("--warmup must be 2 or more: DDP rebuilds its buckets in the second step")
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(sys, "argv", ["bench_ddp.py"])
    with pytest.raises(SystemExit):
        bench_ddp.main()
    err = capsys.readouterr().err
    assert err.startswith("error: RANK=None, LOCAL_RANK='0', WORLD_SIZE='2', LOCAL_WORLD_SIZE='2': start this "
                          "script with torchrun") and err.count("\n") == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_with_nccl():
    result = torchrun_in_process(1, "bench_ddp.py", "--backend", "nccl", *TINY, "--json", timeout=150)
    assert result.codes == [0], result.stderr
    report = json.loads(result.stdouts[0])
    assert report["backend"] == "nccl" and report["world_size"] == 1 and "cores, torch 2." in report["machine"]
    assert [row["batch"] for row in report["scaling"]] == BATCH_SIZES
