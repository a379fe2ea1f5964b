"""The console blocks of the README and docs/: found, rerun, and compared with what they show.

A console block is a run of commands, each `$ command` line followed by what it printed. A block
is either rerun here and compared, or marked as one machine's figures by the line just before it:

    Machine-dependent figures (AMD EPYC, 2 cores, torch 2.13.0+cpu; 2026-11-21):

The comparison ignores only what varies by nature: times (a number before s, ms or us), ports,
temporary paths, and the order of lines from different processes: the block must be one way of
interleaving each process's lines, in that process's order. A line `...` stands for any number of
lines, and `...` inside a line for any text.
"""
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness import torchrun_in_process
from launch import REPO, run

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MACHINE = re.compile(r"^Machine-dependent figures \((.+); (\d{4}-\d{2}-\d{2})\):$")


@dataclass(frozen=True)
class Command:
    line: str  # as the block shows it, without the `$ `
    output: tuple[str, ...]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence
    commands: tuple[Command, ...]
    machine: str | None  # the marker line's machine and date, if the figures are one machine's

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in PAGES:
        text = path.read_text()
        for match in re.finditer(r"^```console\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
            before = text[: match.start()].rstrip("\n").splitlines()
            marker = MACHINE.match(before[-1]) if before else None
            commands, lines = [], match[1].splitlines()
            for line in lines:
                if line.startswith("$ "):
                    commands.append((line[2:], []))
                elif commands:
                    commands[-1][1].append(line)
            if not lines or not lines[0].startswith("$ "):
                commands = [("", lines)]  # no command: the test says so
            found.append(Block(path.relative_to(REPO).as_posix(), len(before) + 1,
                               tuple(Command(c, tuple(out)) for c, out in commands),
                               f"{marker[1]}; {marker[2]}" if marker else None))
    return found


# ---------------------------------------------------------------------------------------------
# Comparison


def normalise(line: str) -> str:
    line = re.sub(r"(?:file://)?/tmp/[^\s,:]+", "<tmp>", line.rstrip())
    line = re.sub(r"\b(?:localhost|127\.0\.0\.1):\d+", "<host>:<port>", line)
    return re.sub(r"\d+(?:\.\d+)? ?(?:s|ms|us|µs)\b", "<time>", line)


@functools.cache
def pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in normalise(shown).split("...")))


def mismatch(shown: tuple[str, ...], streams: list[list[str]]) -> str | None:
    """None if `shown` is one interleaving of the streams (each a process's lines, in order), with
    `...` as described above; else the first line of `shown` that no interleaving reaches."""
    streams = [[normalise(line) for line in stream if line.strip()] for stream in streams]
    shown = tuple(line for line in shown if line.strip())
    furthest = 0

    @functools.cache
    def fits(i: int, at: tuple[int, ...]) -> bool:
        nonlocal furthest
        furthest = max(furthest, i)
        if i == len(shown):
            return all(p == len(s) for p, s in zip(at, streams, strict=True))
        ahead = [k for k, s in enumerate(streams) if at[k] < len(s)]
        step = lambda k: at[:k] + (at[k] + 1,) + at[k + 1:]  # noqa: E731
        if shown[i].strip() == "...":
            return fits(i + 1, at) or any(fits(i, step(k)) for k in ahead)
        return any(pattern(shown[i]).fullmatch(streams[k][at[k]]) and fits(i + 1, step(k)) for k in ahead)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * (len(shown) + sum(map(len, streams)))))
    if fits(0, (0,) * len(streams)):
        return None
    return shown[furthest] if furthest < len(shown) else "(the end: the run printed more)"


def by_rank(text: str) -> list[list[str]]:
    """A whole launch's output split into streams: the lines of each `[rank r/w]`, and the rest."""
    streams: dict[str, list[str]] = {}
    for line in text.splitlines():
        found = re.search(r"\[rank (\d+)/\d+\]", line)
        streams.setdefault(found[1] if found else "", []).append(line)
    return list(streams.values())


# ---------------------------------------------------------------------------------------------
# Rerun


def _launch_words(words: list[str]) -> tuple[int, list[str]] | None:
    """(processes, [script, *args]) of `torchrun --standalone --nproc-per-node N script ...` or of
    `python -m torch.distributed.launch --use-env --standalone --nproc-per-node N script ...`."""
    for head in (["torchrun"], ["python", "-m", "torch.distributed.launch", "--use-env"]):
        rest = words[len(head):]
        if words[: len(head)] == head and rest[:2] == ["--standalone", "--nproc-per-node"] and rest[3].endswith(".py"):
            return int(rest[2]), rest[3:]
    return None


@dataclass(frozen=True)
class Output:
    codes: tuple[int | None, ...]  # each rank's exit code in the harness, else the command's
    streams: tuple[tuple[str, ...], ...]  # see mismatch
    cwd: Path  # where it ran, with what it wrote

    @property
    def text(self) -> str:
        return "\n".join("\n".join(stream) for stream in self.streams)


def run_command(line: str, cwd: Path) -> Output:
    """Run one documented command in `cwd`; return its exit codes and output.

    A launch runs in this process's harness (tests/harness.torchrun_in_process): each rank's
    main() in a forked worker, with torchrun's variables. Two kinds run whole, as a user would:
    torchrun with more options than these (--max-restarts) or with TORCH_DISTRIBUTED_DEBUG or
    PYTHONPATH set (read at start-up), and `python script`. Anything else is a shell command (ls, dd)."""
    words = shlex.split(line)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        if value.startswith("/tmp/"):
            value = str(cwd / Path(value).name)  # a fresh folder
        elif value and (REPO / value).exists():
            value = str(REPO / value)  # tests/inject
        env[name] = value
    launch = _launch_words(words)
    if launch and not {"TORCH_DISTRIBUTED_DEBUG", "PYTHONPATH"} & set(env):  # both act at start-up
        nproc, (script, *args) = launch
        result = torchrun_in_process(nproc, script, *args, cwd=cwd, env=env, timeout=120)
        streams = [stream.splitlines() for pair in zip(result.stdouts, result.stderrs, strict=True) for stream in pair]
        return Output(tuple(result.codes), tuple(map(tuple, streams)), cwd)
    if words[0] in ("torchrun", "python"):
        script = next(w for w in words if w.endswith(".py"))
        words[words.index(script)] = str(REPO / script)
        words[0] = sys.executable if words[0] == "python" else str(Path(sys.executable).parent / "torchrun")
        result = run(words, cwd=cwd, env=env, timeout=150)
    else:
        result = subprocess.run(["bash", "-c", line], cwd=cwd, env={**os.environ, **env}, capture_output=True,
                                text=True, timeout=60)
    return Output((result.returncode,), tuple(map(tuple, by_rank(result.stdout) + by_rank(result.stderr))), cwd)


_FOLDERS = tempfile.TemporaryDirectory()  # removed when the test session ends


@functools.cache
def rerun(*lines: str) -> tuple[Output, ...]:
    """Run the commands in order in a fresh folder, once per test session whoever asks: a lesson's
    tests and the docs test share the run. The folder (Output.cwd) lasts as long as the session."""
    folder = Path(tempfile.mkdtemp(dir=_FOLDERS.name))
    return tuple(run_command(line, folder) for line in lines)


def succeeded(line: str) -> str:
    """The output of `line`, rerun as above (shared with the docs test), which must have exited 0."""
    output, = rerun(line)
    assert all(code == 0 for code in output.codes), f"`{line}` exited {output.codes}\n{output.text}"
    return output.text


def check_output(command: Command, output: Output, where: str) -> None:
    wrong = mismatch(command.output, [list(stream) for stream in output.streams])
    assert wrong is None, f"{where}: `{command.line}` did not print\n    {wrong}\nIt printed:\n{output.text}"


def check_block(block: Block) -> None:
    for command, output in zip(block.commands, rerun(*(c.line for c in block.commands)), strict=True):
        check_output(command, output, block.name)


def documented(line: str) -> Command:
    """The block's command that reads `line`, for a test that runs it and compares."""
    found = [command for block in blocks() for command in block.commands if command.line == line]
    assert found, f"no console block in the README or docs/ runs `{line}`"
    return found[0]
