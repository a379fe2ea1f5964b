"""comm_intro.py, run as documented at 1 to 4 processes (each rank's main() in the harness, see
docs_blocks.run_command): every rank receives exactly the numbers worked out here. A message, group or
rendezvous that delivered anything else would print other numbers, and the test would fail."""
import contextlib
import io
import sys

import pytest
from docs_blocks import succeeded

import comm_intro


def numbers(values) -> str:
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_receives_what_it_should(world_size):
    stdout = succeeded(f"torchrun --standalone --nproc-per-node {world_size} comm_intro.py")
    assert "MISMATCH" not in stdout
    lines = set(stdout.splitlines())
    n = world_size

    def said(rank: int, text: str) -> None:
        assert f"[rank {rank}/{n}] {text}" in lines, f"rank {rank} did not print: {text}\n{stdout}"

    for rank in range(n):
        said(rank, f"all_reduce SUM: before [{rank + 1}], after: {numbers([n * (n + 1) / 2])}  ok")
        said(rank, f"all_reduce AVG: before [{rank + 1}], after: {numbers([(n + 1) / 2])}  ok")
        evens = list(range(0, n, 2))
        if rank % 2 == 0:
            said(rank, f"all_reduce in new_group {evens} (rank {rank // 2} there): {numbers([sum(evens)])}  ok")
        else:
            said(rank, f"new_group {evens}: not a member, so it takes no part in the group's all_reduce")
        rendezvous = [line for line in lines if line.startswith(f"[rank {rank}/{n}] init_method=")]
        assert len(rendezvous) == 2, rendezvous
        assert "init_method=tcp://" in rendezvous[0] + rendezvous[1]
        assert "init_method=file://" in rendezvous[0] + rendezvous[1]
        assert all(line.endswith(f"all_reduce of ones: {numbers([n])}  ok") for line in rendezvous)
    if n == 1:
        said(0, "send/recv, isend/irecv and the ring need a second rank: skipped")
    for dst in range(1, n):
        said(0, f"send to rank {dst}: {numbers([100 + dst] * 3)}")
        said(dst, f"recv from rank 0: {numbers([100 + dst] * 3)}  ok")
        said(dst, f"isend to rank 0: {numbers([dst, dst * dst])}")
        said(0, f"irecv from rank {dst}: {numbers([dst, dst * dst])}  ok")
    for rank in range(n if n > 1 else 0):
        prev_rank, next_rank = (rank - 1) % n, (rank + 1) % n
        said(rank, f"ring: sent {numbers([rank] * 2)} to rank {next_rank}, got from rank {prev_rank}: "
                   f"{numbers([prev_rank] * 2)}  ok")
    assert stdout.splitlines().count(f"all results match on {n} ranks") == 1  # rank 0 says it, once


def test_a_learners_mistakes_are_one_line(monkeypatch):
    """Started without torchrun, or with an option it does not have: one line (SystemExit's text is what
    Python prints, with status 1; argparse prints its usage, then the error, with status 2)."""
    def run_main(*argv: str) -> tuple[int | str, str]:
        monkeypatch.setattr(sys, "argv", ["comm_intro.py", *argv])
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as stopped:
            comm_intro.main()
        return stopped.value.code, stderr.getvalue()

    monkeypatch.delenv("RANK", raising=False)
    assert run_main() == (
        "error: start this script with torchrun --standalone --nproc-per-node 4 comm_intro.py", "")
    code, stderr = run_main("--backend", "nccl")  # the option it had before
    assert code == 2 and stderr.splitlines()[-1] == "comm_intro.py: error: unrecognized arguments: --backend nccl"
