"""gpt/train.py whose rank 1 fails on its own in its third step, for tests/test_gpt_checkpoints.py: an OSError, as a
read from a failing disk would raise, or with FAIL_WITH=ValueError a ValueError, the kind of a bad input's one
line, met by this rank alone; or with FAIL_WITH=hang, it stops answering for 6 s (a hung process: longer than the
test's --timeout), then goes on. The others' next collective fails on its closed connections, or times out."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

step = train.train_step
calls = []


def failing_step(*args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        if os.environ.get("FAIL_WITH") == "hang":
            time.sleep(6)
        elif os.environ.get("FAIL_WITH") == "ValueError":
            raise ValueError("a value that only rank 1 met")
        else:
            raise OSError(5, "Input/output error")
    return step(*args, **kwargs)


train.train_step = failing_step
main = train.main
