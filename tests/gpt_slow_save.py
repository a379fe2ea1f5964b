"""gpt/train.py whose saves take 1 s more on the training path (the copy to CPU memory, say), for
tests/test_gpt_checkpoints.py: tokens/s must count it. main() is gpt/train.py's."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

SAVE_SECONDS = 1.0
save = train.Checkpoints.save


def slow_save(self, state: dict, step: int, extra: dict) -> None:
    time.sleep(SAVE_SECONDS)
    save(self, state, step, extra)


train.Checkpoints.save = slow_save
main = train.main
