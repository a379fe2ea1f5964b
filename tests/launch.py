"""Run the scripts as a user would, with a hard timeout and no process left behind."""
import os
import signal
import subprocess
import sys
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
    leftover = _kill_session(proc.pid)
    assert not leftover, f"{cmd} left processes behind"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


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
