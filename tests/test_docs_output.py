"""Every console block in the README and docs/ comes from a command shown with it, and still
prints what it shows: the deterministic ones are rerun and compared (tests/docs_blocks.py says
what the comparison ignores); one machine's figures say which machine, and when."""
import datetime
import re
import sys
from pathlib import Path

import pytest
import torch
from docs_blocks import PAGES, Block, Command, Output, blocks, check_block, check_output, mismatch
from launch import REPO

BLOCKS = blocks()

# Blocks that another test reruns and compares, because it runs the same commands anyway: the
# quick-start test, which runs in the repository's own .venv (as CI does) and is skipped elsewhere.
ELSEWHERE = {
    "torchrun --standalone --nproc-per-node 8 singlenode_cpu.py":
        "tests/test_readme.py::test_quick_start_trains_within_ten_percent_of_the_floor",
} if Path(sys.prefix) == REPO / ".venv" else {}


def test_every_block_starts_with_its_command_and_is_rerun_or_dated():
    for block in BLOCKS:
        assert block.commands[0].line, f"{block.name}: a console block must start with `$ command`"
        if block.machine:
            datetime.date.fromisoformat(block.machine.rsplit("; ", 1)[1])  # a real date
    fences = sum(len(re.findall(r"^[ \t]*```[ \t]*console", page.read_text(), re.MULTILINE)) for page in PAGES)
    assert fences == len(BLOCKS), "a console block that the parser missed (no closing fence?)"
    assert any(block.machine for block in BLOCKS) and any(not block.machine for block in BLOCKS)
    shown = {command.line for block in BLOCKS for command in block.commands}
    assert set(ELSEWHERE) <= shown, f"no block runs {set(ELSEWHERE) - shown}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.machine and b.commands[0].line not in ELSEWHERE],
                         ids=lambda b: b.name)
def test_the_block_is_what_its_commands_print(block: Block):
    if "singlenode_gpu.py" in block.commands[0].line and torch.cuda.is_available():
        pytest.skip("shows the error of a machine without CUDA")
    check_block(block)


def test_the_comparison_fails_on_a_changed_number_and_ignores_what_varies_by_nature():
    streams = [["[rank 0/2] joined at localhost:40001 in 0.31 s", "epoch 0 | loss:0.5", "done"],
               ["[rank 1/2] joined at localhost:40001 in 0.30 s", "removed /tmp/tmpab12/ckpt.pt.tmp, left"]]
    shown = ("[rank 1/2] joined at localhost:51515 in 2.50 s", "[rank 0/2] joined at localhost:51515 in 1.0 s",
             "removed /tmp/job/ckpt.pt.tmp, left", "epoch 0 | loss:0.5", "done")
    assert mismatch(shown, streams) is None
    assert mismatch(("...", "done"), streams) is None
    assert mismatch(("[rank 0/2] joined ...", "...", "epoch 0 | ..."), streams) == "(the end: the run printed more)"
    assert mismatch(shown[:3] + ("epoch 0 | loss:0.6", "done"), streams).startswith("epoch 0 | loss:0.6")
    assert mismatch(("epoch 0 | loss:0.5", "..."), streams).startswith("epoch 0 | loss:0.5")  # rank 0 joined first
    assert mismatch(shown[:2] + ("removed /tmp/job/ckpt.pt, left",) + shown[3:], streams)  # a file name counts
    assert mismatch(("[rank 1/2] joined at 127.0.0.1:1 in 2.50 s",) + shown[1:], streams)  # so does the host
    # what a script echoes, as a timeout of 1 s, is not a measured time
    assert mismatch(("timeout 30 s",), [["timeout 1 s"]]) and mismatch(("in 30000ms",), [["in 1000ms"]])


def test_the_comparison_keeps_few_states_with_many_processes_and_long_outputs():
    streams = [[f"[rank {r}/8] line {i}" for i in range(9)] for r in range(8)]
    shown = tuple(s[0] for s in streams) + ("...",) + tuple(s[-1] for s in streams[:-1]) + ("[rank 7/8] wrong",)
    # The old search over every combination of positions took minutes and gigabytes here, or
    # overflowed the C stack on a long skip. This one keeps few states: it reaches the wrong line
    # itself, not its cap on states (MAX_STATES, whose message says "too many ways").
    assert mismatch(shown, streams) == "[rank 7/8] wrong   (no process printed this line next; or a line before " \
                                       "it is missing)"
    assert mismatch(("...", "line 99999"), [[f"line {i}" for i in range(100_000)]]) is None


def test_an_exit_status_that_the_block_does_not_show_fails():
    ok, failed = Command("x", ("done",)), Command("x", ("error: it broke",))
    check_output(ok, Output((0, 0), (("done",), ()), REPO), "here")
    check_output(failed, Output((1, 2), (("error: it broke",), ()), REPO), "here")
    for command, codes in ((ok, (0, 3)), (ok, (0, None)), (failed, (0, 0)), (failed, (1, None))):
        with pytest.raises(AssertionError, match="exit"):
            check_output(command, Output(codes, (tuple(command.output), ()), REPO), "here")
