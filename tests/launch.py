"""Run the scripts as a user would, with a hard timeout and no process left behind."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")


def run(cmd: list[str] | str, timeout: float = 120, env: dict | None = None, cwd: Path = REPO,
        shell: bool = False) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own; fail the test if it outlives `timeout` or leaves any
    process of its session running after it exits (a torchrun worker, a spawned child)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=full_env, shell=shell, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n--- stdout\n{out}\n--- stderr\n{err}") from None
    leftover = _survivors(proc.pid, grace=5.0)
    _kill_session(proc.pid)
    assert not leftover, f"{cmd} left processes behind"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _survivors(pgid: int, grace: float) -> bool:
    """True if a process of the group is still alive `grace` seconds after its leader exited
    (multiprocessing's resource tracker, for one, takes a moment to notice and exit)."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)


def _kill_session(pgid: int) -> bool:
    """SIGKILL every process still in the group; True if there was any."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def torchrun(nproc: int, script: str, *args: str, timeout: float = 120, env: dict | None = None):
    """`torchrun --standalone --nproc-per-node N script args`: --standalone picks a free port."""
    return run([TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), script, *args], timeout=timeout, env=env)


def python(script: str, *args: str, timeout: float = 60, env: dict | None = None):
    return run([sys.executable, script, *args], timeout=timeout, env=env)


def check(result: subprocess.CompletedProcess) -> str:
    """The run's stdout, after asserting that it exited 0 (showing its output if not)."""
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
    return result.stdout


EPOCH_LINE = re.compile(r"^epoch (\d+) \| train_loss:([\d.]+) val_loss:([\d.]+)$", re.MULTILINE)
DONE_LINE = re.compile(r"^done \| val_loss:([\d.]+) floor:([\d.]+)", re.MULTILINE)


def epoch_losses(stdout: str) -> dict[int, tuple[float, float]]:
    """{epoch: (train_loss, val_loss)} from a training script's output; no epoch may appear twice."""
    rows = [(int(e), float(t), float(v)) for e, t, v in EPOCH_LINE.findall(stdout)]
    epochs = [e for e, _, _ in rows]
    assert len(epochs) == len(set(epochs)), f"an epoch ran twice: {epochs}"
    return {e: (t, v) for e, t, v in rows}
