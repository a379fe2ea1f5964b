"""What several test files share: one set of small DDP runs, made once per session."""
import pytest
from harness import spawn
from workers import train_script

# Small and awkward on purpose: 7 per batch leaves a short last batch, 50 validation samples shard
# unevenly. 300 training samples divide by 2, 3 and 4, so that the ranks' i-th batches together are the
# i-th global batch of single_process.py (tests/test_train.py); 301 shows the sampler's padding.
ARGV = ["--max_epochs", "3", "--batch_size", "7", "--train_size", "300", "--val_size", "50", "--lr", "0.01"]
WORLD_SIZES = [2, 3]


@pytest.fixture(scope="session")
def ddp_runs() -> dict[int, tuple[list[dict], list[str]]]:
    """{world_size: (every rank's final weights, every rank's stdout)} for singlenode_cpu's train()
    with ARGV, each world size in a process group of its own."""
    return {n: spawn(train_script, n, "singlenode_cpu", ARGV, timeout=90) for n in WORLD_SIZES}
