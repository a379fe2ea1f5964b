"""Every console block in the README and docs/ comes from a command shown with it, and still
prints what it shows: the deterministic ones are rerun and compared (tests/docs_blocks.py says
what the comparison ignores); one machine's figures say which machine, and when."""
import pytest
import torch
from docs_blocks import Block, blocks, check_block, mismatch

BLOCKS = blocks()

# Blocks that another test reruns and compares, because it runs the same commands anyway.
ELSEWHERE = {
    "torchrun --standalone --nproc-per-node 8 singlenode_cpu.py":
        "tests/test_readme.py::test_quick_start_trains_within_ten_percent_of_the_floor",
}


def test_every_block_starts_with_its_command_and_is_rerun_or_dated():
    for block in BLOCKS:
        assert block.commands[0].line, f"{block.name}: a console block must start with `$ command`"
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
    streams = [["[rank 0/2] joined at 127.0.0.1:40001 in 0.31 s", "epoch 0 | loss:0.5", "done"],
               ["[rank 1/2] joined at 127.0.0.1:40001 in 0.30 s"]]
    shown = ("[rank 1/2] joined at localhost:51515 in 2.5 s", "[rank 0/2] joined at localhost:51515 in 1 s",
             "epoch 0 | loss:0.5", "done")
    assert mismatch(shown, streams) is None
    assert mismatch(("...", "done"), streams) is None
    assert mismatch(("[rank 0/2] joined ...", "...", "epoch 0 | ..."), streams) == "(the end: the run printed more)"
    assert mismatch(shown[:2] + ("epoch 0 | loss:0.6", "done"), streams) == "epoch 0 | loss:0.6"
    assert mismatch(("epoch 0 | loss:0.5", "..."), streams) == "epoch 0 | loss:0.5"  # rank 0 joined first
