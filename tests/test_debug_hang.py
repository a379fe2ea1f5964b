"""debug_hang.py: a collective behind a rank guard fails within --timeout on every rank instead of
hanging; monitored_barrier names the rank that did not arrive; TORCH_DISTRIBUTED_DEBUG=DETAIL names
both collectives at once; --fixed runs through. Every run ends, and leaves no process behind."""
import re
import sys

import pytest
from docs_blocks import documented, rerun
from harness import run_ranks

import debug_hang


def error_lines(stderr: str) -> list[re.Match]:
    """Each `error: [rank r/w] <collective> failed after <s> s: <message>` line, parsed. torch adds
    lines of its own (gloo's log, torchrun's report), which are not ours to test."""
    pattern = re.compile(r"^error: \[rank (\d+)/(\d+)\] (\w+) failed after (\d+\.\d) s: (.*)$")
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    matches = [pattern.match(line) for line in lines]
    assert lines and all(matches), stderr
    return matches


def check_where_each_rank_waits(matches: list[re.Match], stuck_rank: int) -> None:
    for match in matches:
        rank = int(match[1])
        assert match[3] == ("all_reduce" if rank == stuck_rank else "all_gather"), match[0]


def test_a_collective_behind_a_rank_guard_fails_after_the_timeout_instead_of_hanging():
    """Rank 0 waits in its all_reduce, rank 1 in the all_gather, and each gives up after --timeout
    (1 s). The rank whose wait ends first leaves, and a rank still waiting then sees the connection
    close instead. So, as the docs show it (each rank's main() in the harness): a line from each
    rank, about a second after the start, and the first rank to give up says that it timed out."""
    output, = rerun(documented("torchrun --standalone --nproc-per-node 2 debug_hang.py --timeout 1").line)
    assert output.codes == (1, 1)
    assert "2 ranks | rank 0 alone calls all_reduce | timeout 1 s | TORCH_DISTRIBUTED_DEBUG=OFF" in output.text
    matches = error_lines(output.text)
    check_where_each_rank_waits(matches, stuck_rank=0)
    timed_out = re.compile(r"\[\S+/gloo/transport/tcp/unbound_buffer\.cc:\d+\] Timed out waiting 1000ms for "
                           r"(recv|send) operation to complete")
    closed = re.compile(r"\[\S+/gloo/transport/tcp/pair\.cc:\d+\] (Connection closed by peer|Read error) .*")
    assert any(timed_out.fullmatch(match[5]) for match in matches), output.text  # the first to give up
    for match in matches:
        assert 0.5 <= float(match[4]) < 5, match[0]
        assert timed_out.fullmatch(match[5]) or closed.fullmatch(match[5]), match[0]


DETAIL = "TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 debug_hang.py"


def test_detail_reports_both_collectives_at_once():
    """The same bug with TORCH_DISTRIBUTED_DEBUG=DETAIL in the launch's environment, run whole as
    docs/past_the_basics.md shows it: no wait for the timeout (5 s), the report names rank 0's
    all_reduce and rank 1's all_gather."""
    output, = rerun(documented(DETAIL).line)  # shared with the docs test
    assert output.codes == (1,)
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in output.text
    matches = error_lines(output.text)
    check_where_each_rank_waits(matches, stuck_rank=0)
    ops = {0: "ALLREDUCE", 1: "ALLGATHER"}
    for match in matches:
        rank = int(match[1])
        assert float(match[4]) < 10, match[0]
        message = match[5]
        assert message.startswith(f"Detected mismatch between collectives on ranks. Rank {rank} is running "
                                  f"collective: CollectiveFingerPrint(SequenceNumber=0, OpType={ops[rank]}, "), message
        assert f"but Rank {1 - rank} is running collective: CollectiveFingerPrint(SequenceNumber=0, " \
               f"OpType={ops[1 - rank]}, " in message
        assert message.endswith(f"Op type: {ops[rank]}vs {ops[1 - rank]}"), message


def fixed_then_monitored(rank: int, world_size: int) -> None:
    """The fixed step, then the bug on the last rank with a monitored barrier (1 s), in one group."""
    for argv in (["--fixed"], ["--monitored_barrier", "--stuck_rank", str(world_size - 1), "--timeout", "1"]):
        sys.argv = ["debug_hang.py", *argv]
        debug_hang.step(debug_hang.parse_args(), rank, world_size)


def test_fixed_runs_through_and_monitored_barrier_names_the_rank_that_did_not_arrive():
    codes, _, stdouts, stderrs = run_ranks(fixed_then_monitored, 3, timeout=30)
    assert codes == [1, 1, 1]
    assert "3 ranks | every rank calls all_reduce | timeout 5 s" in stdouts[0]
    assert "mean loss over the ranks: 2\n" in stdouts[0]  # (1 + 2 + 3) / 3
    assert "3 ranks | rank 2 alone calls all_reduce | timeout 1 s" in stdouts[0]
    for rank in range(3):
        assert f"[rank {rank}/3] step done in" in stdouts[rank]
    (rank0,), (rank1,), (rank2,) = (error_lines(stderr) for stderr in stderrs)
    assert rank0[3] == "monitored_barrier" and 1.0 <= float(rank0[4]) < 5
    assert rank0[5] == "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1000 ms"
    assert rank1[3] == "monitored_barrier"
    assert rank1[5].startswith("Rank 1 successfully reached monitoredBarrier, but received errors while waiting "
                               "for send/recv from rank 0. Please check rank 0 logs for faulty rank.")
    assert rank2[3] == "all_reduce"  # still in the guarded call; it fails as the others leave


@pytest.mark.parametrize("env, argv, message", [
    ({}, [], "error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 debug_hang.py"),
    ({"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}, [],
     "error: a hang takes two ranks or more: torchrun --standalone --nproc-per-node 2 debug_hang.py"),
    ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, ["--stuck_rank", "2"],
     "error: --stuck_rank 2 names no rank: there are 2 (0 to 1)"),
])
def test_a_launch_that_cannot_show_the_hang_is_one_line(env, argv, message, monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    if env:
        env = {"RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["debug_hang.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        debug_hang.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == message + "\n"
