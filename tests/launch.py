"""Run the scripts as a user would, with a hard timeout and no process left behind."""
import ctypes
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
        shell: bool = False, grace: float = 5.0) -> subprocess.CompletedProcess:
    """Run `cmd`; fail the test if it outlives `timeout` or leaves any process running `grace`
    seconds after it exits. Every process it started is killed in either case.

    torchrun starts each worker in a session of its own, so killing the launcher's process group
    misses them. Instead this process becomes a "child subreaper": processes orphaned below it
    are re-parented to it rather than to init, so none can slip away unseen.
    """
    _become_subreaper()
    before = _children(os.getpid())
    proc = subprocess.Popen(
        cmd, cwd=cwd, env={**os.environ, **(env or {})}, shell=shell, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        _reap_new_children(before, grace=0)  # orphans hold the output pipes open
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd}\n--- stdout\n{out}\n--- stderr\n{err}") from None
    leftover = _reap_new_children(before, grace)
    assert not leftover, f"{cmd} left processes behind: {leftover}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class Group:
    """Commands started side by side (two torchrun agents, say), their output going to files so
    that a test can watch it while they run. `wait` gives every command one deadline, then kills
    whatever is left and fails the test if anything outlived its command."""

    def __init__(self, folder: Path) -> None:
        _become_subreaper()
        self.folder = folder
        self.before = _children(os.getpid())
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> subprocess.Popen:
        index = len(self.procs)
        proc = subprocess.Popen(
            cmd, cwd=cwd, env={**os.environ, **(env or {})}, text=True, start_new_session=True,
            stdout=open(self.folder / f"out{index}.txt", "w"), stderr=open(self.folder / f"err{index}.txt", "w"),
        )
        self.procs.append(proc)
        return proc

    def stdout(self, index: int) -> str:
        return (self.folder / f"out{index}.txt").read_text()

    def stderr(self, index: int) -> str:
        return (self.folder / f"err{index}.txt").read_text()

    def wait_for(self, index: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.stdout(index):
            if time.monotonic() > deadline or self.procs[index].poll() is not None:
                self.kill()
                raise AssertionError(f"{text!r} never appeared\n{self.stdout(index)}\n{self.stderr(index)}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[int]:
        """Every command's exit code; fails if one is still running after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs:
                proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout}s: {[p.args for p in self.procs]}") from None
        leftover = _reap_new_children(self.before, grace=5.0)
        assert not leftover, f"processes left behind: {leftover}"
        return [proc.returncode for proc in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
            proc.wait()
        _reap_new_children(self.before, grace=0)


def _become_subreaper() -> None:
    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children(pid: int) -> set[int]:
    children = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.update(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return children


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it."""
    for victim in [pid, *descendants(pid)]:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap_new_children(before: set[int], grace: float) -> list[int]:
    """Wait up to `grace` s for processes re-parented to us since `before` to exit, reaping them;
    kill and return those still alive then."""
    deadline = time.monotonic() + grace
    while True:
        alive = []
        for pid in _children(os.getpid()) - before:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # not ours to reap (a Popen already did)
            if done == 0:
                alive.append(pid)
        if not alive:
            return []
        if time.monotonic() > deadline:
            for pid in alive:
                kill_tree(pid)
                os.waitpid(pid, 0)
            return alive
        time.sleep(0.05)


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
