"""gpt/train.py that says each read of a file's ids by the token check ("[read] N ids"), for
tests/test_gpt_data.py. main() is gpt/train.py's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

import data  # noqa: E402

largest_id = data.largest_id


def said_largest_id(array, rank: int, world_size: int, *args) -> int:
    print(f"[read] {len(array)} ids", flush=True)
    return largest_id(array, rank, world_size, *args)


data.largest_id = said_largest_id
main = train.main
