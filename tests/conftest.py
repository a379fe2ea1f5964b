"""What several test files share: one set of small DDP runs, made once per session (once for all
pytest-xdist workers: tests/once.py, whose folder is made here before the workers start)."""
import os
import shutil
import tempfile

# Idle OpenMP threads sleep rather than spin. torch's CPU build spins them, and two torch processes spinning
# on this machine's 2 cores (two pytest-xdist workers, a test beside its launch) took 112 s for a 10 s run.
# OpenMP reads this as torch loads it: set before any import of torch, and inherited by every process started.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
from harness import spawn  # noqa: E402
from once import once  # noqa: E402
from workers import train_script  # noqa: E402

# Small and awkward on purpose: 7 per batch leaves a short last batch, 50 validation samples shard
# unevenly. 300 training samples divide by 2, 3 and 4, so that the ranks' i-th batches together are the
# i-th global batch of single_process.py (tests/test_train.py); 301 shows the sampler's padding.
ARGV = ["--max_epochs", "3", "--batch_size", "7", "--train_size", "300", "--val_size", "50", "--lr", "0.01"]
WORLD_SIZES = [2, 3]


@pytest.fixture(scope="session")
def ddp_runs() -> dict[int, tuple[list[dict], list[str]]]:
    """{world_size: (every rank's final weights, every rank's stdout)} for singlenode_cpu's train()
    with ARGV, each world size in a process group of its own."""
    return once("ddp_runs", lambda _: {n: spawn(train_script, n, "singlenode_cpu", ARGV, timeout=90)
                                       for n in WORLD_SIZES})


# The slowest files first: pytest-xdist hands out whole files (--dist loadfile; --no-loadscope-reorder keeps
# this order, where its own puts the files with the most tests first), and a long file handed out last would
# run alone at the end while the other worker idles. By their seconds in a CI run on 2 cores (2026-11-28).
SLOWEST = ["test_gpt.py", "test_gpt_checkpoints.py", "test_gpt_llama.py", "test_gpt_moe.py", "test_docs_output.py",
           "test_torchft.py",
           "test_multinode.py", "test_gpt_simulate.py", "test_deepspeed_zero.py", "test_pipeline_parallel.py",
           "test_gpt_sbatch.py", "test_launchers.py", "test_fault_tolerance.py", "test_readme.py", "test_gpt_data.py",
           "test_gpt_hf.py", "test_tensor_parallel.py", "test_zero_by_hand.py"]


def pytest_collection_modifyitems(items: list) -> None:
    first = {name: i for i, name in enumerate(SLOWEST)}
    items.sort(key=lambda item: first.get(item.path.name, len(SLOWEST)))  # stable: a file's own order kept


def pytest_configure(config) -> None:
    if "ONCE_DIR" not in os.environ:  # the session's first process: xdist's workers inherit it
        os.environ["ONCE_DIR"] = config.once_dir = tempfile.mkdtemp(prefix="pytest-once-")


def pytest_unconfigure(config) -> None:
    if hasattr(config, "once_dir"):
        shutil.rmtree(config.once_dir, ignore_errors=True)
        del os.environ["ONCE_DIR"]
