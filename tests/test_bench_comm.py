"""bench_comm.py: the bandwidth arithmetic of nccl-tests, and a run at tiny sizes. No speed is asserted here:
speed is what the benchmark prints, never a test's assertion."""
import argparse
import json
import sys

import pytest
from harness import Launch, torchrun_in_process
from launch import REPO

sys.path.insert(0, str(REPO))  # the scripts live at the repository root
import bench_comm  # noqa: E402
import benchtools  # noqa: E402


def test_bus_factors_are_those_of_nccl_tests():
    assert bench_comm.bus_factor("all_reduce", 4) == 1.5  # 2(n-1)/n
    assert bench_comm.bus_factor("ring_all_reduce", 4) == 1.5
    assert bench_comm.bus_factor("all_gather", 4) == 0.75  # (n-1)/n
    assert bench_comm.bus_factor("reduce_scatter", 4) == 0.75
    assert bench_comm.bus_factor("all_to_all", 4) == 0.75
    assert bench_comm.bus_factor("broadcast", 4) == 1.0
    assert bench_comm.bus_factor("all_reduce", 8) == 1.75
    assert bench_comm.bus_factor("all_gather", 2) == 0.5
    for op in bench_comm.OPERATIONS:  # one rank moves nothing over a link
        assert bench_comm.bus_factor(op, 1) == (1.0 if op == "broadcast" else 0.0)
    with pytest.raises(ValueError):
        bench_comm.bus_factor("gather", 4)


def test_bandwidths_are_gigabytes_of_1e9_per_second():
    algbw, busbw = bench_comm.bandwidths("all_reduce", 2 * 10**9, 2.0, 4)
    assert algbw == 1.0 and busbw == 1.5
    algbw, busbw = bench_comm.bandwidths("all_gather", 64 * 2**20, 0.05, 3)
    assert algbw == pytest.approx(1.34217728) and busbw == pytest.approx(1.34217728 * 2 / 3)


def test_sizes_counts_and_size_arguments():
    assert bench_comm.sizes(1000, 5000) == [1024, 2048, 4096]
    assert bench_comm.sizes(1024, 1024) == [1024]
    assert bench_comm.element_count("all_reduce", 1024, 4, 3) == 256
    assert bench_comm.element_count("broadcast", 1024, 4, 3) == 256
    for op in ("all_gather", "reduce_scatter", "all_to_all"):  # a multiple of the world size, rounded down
        assert bench_comm.element_count(op, 1024, 4, 3) == 255
        assert bench_comm.element_count(op, 1024, 2, 4) == 512
    assert bench_comm.size_in_bytes("4096") == 4096
    assert bench_comm.size_in_bytes("64K") == 65536
    assert bench_comm.size_in_bytes("16M") == bench_comm.size_in_bytes("16MiB") == 16 * 2**20
    assert bench_comm.size_in_bytes("1g") == 2**30
    for bad in ("", "M", "1.5M", "-4K", "0", "12Q"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_comm.size_in_bytes(bad)


def rank_0(result: Launch) -> str:
    """Rank 0's stdout (it alone prints the table) of a run in which every rank succeeded."""
    assert result.codes == [0] * len(result.codes), result.stderr
    return result.stdouts[0]


def test_json_run_at_tiny_sizes_is_consistent():
    stdout = rank_0(torchrun_in_process(3, "bench_comm.py", "--min-bytes", "1K", "--max-bytes", "4K", "--warmup",
                                        "1", "--iters", "2", "--rounds", "2", "--json", timeout=120))
    report = json.loads(stdout)
    assert report["world_size"] == 3 and report["backend"] == "gloo" and "torch 2." in report["machine"]
    rows = report["rows"]
    assert [row["operation"] for row in rows] == list(bench_comm.OPERATIONS) * 3
    by_op = {}
    for row in rows:
        by_op.setdefault(row["operation"], []).append(row)
        assert row["wrong"] == 0, row
        assert row["bytes"] == row["count"] * 4
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * bench_comm.bus_factor(row["operation"], 3))
    assert [row["bytes"] for row in by_op["all_reduce"]] == [1024, 2048, 4096]
    assert [row["bytes"] for row in by_op["all_gather"]] == [1020, 2040, 4092]
    for ring, reference in zip(by_op["ring_all_reduce"], by_op["all_reduce"], strict=True):
        assert ring["vs_all_reduce"] == pytest.approx(ring["busbw_GBps"] / reference["busbw_GBps"])


def test_table_describes_the_machine_and_has_a_row_per_operation():
    stdout = rank_0(torchrun_in_process(1, "bench_comm.py", "--max-bytes", "1K", "--warmup", "0", "--iters", "1",
                                        "--rounds", "1", timeout=60))
    lines = stdout.splitlines()
    assert lines[0].startswith("# bench_comm.py: gloo, 1 ranks, float32")
    assert "cores, torch 2." in lines[1]
    assert "busbw (GB/s)" in lines[2] and "vs all_reduce" in lines[2]
    assert [line.split()[2] for line in lines[3:]] == list(bench_comm.OPERATIONS)


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "0"], "argument --timeout: must be from 1 to 1e+07, got 0"),
    (["--iters", "0"], "argument --iters: must be from 1 to 10000, got 0"),
    (["--max-bytes", "4096G"], "--max-bytes 4398046511104 for 6 operations on 1 process need 79,164,837,199,872 "
                               "bytes of memory and this machine has "),
    (["--min-bytes", "2", "--max-bytes", "1K"], "--min-bytes must hold at least one float32 per rank: 4 bytes"),
])
def test_what_cannot_work_is_one_line_before_any_process_group(argv, message, monkeypatch, capsys):
    for name, value in TORCHRUN_ENV.items():  # as torchrun would start rank 0 of 1
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["bench_comm.py", "--backend", "gloo", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_comm.main()
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]  # argparse adds its usage
    assert len(errors) == 1 and message in errors[0], errors


def test_started_without_torchrun_or_with_part_of_its_variables_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_comm.py"])
    with pytest.raises(SystemExit) as exit_info:
        bench_comm.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: start this script with torchrun, e.g. torchrun --standalone "
                                       "--nproc-per-node 4 bench_comm.py\n")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(SystemExit):
        bench_comm.main()
    assert capsys.readouterr().err == ("error: RANK='0', LOCAL_RANK=None, WORLD_SIZE='two', LOCAL_WORLD_SIZE=None: "
                                       "start this script with torchrun, which sets them all\n")


def test_an_error_is_one_line_in_one_write(monkeypatch):
    """Two ranks' lines never run together: each is one write of the whole line."""
    writes = []
    monkeypatch.setattr(sys, "stderr", type("Recorder", (), {"write": writes.append, "flush": lambda self: None})())
    with pytest.raises(SystemExit):
        benchtools.die("a line")
    assert writes == ["error: a line\n"]
