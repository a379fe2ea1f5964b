"""Run a function on N ranks of a gloo process group, from inside a test.

Cheaper than a whole-script launch (no torchrun agent) and it hands back what each rank returned,
so a test can compare every replica. The rendezvous is a file:// store in a temporary folder: no
port at all. Every worker is killed if the group outlives its timeout.

The workers are forked from a server process that has imported torch once (multiprocessing's
forkserver, with the modules preloaded): a fresh interpreter would spend about 3.5 s of CPU on
importing torch and torch._dynamo (which an optimizer's first step imports), in every worker of
every test. The server is started once per test session, before any process group exists, and
runs no threads of torch's, so forking it is safe. Two things follow from the fork. The workers
see the environment that the test process had when the server started (at the first call), and
torch.distributed has read TORCH_DISTRIBUTED_DEBUG by then: a test that needs other variables in
its workers runs the script whole.
"""
import importlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

# Before any process group exists, as in singlenode_cpu.py: imported later (an optimizer's first step
# imports it), its defaults would hold the group into interpreter shutdown, where gloo can abort.
import torch.distributed.nn  # noqa: F401, I001

# deepspeed_zero: DeepSpeed's import (1.5 s of CPU, and DS_ACCELERATOR=cpu set before it), paid once per session;
# tests.forkserver_warmup, last: what each worker would redo, then gc.freeze (its docstring says what). A preload
# that fails to import is skipped in silence: tests/test_gpt.py checks that a worker sees the warmup.
PRELOAD = ["torch", "torch.distributed.nn", "torch._dynamo", "torch.distributed", "deepspeed_zero",
           "tests.forkserver_warmup"]


def _end_with(test_process: int) -> None:
    """End this worker if the test process dies: a test run killed (by a timeout's SIGTERM, or
    SIGKILL) while a rank hangs would otherwise leave the rank, and with it the forkserver, running."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(test_process, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="test-process-watch").start()


def _worker(fn: Callable, rank: int, world_size: int, folder: str, timeout: float, args: tuple,
            test_process: int) -> None:
    _end_with(test_process)
    sys.stdout = open(os.path.join(folder, f"stdout{rank}.txt"), "w", buffering=1)  # noqa: SIM115
    sys.stderr = open(os.path.join(folder, f"stderr{rank}.txt"), "w", buffering=1)  # noqa: SIM115
    torch.set_num_threads(1)  # N workers share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    code = 0
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(folder, f"result{rank}.pt"))
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    except Exception:  # (a SystemExit goes on to multiprocessing, which exits with its code)
        traceback.print_exc()  # what multiprocessing would print, before the same exit code
        code = 1
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips the interpreter's teardown of torch: a second of CPU per worker, and where a rank
    # failed, a teardown that can wait on what the failed collectives left (DDP's reducer, gloo's threads)


def _read(folder: str, name: str) -> str:
    path = Path(folder, name)
    return path.read_text() if path.exists() else ""


def _start_and_join(target: Callable, world_size: int, args: Callable[[int], tuple], timeout: float) -> list:
    """Start target(*args(rank)) on every rank from the forkserver, wait for all of them until the
    deadline, kill what is left; return the exit codes (None where killed)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts: at the first call
    procs = [context.Process(target=target, args=args(rank)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    finally:
        codes = [proc.exitcode for proc in procs]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return codes


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 60) -> tuple[list, list, list[str], list[str]]:
    """Run fn(rank, world_size, *args) on every rank; return (exit codes, results, stdouts, stderrs),
    each by rank (a rank that failed has no result: None).

    fn must be importable by name (a module-level function): the workers are forked from a server
    process, which receives it by pickle.
    A rank still running at the deadline is killed, and its exit code is None.
    """
    with tempfile.TemporaryDirectory() as folder:
        def worker_args(rank: int) -> tuple:
            return fn, rank, world_size, folder, timeout, args, os.getpid()
        codes = _start_and_join(_worker, world_size, worker_args, timeout)
        outputs = [[_read(folder, f"{name}{rank}.txt") for rank in range(world_size)] for name in ("stdout", "stderr")]
        paths = [Path(folder, f"result{rank}.pt") for rank in range(world_size)]
        results = [torch.load(path, weights_only=True) if path.exists() else None for path in paths]
    return codes, results, outputs[0], outputs[1]


def spawn(fn: Callable, world_size: int, *args, timeout: float = 60) -> tuple[list, list[str]]:
    """Run fn(rank, world_size, *args) on every rank, which must all succeed; return (results, stdouts),
    both by rank."""
    codes, results, stdouts, stderrs = run_ranks(fn, world_size, *args, timeout=timeout)
    failed = [rank for rank, code in enumerate(codes) if code != 0]
    if failed:
        details = "\n".join(f"--- rank {rank} (exit {codes[rank]}) stderr\n{stderrs[rank]}" for rank in failed)
        raise AssertionError(f"ranks {failed} failed\n{details}")
    return results, stdouts


@dataclass
class Launch:
    """What each rank of a launch left behind, by rank."""
    codes: list[int | None]
    stdouts: list[str]
    stderrs: list[str]

    @property
    def stdout(self) -> str:
        return "".join(self.stdouts)

    @property
    def stderr(self) -> str:
        return "".join(self.stderrs)


def _main_worker(script: str, argv: list[str], env: dict[str, str], cwd: str, folder: str, rank: int,
                 test_process: int) -> None:
    _end_with(test_process)
    for fd, name in ((1, "stdout"), (2, "stderr")):  # torch's C++ warnings too, as a terminal shows them
        with open(os.path.join(folder, f"{name}{rank}.txt"), "w") as file:
            os.dup2(file.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(env)
    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1, which this process read too late
    folder, name = os.path.split(script.removesuffix(".py"))
    if folder:  # gpt/train.py: as python runs it, its folder first on sys.path, and the root's
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / folder))
        for sibling in Path(sys.path[0]).glob("*.py"):  # the root's model.py and data.py, which the server
            sys.modules.pop(sibling.stem, None)  # preloaded, forgotten for the folder's own: the module
            held = sys.modules.get(f"{folder}.{sibling.stem}")  # the module the server imported from this very
            if held is not None and Path(held.__file__).resolve() == sibling.resolve():  # file (gpt.data), if so
                sys.modules[sibling.stem] = held
    module = importlib.import_module(name)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    code = 0
    try:
        module.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if code and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # as Python prints SystemExit("text") at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def torchrun_in_process(nproc: int, script: str, *argv: str, cwd: Path | None = None, env: dict | None = None,
                        timeout: float = 60) -> Launch:
    """`torchrun --standalone --nproc-per-node N script argv`, without torchrun: each rank runs the
    script's main() in a worker forked from the server, with the variables torchrun would give it,
    and meets the others at a store that this process hosts, on a port the system picks, as torchrun's
    agent hosts its own. What it leaves out is the launch itself (tests/launch.py runs that) and the
    variables read at import, such as TORCH_DISTRIBUTED_DEBUG."""
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    base = {"LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "localhost", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1",
            **(env or {})}
    with tempfile.TemporaryDirectory() as folder:
        def args(rank: int) -> tuple:
            ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
            return script, list(argv), {**base, **ranks}, str(cwd or folder), folder, rank, os.getpid()
        codes = _start_and_join(_main_worker, nproc, args, timeout)
        outputs = [[_read(folder, f"{name}{rank}.txt") for rank in range(nproc)] for name in ("stdout", "stderr")]
    del store
    return Launch(codes, *outputs)


def python_in_process(script: str, *argv: str, cwd: Path | None = None, timeout: float = 60) -> Launch:
    """`python script argv` without a fresh interpreter (3.5 s of CPU importing torch): the script's main()
    in one worker forked from the server, with no torchrun variables. For a script whose output is what
    a test reads; one whose launch, exit or teardown is tested runs whole (tests/launch.py)."""
    with tempfile.TemporaryDirectory() as folder:
        def args(rank: int) -> tuple:
            return script, list(argv), {}, str(cwd or folder), folder, rank, os.getpid()
        codes = _start_and_join(_main_worker, 1, args, timeout)
        outputs = [[_read(folder, f"{name}0.txt")] for name in ("stdout", "stderr")]
    return Launch(codes, *outputs)
