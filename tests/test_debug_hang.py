"""debug_hang.py: a barrier behind `if rank == 0:` fails within --timeout on every rank instead of hanging,
and each rank names the line it waited in; monitored_barrier names the ranks that never came; --fixed
trains what singlenode_cpu.py trains. Every run ends, and leaves no process behind."""
import re
import sys

import pytest
import torch
from docs_blocks import documented, rerun
from harness import spawn

import debug_hang
import singlenode_cpu

ARGV = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
ERROR = re.compile(r"^error: \[rank (\d+)/(\d+)\] (\w+): (.+?): (.*)$", re.MULTILINE)
TIMED_OUT = re.compile(r"\[\S+/gloo/transport/tcp/unbound_buffer\.cc:\d+\] Timed out waiting 2000ms for (recv|send) "
                       r"operation to complete")
# A rank whose peer gave up first and left may see the connection close before its own timeout.
CLOSED = re.compile(r"\[\S+/gloo/transport/tcp/pair\.cc:\d+\] (Connection closed by peer|Read error) .*")


def error_lines(line: str) -> dict[int, re.Match]:
    """Each rank's `error: [rank r/w] <function>: <line of debug_hang.py>: <message>` line, by rank."""
    output, = rerun(documented(line).line)  # the docs' run, shared with tests/test_docs_output.py
    matches = {int(match[1]): match for match in ERROR.finditer(output.text)}
    assert None not in output.codes and all(output.codes), output.text
    assert sorted(matches) == list(range(len(output.codes))), output.text  # one line from every rank
    return matches


def test_the_barrier_behind_the_rank_guard_fails_after_the_timeout_on_every_rank():
    """Rank 0 waits in the barrier, rank 1 in the next step's all-reduce (inside DDP's backward); each gives
    up after --timeout 2, and says where. The first to give up says it timed out."""
    matches = error_lines("torchrun --standalone --nproc-per-node 2 debug_hang.py --timeout 2")
    assert matches[0].group(3, 4) == ("barrier", "dist.barrier()")
    assert matches[1].group(3, 4) == ("train_one_epoch", "loss.backward()")
    assert any(TIMED_OUT.fullmatch(match[5]) for match in matches.values())
    assert all(TIMED_OUT.fullmatch(match[5]) or CLOSED.fullmatch(match[5]) for match in matches.values())


def test_monitored_barrier_names_the_ranks_that_never_came():
    matches = error_lines("torchrun --standalone --nproc-per-node 3 debug_hang.py --timeout 2 --monitored_barrier")
    assert matches[0][3] == "barrier" and matches[0][4].startswith("dist.monitored_barrier(")
    assert matches[0][5] == "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms"
    for rank in (1, 2):
        assert matches[rank].group(3, 4) == ("train_one_epoch", "loss.backward()")


def fixed_and_singlenode_cpu(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """--fixed with dist.barrier, then with monitored_barrier, then singlenode_cpu.py, in one process group."""
    runs = {"fixed": (debug_hang, ["--fixed"]), "fixed, monitored": (debug_hang, ["--fixed", "--monitored_barrier"]),
            "singlenode_cpu": (singlenode_cpu, [])}
    weights = {}
    for name, (module, extra) in runs.items():
        sys.argv = [f"{module.__name__}.py", *ARGV, *extra]
        weights[name] = [p.detach() for p in module.train(module.parse_args(), rank, world_size).parameters()]
    return weights


@pytest.mark.parametrize("world_size", [2, 3])
def test_fixed_runs_through_and_trains_what_singlenode_cpu_trains(world_size):
    """Bit for bit: a barrier on every rank changes no number."""
    results, stdouts = spawn(fixed_and_singlenode_cpu, world_size, timeout=90)
    for rank, weights in enumerate(results):
        for name in ("fixed", "fixed, monitored"):
            for a, b in zip(weights[name], weights["singlenode_cpu"], strict=True):
                assert torch.equal(a, b), (rank, name)
    assert stdouts[0].count("done | val_loss:") == 3
