"""gpt/train.py with its gradient reduction switched off, for the test that shows the equivalence
proof can fail (tests/test_gpt.py). Run as a script of the harness: main() is gpt/train.py's."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

_gradient_sync = train.gradient_sync
train.gradient_sync = lambda model, sync: _gradient_sync(model, False)  # never reduce: each rank alone
main = train.main
