"""gpt/train.py that sends itself SIGTERM as step SIGNAL_AT (1-based) starts, or with SIGNAL_IN_EVAL=1 during
the evaluation at that step, for tests/test_gpt_checkpoints.py. main() is gpt/train.py's."""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

SIGNAL_AT = int(os.environ["SIGNAL_AT"])
IN_EVAL = os.environ.get("SIGNAL_IN_EVAL") == "1"
lr_at, evaluate = train.lr_at, train.evaluate


def signalling_lr_at(step: int, args) -> float:
    if step + 1 == SIGNAL_AT and not IN_EVAL:  # lr_at(step) is the first thing each step does
        os.kill(os.getpid(), signal.SIGTERM)
    return lr_at(step, args)


def signalling_evaluate(*args, **kwargs) -> float:
    os.kill(os.getpid(), signal.SIGTERM)
    return evaluate(*args, **kwargs)


train.lr_at = signalling_lr_at
if IN_EVAL:
    train.evaluate = signalling_evaluate
main = train.main
