"""gpt/train.py on a file system without locks (Lustre mounted without flock, NFS without lockd),
for tests/test_gpt_checkpoints.py: fcntl.flock fails as it does there. main() is gpt/train.py's."""
import errno
import fcntl
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402


def flock(fd, operation) -> None:
    raise OSError(errno.ENOLCK, "No locks available")


fcntl.flock = flock
main = train.main
