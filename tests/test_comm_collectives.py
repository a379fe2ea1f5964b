"""comm_collectives.py: run as documented at 1 to 4 processes (each rank's main() in the harness),
every rank's results are the right numbers; and every check is a real comparison, which fails when
the collective behind it is broken."""
import math
import re
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from docs_blocks import succeeded
from harness import spawn
from launch import REPO, python

sys.path.insert(0, str(REPO))  # the scripts live at the repository root
import comm_collectives  # noqa: E402

LINE = re.compile(r"\[rank (\d+)/(\d+)\] (.*)")


def numbers(values) -> str:
    """A list as the script prints it: 3.0 as 3."""
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"


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
        "all_reduce async_op=True": numbers(sums),
        "all_gather_single": numbers([10 * r + j for r in ranks for j in range(2)]),
        "ring_all_reduce (hand-written)": numbers([sum(10 * r + j for r in ranks) for j in range(7)]),
        "all_gather_object": str([{"rank": r, "square": r * r} for r in ranks]),
    }
    result = {name: [text] * n for name, text in same.items()}
    result[f"reduce SUM to rank {n - 1}"] = [None] * (n - 1) + [numbers(sums)]
    result["scatter from rank 0"] = [numbers([10 * i, 10 * i + 1]) for i in ranks]
    result["reduce_scatter_single SUM"] = [numbers([sum(10 * r + i for r in ranks)]) for i in ranks]
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
    # Every operation is there, on every rank, and each line is a passed check or says why it has no result.
    names = {"broadcast from rank 0", f"reduce SUM to rank {world_size - 1}", "all_gather", "all_gather_single",
             "gather to rank 0", "scatter from rank 0", "reduce_scatter SUM", "reduce_scatter_single SUM",
             "all_to_all", "all_to_all_single", "barrier, rank 0 late",
             f"monitored_barrier, rank {world_size - 1} late",
             "broadcast_object_list from 0", "all_gather_object", "gather_object to rank 0",
             "scatter_object_list from 0", "all_reduce async_op=True", "ring_all_reduce (hand-written)",
             "by hand vs DDP, 3 steps", "replicas after 3 steps", "all_reduce PREMUL_SUM"}
    names |= {f"all_reduce {op}" for op in comm_collectives.REDUCTIONS}
    assert set(by_name) == names
    for name, texts in by_name.items():
        for rank, text in texts.items():
            assert text.endswith("  ok") or "only rank" in text or "sent to rank" in text or "skipped" in text, (
                f"rank {rank}: {name}: {text}")
    assert stdout.splitlines().count(f"all results match on {world_size} ranks") == 1  # rank 0 says it, once


def test_plain_python_says_how_to_launch():
    result = python("comm_collectives.py")
    assert result.returncode == 2
    assert "torchrun --standalone --nproc-per-node 4 comm_collectives.py" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_nccl_without_a_gpu_is_one_clear_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    torchrun_env = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    result = python("comm_collectives.py", "--backend", "nccl", env=torchrun_env)
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --backend nccl needs CUDA GPUs and this machine has none: "
                                     "use --backend gloo")


def test_check_compares_values_shapes_and_kinds():
    right = np.array([1.0, 2.0], dtype=np.float32)
    assert comm_collectives.check(torch.tensor([1.0, 2.0]), right)
    assert not comm_collectives.check(torch.tensor([1.0, 2.5]), right)  # one value off
    assert not comm_collectives.check(torch.tensor([1.0, 2.0, 0.0]), right)  # longer
    assert not comm_collectives.check(torch.tensor([[1.0, 2.0]]), right)  # another shape
    assert not comm_collectives.check(torch.tensor([1, 2]), right)  # integers where floats were due
    assert comm_collectives.check([torch.tensor([1.0]), torch.tensor([2.0])], right.reshape(2, 1))
    assert not comm_collectives.check(torch.tensor([1.0, 2.0 + 1e-4]), right, tolerance=1e-6)
    assert comm_collectives.check(torch.tensor([1.0, 2.0 + 1e-7]), right, tolerance=1e-6)
    assert comm_collectives.check([{"rank": 0}], [{"rank": 0}])
    assert not comm_collectives.check([{"rank": 0}], [{"rank": 1}])


# Each demonstration, and a torch.distributed function that it uses, broken so that its result is wrong.
BREAKS = [
    ("demo_broadcast", "broadcast"), ("demo_reduce", "reduce"), ("demo_all_reduce", "all_reduce"),
    ("demo_all_gather", "all_gather"), ("demo_all_gather", "all_gather_single"), ("demo_gather", "gather"),
    ("demo_scatter", "scatter"), ("demo_reduce_scatter", "reduce_scatter"),
    ("demo_reduce_scatter", "reduce_scatter_single"), ("demo_all_to_all", "all_to_all"),
    ("demo_all_to_all", "all_to_all_single"), ("demo_barrier", "barrier"),
    ("demo_monitored_barrier", "monitored_barrier"), ("demo_objects", "broadcast_object_list"),
    ("demo_objects", "all_gather_object"), ("demo_objects", "gather_object"), ("demo_objects", "scatter_object_list"),
    ("demo_async", "all_reduce"), ("demo_ring_all_reduce", "batch_isend_irecv"),
    ("demo_data_parallel", "all_reduce"),
]


def spoil(value: object) -> None:
    """Make an operation's output wrong in place: tensors + 1, objects replaced."""
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
        for value in (*args, *kwargs.values()):
            spoil(value)
        return work

    return wrong_result


def run_broken_demos(rank: int, world_size: int) -> list[tuple[str, str, bool]]:
    """Every demonstration once as it is, then once per break; (demo, break or '', passed on this rank)."""
    device = torch.device("cpu")
    results = [(demo.__name__, "", demo(rank, world_size, device)) for demo in comm_collectives.DEMOS]
    for demo_name, function_name in BREAKS:
        original = getattr(dist, function_name)
        setattr(dist, function_name, broken(function_name, original))
        try:
            passed = getattr(comm_collectives, demo_name)(rank, world_size, device)
        finally:
            setattr(dist, function_name, original)
        results.append((demo_name, function_name, passed))
    dist.barrier()  # nobody tears down its connections while another rank still uses them
    return results


def test_every_check_fails_when_its_collective_is_broken():
    assert {name for name, _ in BREAKS} == {demo.__name__ for demo in comm_collectives.DEMOS}
    results, _ = spawn(run_broken_demos, 3, timeout=120)
    for row in zip(*results, strict=True):
        (demo, function_name, _), passed = row[0], [passed for *_, passed in row]
        if function_name:
            assert not all(passed), f"{demo} passed with {function_name} broken"
        else:
            assert all(passed), f"{demo} failed as it is, on ranks {[r for r, ok in enumerate(passed) if not ok]}"
