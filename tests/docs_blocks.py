"""The console blocks of the README and docs/: found, rerun, and compared with what they show.

A console block is a run of commands, each `$ command` line followed by what it printed. A block
is either rerun here and compared, or marked as one machine's figures by the line just before it:

    Machine-dependent figures (AMD EPYC, 2 cores, torch 2.13.0+cpu; 2026-11-21):

The comparison ignores only what varies by nature: measured times (a number with a decimal point
before s, ms or us), ports, the folders of /tmp paths, and the order of lines from different
processes: the block must be one way of interleaving each process's lines, in that process's
order. A line `...` stands for any number of lines, and `...` inside a line for any text. The exit
status must agree too: a block that shows an `error:` line failed, any other succeeded.
"""
import functools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from harness import torchrun_in_process
from launch import REPO, run
from once import once

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
    """Every console block, indented (in a list) or not, whatever its fence's spacing."""
    found = []
    for path in PAGES:
        text = path.read_text()
        for match in re.finditer(r"^([ \t]*)```[ \t]*console[ \t]*\n(.*?)^[ \t]*```", text, re.DOTALL | re.MULTILINE):
            before = text[: match.start()].rstrip("\n").splitlines()
            marker = MACHINE.match(before[-1].strip()) if before else None
            commands, lines = [], [line.removeprefix(match[1]) for line in match[2].splitlines()]
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
    """What varies by nature, made equal: a measured time (a number with a decimal point before s,
    ms or us; `timeout 1 s` or `1000ms` stay as they are), a port, the folders of a /tmp path."""
    line = re.sub(r"(?:file://)?/tmp/(?:[^\s,:/]+/)*", "<tmp>/", line.rstrip())
    line = re.sub(r"\b(localhost|127\.0\.0\.1):\d+", r"\1:<port>", line)
    return re.sub(r"\d+\.\d+ ?(?:s|ms|us|µs)\b", "<time>", line)


@functools.cache
def pattern(shown: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in normalise(shown).split("...")))


MAX_STATES = 100_000


def mismatch(shown: tuple[str, ...], streams: list[list[str]]) -> str | None:
    """None if `shown` is one interleaving of the streams (each a process's lines, in order), with
    `...` as described above; else the first line of `shown` that no interleaving gets past.

    A `...` line takes, from each stream, the lines just ahead of it, as many as it likes: since
    the order across streams is free, that is the same as letting each stream skip once, before
    its next line that `shown` matches. So the search keeps, for each way of matching so far, each
    stream's position and whether it may still skip; there are few such ways unless many streams
    print the same line."""
    streams = [[normalise(line) for line in stream if line.strip()] for stream in streams]
    shown = tuple(line for line in shown if line.strip())
    states = {((0,) * len(streams), (False,) * len(streams))}
    for line in shown:
        if line.strip() == "...":
            states = {(at, (True,) * len(streams)) for at, _ in states}
            continue
        match = pattern(line).fullmatch
        following = set()
        for at, may_skip in states:
            for k, stream in enumerate(streams):
                ends = range(at[k], len(stream)) if may_skip[k] else range(at[k], min(at[k] + 1, len(stream)))
                for j in (j for j in ends if match(stream[j])):
                    following.add((at[:k] + (j + 1,) + at[k + 1:], may_skip[:k] + (False,) + may_skip[k + 1:]))
        if not following:
            return f"{line}   (no process printed this line next; or a line before it is missing)"
        if len(following) > MAX_STATES:
            return f"{line}   (too many ways to match: split the block, or show fewer `...` lines)"
        states = following
    if any(all(p == len(s) or skip for p, s, skip in zip(at, streams, may, strict=True)) for at, may in states):
        return None
    return "(the end: the run printed more)"


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
        if words[: len(head)] == head and rest[:2] == ["--standalone", "--nproc-per-node"] and len(rest) > 3 \
                and rest[3].endswith(".py"):
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


@functools.cache
def rerun(*lines: str) -> tuple[Output, ...]:
    """Run the commands in order in a fresh folder, once per test session whoever asks (tests/once.py): a
    lesson's tests and the docs test share the run. The folder (Output.cwd) lasts as long as the session."""
    return once("rerun\n" + "\n".join(lines), lambda folder: tuple(run_command(line, folder) for line in lines))


def succeeded(line: str) -> str:
    """The output of `line`, rerun as above (shared with the docs test), which must have exited 0."""
    output, = rerun(line)
    assert all(code == 0 for code in output.codes), f"`{line}` exited {output.codes}\n{output.text}"
    return output.text


def check_output(command: Command, output: Output, where: str) -> None:
    """The output matches, and the exit status is what the block implies: a block that shows an
    `error:` line failed (every process ended, not all with 0), and any other succeeded."""
    wrong = mismatch(command.output, [list(stream) for stream in output.streams])
    assert wrong is None, f"{where}: `{command.line}` did not print\n    {wrong}\nIt printed:\n{output.text}"
    shows_error = any(line.startswith("error: ") for line in command.output)
    ended = None not in output.codes
    assert ended and any(output.codes) == shows_error, (
        f"{where}: `{command.line}` exited {output.codes}, but its block shows "
        f"{'an error' if shows_error else 'no error'}\n{output.text}")


def check_block(block: Block) -> None:
    for command, output in zip(block.commands, rerun(*(c.line for c in block.commands)), strict=True):
        check_output(command, output, block.name)


def documented(line: str) -> Command:
    """The block's command that reads `line`, for a test that runs it and compares."""
    found = [command for block in blocks() for command in block.commands if command.line == line]
    assert found, f"no console block in the README or docs/ runs `{line}`"
    return found[0]
