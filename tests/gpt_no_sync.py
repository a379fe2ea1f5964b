"""gpt/train.py with its gradient reduction switched off, for the test that shows the equivalence
proof can fail (tests/test_gpt.py). Run as a script of the harness: main() is gpt/train.py's."""
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402


def never(model, last_micro_step: bool):
    """No backward communicates: each rank steps on its own sequences alone."""
    if isinstance(model, train.DDP):
        return model.no_sync()
    model.set_requires_gradient_sync(False)  # FSDP: neither reduce-scatter nor all-reduce
    return contextlib.nullcontext()


train.parallelize.gradient_sync = never
main = train.main
