"""comm_collectives.py: run as documented at 1 to 4 processes (each rank's main() in the harness), every
rank's results are the numbers worked out here; and every check is a real comparison, which prints
MISMATCH when the collective behind it is broken."""
import contextlib
import functools
import io
import math
import operator
import re
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from docs_blocks import succeeded
from harness import spawn

import comm_collectives

LINE = re.compile(r"\[rank (\d+)/(\d+)\] (.*)")
REDUCTIONS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def numbers(values) -> str:
    """A list as the script prints it: 3.0 as 3."""
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"


def rows(lists) -> str:
    """A list of lists (or of one-element tensors) as the script prints it."""
    return "[" + ", ".join(numbers(values) for values in lists) + "]"


def parse(stdout: str, world_size: int) -> dict[str, dict[int, str]]:
    """{operation: {rank: what that rank printed after the name}}, asserting one line per rank and operation."""
    by_name: dict[str, dict[int, str]] = {}
    for line in stdout.splitlines():
        match = LINE.fullmatch(line)
        if not match:
            continue
        rank, size, rest = int(match[1]), int(match[2]), match[3]
        assert size == world_size, line
        name, text = rest[: comm_collectives.NAME_WIDTH].strip(), rest[comm_collectives.NAME_WIDTH + 1 :]
        assert rank not in by_name.setdefault(name, {}), f"two lines for {name} from rank {rank}"
        by_name[name][rank] = text
    for name, texts in by_name.items():
        assert sorted(texts) == list(range(world_size)), f"{name}: lines from ranks {sorted(texts)}"
    return by_name


def expected_after(world_size: int) -> dict[str, list[str]]:
    """What each rank must print after each operation, worked out here from what every rank starts with."""
    n = world_size
    ranks = range(n)
    start = [[r + 1, r + 2, r % 3 + 1, 2**r] for r in ranks]  # what the reductions start with
    column = list(zip(*start, strict=True))
    sums = [sum(c) for c in column]
    same = {
        "broadcast from rank 0": numbers([0, 1, 2]),
        "all_reduce SUM": numbers(sums),
        "all_reduce AVG": numbers([np.float32(s) / np.float32(n) for s in sums]),
        "all_reduce PRODUCT": numbers([math.prod(c) for c in column]),
        "all_reduce MIN": numbers([min(c) for c in column]),
        "all_reduce MAX": numbers([max(c) for c in column]),
        "all_reduce BAND": numbers([functools.reduce(operator.and_, c) for c in column]),
        "all_reduce BOR": numbers([functools.reduce(operator.or_, c) for c in column]),
        "all_reduce BXOR": numbers([functools.reduce(operator.xor, c) for c in column]),
        "all_reduce async_op=True": numbers(sums),
        "all_gather": rows([10 * r, 10 * r + 1] for r in ranks),
        "all_gather_single": numbers([10 * r + j for r in ranks for j in range(2)]),
        "ring_all_reduce (hand-written)": numbers([sum(10 * r + j for r in ranks) for j in range(7)]),
        "all_gather_object": str([{"rank": r, "square": r * r} for r in ranks]),
        "broadcast_object_list from 0": str(["from rank 0", {"rank": 0, "square": 0}]),
    }
    result = {name: [text] * n for name, text in same.items()}
    result[f"reduce SUM to rank {n - 1}"] = [None] * (n - 1) + [numbers(sums)]
    result["gather to rank 0"] = [same["all_gather"]] + [None] * (n - 1)
    result["gather_object to rank 0"] = [same["all_gather_object"]] + [None] * (n - 1)
    result["scatter from rank 0"] = [numbers([10 * i, 10 * i + 1]) for i in ranks]
    result["reduce_scatter SUM"] = [numbers([sum(10 * r + i for r in ranks)]) for i in ranks]
    result["reduce_scatter_single SUM"] = result["reduce_scatter SUM"]
    result["all_to_all"] = [rows([10 * r + i] for r in ranks) for i in ranks]
    result["all_to_all_single"] = [numbers([10 * r + i for r in ranks]) for i in ranks]
    result["scatter_object_list from 0"] = [str([f"for rank {i}"]) for i in ranks]
    return result


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_gives_every_rank_the_right_numbers(world_size):
    stdout = succeeded(f"torchrun --standalone --nproc-per-node {world_size} comm_collectives.py")
    assert "MISMATCH" not in stdout
    by_name = parse(stdout, world_size)
    for name, texts in expected_after(world_size).items():
        for rank, after in enumerate(texts):
            if after is not None:
                assert f"after {after}  ok" in by_name[name][rank], f"rank {rank}: {name}: {by_name[name][rank]}"
    # Every operation is there, on every rank; each line is a passed check, or a rank that holds no result.
    n = world_size
    names = {"broadcast from rank 0", f"reduce SUM to rank {n - 1}", "all_gather", "all_gather_single",
             "gather to rank 0", "scatter from rank 0", "reduce_scatter SUM", "reduce_scatter_single SUM",
             "all_to_all", "all_to_all_single", "barrier, rank 0 late", f"monitored_barrier, rank {n - 1} late",
             "broadcast_object_list from 0", "all_gather_object", "gather_object to rank 0",
             "scatter_object_list from 0", "all_reduce async_op=True", "ring_all_reduce (hand-written)",
             "by hand vs DDP, 3 steps", "replicas after 3 steps", *(f"all_reduce {op}" for op in REDUCTIONS)}
    assert set(by_name) == names
    no_result = {(f"reduce SUM to rank {n - 1}", rank): f"after: at rank {n - 1}" for rank in range(n - 1)}
    no_result |= {(name, rank): "after None" for name in ("gather to rank 0", "gather_object to rank 0")
                  for rank in range(1, n)}
    for name, texts in by_name.items():
        for rank, text in texts.items():
            assert text.endswith(no_result.get((name, rank), "  ok")), f"rank {rank}: {name}: {text}"
    assert stdout.splitlines().count(f"all results match on {world_size} ranks") == 1  # rank 0 says it, once


def test_a_learners_mistakes_are_one_line(monkeypatch):
    """Started without torchrun, or with an option it does not have: one line (SystemExit's text is what
    Python prints, with status 1; argparse prints its usage, then the error, with status 2)."""
    def run_main(*argv: str) -> tuple[int | str, str]:
        monkeypatch.setattr(sys, "argv", ["comm_collectives.py", *argv])
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as stopped:
            comm_collectives.main()
        return stopped.value.code, stderr.getvalue()

    monkeypatch.delenv("RANK", raising=False)
    assert run_main() == (
        "error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 4 comm_collectives.py", "")
    code, stderr = run_main("--timeout", "inf")  # the option it had before
    assert code == 2 and stderr.splitlines()[-1] == "comm_collectives.py: error: unrecognized arguments: --timeout inf"


def test_check_compares_values_shapes_and_kinds():
    right = np.array([1.0, 2.0], dtype=np.float32)
    assert comm_collectives.check(torch.tensor([1.0, 2.0]), right)
    assert not comm_collectives.check(torch.tensor([1.0, 2.5]), right)  # one value off
    assert not comm_collectives.check(torch.tensor([1.0, 2.0, 0.0]), right)  # longer
    assert not comm_collectives.check(torch.tensor([[1.0, 2.0]]), right)  # another shape
    assert not comm_collectives.check(torch.tensor([1, 2]), right)  # integers where floats were due
    assert not comm_collectives.check(torch.tensor([1.0, float("nan")]), np.array([1.0, np.nan], np.float32))
    assert comm_collectives.check([torch.tensor([1.0]), torch.tensor([2.0])], right.reshape(2, 1))
    assert not comm_collectives.check(torch.tensor([1.0, 2.0 + 1e-4]), right, tolerance=1e-6)
    assert comm_collectives.check(torch.tensor([1.0, 2.0 + 1e-7]), right, tolerance=1e-6)
    assert comm_collectives.check([{"rank": 0}], [{"rank": 0}])
    assert not comm_collectives.check([{"rank": 0}], [{"rank": 1}])


# Each torch.distributed function, broken so that its result is wrong; the demonstration that calls it; and
# the lines whose check must then print MISMATCH (on some rank), and no other.
BREAKS = [
    ("broadcast", "demo_broadcast_and_reduce", ["broadcast from rank 0"]),
    ("reduce", "demo_broadcast_and_reduce", ["reduce SUM to rank 2"]),
    ("all_reduce", "demo_all_reduce", [*(f"all_reduce {op}" for op in REDUCTIONS), "all_reduce async_op=True"]),
    ("all_gather", "demo_gathers", ["all_gather"]),
    ("all_gather_single", "demo_gathers", ["all_gather_single"]),
    ("gather", "demo_gathers", ["gather to rank 0"]),
    ("scatter", "demo_gathers", ["scatter from rank 0"]),
    ("reduce_scatter", "demo_reduce_scatter_and_all_to_all", ["reduce_scatter SUM"]),
    ("reduce_scatter_single", "demo_reduce_scatter_and_all_to_all", ["reduce_scatter_single SUM"]),
    ("all_to_all", "demo_reduce_scatter_and_all_to_all", ["all_to_all"]),
    ("all_to_all_single", "demo_reduce_scatter_and_all_to_all", ["all_to_all_single"]),
    ("barrier", "demo_barriers", ["barrier, rank 0 late"]),
    ("monitored_barrier", "demo_barriers", ["monitored_barrier, rank 2 late"]),
    ("broadcast_object_list", "demo_objects", ["broadcast_object_list from 0"]),
    ("all_gather_object", "demo_objects", ["all_gather_object"]),
    ("gather_object", "demo_objects", ["gather_object to rank 0"]),
    ("scatter_object_list", "demo_objects", ["scatter_object_list from 0"]),
    ("batch_isend_irecv", "demo_ring_all_reduce", ["ring_all_reduce (hand-written)"]),
    ("all_reduce", "demo_data_parallel", ["by hand vs DDP, 3 steps"]),
    ("all_gather", "demo_data_parallel", ["replicas after 3 steps"]),
]


def spoil(value: object) -> None:
    """Make an operation's output wrong in place, as a broken collective would: tensors + 1, objects replaced."""
    if isinstance(value, torch.Tensor):
        value.add_(1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, torch.Tensor):
                item.add_(1)
            elif item is not None:
                value[i] = "spoiled"


def broken(name: str, original):
    if name in ("barrier", "monitored_barrier"):
        return lambda *args, **kwargs: None  # returns at once, waiting for nobody

    def wrong_result(*args, **kwargs):
        if name == "batch_isend_irecv":
            # Spoil what is sent: waiting here would not do, since a second wait() on a gloo send or receive
            # waits for the next message.
            for op in args[0]:
                if op.op is dist.isend:
                    spoil(op.tensor)
            return original(*args, **kwargs)
        work = original(*args, **kwargs)
        if work is not None:  # async_op=True: spoil the result, not the communication in flight
            work.wait()
        spoil(kwargs["gather_list"] if name == "gather" else args[1] if name == "gather_object" else args[0])
        return work

    return wrong_result


def run_broken_demos(rank: int, world_size: int) -> list[tuple[str, str, bool]]:
    """Every demonstration once as it is, then once per break, each run's lines after a line that names it;
    return (demo, break or '', passed on this rank) for each run."""
    results = []
    for demo in comm_collectives.DEMOS:
        print(f"--- {demo.__name__}", flush=True)
        results.append((demo.__name__, "", demo(rank, world_size)))
    for function_name, demo_name, _ in BREAKS:
        print(f"--- {demo_name} with {function_name} broken", flush=True)
        original = getattr(dist, function_name)
        setattr(dist, function_name, broken(function_name, original))
        try:
            passed = getattr(comm_collectives, demo_name)(rank, world_size)
        finally:
            setattr(dist, function_name, original)
        results.append((demo_name, function_name, passed))
        dist.barrier()  # the next run starts together
    return results


def test_every_check_prints_mismatch_when_its_collective_is_broken():
    assert {demo for _, demo, _ in BREAKS} == {demo.__name__ for demo in comm_collectives.DEMOS}
    results, stdouts = spawn(run_broken_demos, 3, timeout=120)
    runs = [re.split(r"^--- .*\n", stdout, flags=re.MULTILINE)[1:] for stdout in stdouts]  # by rank, then run
    demos = len(comm_collectives.DEMOS)
    as_it_is = parse("".join(rank_runs[k] for rank_runs in runs for k in range(demos)), 3)
    assert "MISMATCH" not in str(as_it_is)
    for row in zip(*results, strict=True):
        (demo, function_name, _), passed = row[0], [passed for *_, passed in row]
        assert not all(passed) if function_name else all(passed), (demo, function_name, passed)
    for k, (function_name, demo, names) in enumerate(BREAKS, start=demos):
        lines = parse("".join(rank_runs[k] for rank_runs in runs), 3)
        mismatched = {name for name, texts in lines.items() if any("MISMATCH" in text for text in texts.values())}
        assert mismatched == set(names), f"{demo} with {function_name} broken: MISMATCH in {mismatched}"
    assert {name for _, _, names in BREAKS for name in names} == set(as_it_is)  # every check is broken once
