"""Work done once per test session, whichever pytest-xdist worker asks first: the others wait for it
and read its result. conftest.py makes the folder (ONCE_DIR, which the workers inherit) before any
worker starts, and removes it when the session ends."""
import fcntl
import hashlib
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def once(key: str, make: Callable[[Path], object]):
    """make(folder)'s result, made in a folder of its own that lasts the session, once for all workers."""
    root = Path(os.environ.get("ONCE_DIR") or tempfile.mkdtemp(prefix="once-"))  # no conftest: this process only
    name = hashlib.sha256(key.encode()).hexdigest()[:16]
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a worker that asks while another makes it waits here
        result = root / f"{name}.pickle"
        if not result.exists():
            shutil.rmtree(root / name, ignore_errors=True)  # a make that failed before
            (root / name).mkdir()
            made = make(root / name)
            result.with_suffix(".tmp").write_bytes(pickle.dumps(made))
            result.with_suffix(".tmp").rename(result)
        return pickle.loads(result.read_bytes())
