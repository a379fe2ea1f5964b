"""gpt/train.py where --out_dir is not shared: rank 1 sees a folder of its own (another host's local
disk), so not the file that rank 0 writes there, for tests/test_gpt_checkpoints.py."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

exists = os.path.exists


def on_this_host(path) -> bool:
    return exists(path) and not (os.environ["RANK"] == "1" and os.path.basename(path).startswith(".probe-"))


os.path.exists = on_this_host
main = train.main
