"""gpt/train.py whose rank 2 is given other options than the others (another --lr and --max_steps, as a node whose
command line differs), for tests/test_gpt_checkpoints.py."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402


def main() -> None:
    if os.environ["RANK"] == "2":
        sys.argv += ["--lr", "1e-06", "--max_steps", "5"]
    train.main()
