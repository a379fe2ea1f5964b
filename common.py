"""Plumbing that the training scripts share and that is not the DDP lesson.

Argument checks, a free port, the store that a restarted torchrun job meets at, signals, and
checkpoints: one job per file, written in the background and atomically, loaded only when whole.
Every distributed call (init_process_group, DDP, DistributedSampler, all_reduce, ...) stays in the
scripts, where the reader can see it.
"""
import argparse
import contextlib
import ctypes
import errno
import fcntl
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import threading
import time
import zipfile
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

# Imported here, before any process group exists, as every script imports this module first. Its
# functions take `group=group.WORLD` as a default, evaluated at import: imported later (torch._dynamo
# imports it, and an optimizer's first step imports dynamo), they would hold the process group after
# destroy_process_group, and gloo's threads would run on into interpreter shutdown, where they can
# abort the process ("terminate called without an active exception").
import torch.distributed.nn  # noqa: F401, I001

import data
from model import MODELS


def die(message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and a non-zero exit: 2 by default, the code argparse uses for bad input.
    Written in one write, as print_line does, so that two ranks' lines never run together."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    # A stop right after a collective: gloo's worker threads still let go of its tensors, which
    # takes the GIL. Exiting at once can destroy the process group (holding the GIL, joining those
    # threads) while one of them waits for the GIL: both wait for ever (torch 2.13, one run in four
    # in tests/test_fault_tolerance.py's non-finite test). Sleeping releases the GIL a moment first.
    time.sleep(0.05)
    sys.exit(code)


def exit_now() -> NoReturn:
    """Exit with status 0 at once, once main() has returned: everything is saved, every file closed,
    the process group destroyed. The interpreter's own teardown of torch (about 2,000 modules once an
    optimizer has imported torch._dynamo) costs 0.8 s of CPU per process: 3 s of wall time for 8
    processes on 2 cores. The exit handlers it skips have nothing to do here (logging, DataLoader
    workers, torch.compile statistics); an exception or die() never gets this far."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def print_line(text: str) -> None:
    """Print one line in a single write. print() writes the text and the newline separately, and
    torchrun runs Python unbuffered, so lines from several ranks would otherwise run together."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def number_in(low: float, high: float, kind: type = float):
    """An argparse type: a number of `kind` from `low` to `high`, or one line that says the range."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value <= high:  # also rejects nan
            raise argparse.ArgumentTypeError(f"must be from {low:g} to {high:g}, got {text}")
        return value
    return parse


# Seconds: below 1 the rendezvous itself rarely finishes; above about 115 days a mistake, and far above
# it the number no longer fits a timedelta (1e300 and inf raise OverflowError there).
timeout_seconds = number_in(1, 10**7)
# torch.manual_seed takes any 64-bit integer, and DistributedSampler seeds with seed + epoch.
seed_value = number_in(0, 2**63 - 2**31, int)
port_number = number_in(0, 65535, int)


def checkpoint_path(text: str) -> str:
    """An argparse type: a path that can name a file (what is at it is checked at start)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a file, or leave --checkpoint out to train without one")
    if text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} ends in {os.sep}, so it names a folder: name a file in it")
    return text


def checkpoint_folder(text: str) -> str:
    """An argparse type: a path that can name a folder, for a checkpoint that every rank writes a file of."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name a folder, or leave --checkpoint out to train without one")
    if not text.rstrip(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} is the root folder: name a folder for the checkpoint")
    return text.rstrip(os.sep)


def add_training_args(parser: argparse.ArgumentParser, checkpoint: bool = True) -> None:
    """The knobs that every training script takes, with defaults that run in seconds on a CPU.
    checkpoint=False: a lesson past the basics, which trains without --checkpoint."""
    parser.add_argument("--max_epochs", type=positive_int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=positive_float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=seed_value, default=0, help="seed for the model's weights and the shuffle")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp", help="which model from model.py")
    parser.add_argument("--train_size", type=positive_int, default=data.TRAIN_SIZE, help="training samples")
    parser.add_argument("--val_size", type=positive_int, default=data.VAL_SIZE, help="validation samples")
    parser.add_argument(
        "--timeout", type=timeout_seconds, default=120.0,
        help="seconds (1 to 1e7) a collective waits for a peer before the process group gives up",
    )
    if checkpoint:
        parser.add_argument(
            "--checkpoint", type=checkpoint_path, default=None, metavar="PATH",
            help="after every epoch rank 0 saves here; if the file exists at start, training resumes from it",
        )


def add_step_args(parser: argparse.ArgumentParser, precisions: dict, precision_help: str) -> None:
    """What the training scripts can change in a step: precision, clipping and compilation."""
    parser.add_argument("--precision", choices=sorted(precisions), default="fp32", help=precision_help)
    parser.add_argument("--clip_grad_norm", type=positive_float, default=None, metavar="MAX",
                        help="clip the averaged gradients to a total norm of at most MAX (default: no clipping)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the model; the first step compiles it, which takes seconds")


def reject_old_launcher_flag(parser: argparse.ArgumentParser) -> None:
    """python -m torch.distributed.launch without --use-env appends --local-rank=N to the arguments.
    Say what to do about it, rather than argparse's bare "unrecognized arguments"."""

    class Reject(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is what python -m torch.distributed.launch passes without --use-env; "
                         "start this script with torchrun, or add --use-env (it reads LOCAL_RANK from the environment)")

    parser.add_argument("--local-rank", "--local_rank", action=Reject, help=argparse.SUPPRESS)


def check_sizes(args: argparse.Namespace, world_size: int, procs_on_node: int) -> None:
    """Sizes that cannot work, refused before anything starts: fewer samples than ranks, or data
    sets that do not fit in this machine's memory (every process builds its own copy)."""
    if world_size > args.train_size:
        die(f"{world_size} ranks but only {args.train_size} training samples: every rank needs at least one")
    # float32 features and target per sample, and about as much again while they are drawn
    per_process = (args.train_size + args.val_size) * (data.FEATURES + 1) * 4 * 2
    check_memory(per_process * procs_on_node, f"--train_size {args.train_size} and --val_size {args.val_size} "
                 f"on {procs_on_node} process{'es' if procs_on_node > 1 else ''}")


def check_gpus(procs_on_node: int, flag: str, cpu_script: str) -> None:
    """Fail fast, in one line, where nccl would otherwise fail late and obscurely: no CUDA at all,
    or more processes on this node than GPUs (two processes cannot share a GPU under nccl)."""
    quiet = int(os.environ.get("LOCAL_RANK", 0)) != 0  # the same line from every process says nothing more
    if not torch.cuda.is_available():
        if quiet:
            sys.exit(2)
        die(f"no CUDA GPU is visible (this torch is {torch.__version__}); on CPUs run {cpu_script} instead")
    gpus = torch.cuda.device_count()
    if procs_on_node > gpus:
        if quiet:
            sys.exit(2)
        die(f"{procs_on_node} processes on this node but {gpus} GPUs: use {flag} {gpus} or fewer, one per GPU")


def listen_on_loopback(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1:`port` (0: a free port that the system picks), or one line
    that names the port if another program holds it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            die(f"port {port} on 127.0.0.1 is already in use: pass --port 0 to let the system pick a free one, "
                "or name another")
        die(f"cannot listen on port {port} of 127.0.0.1: {exc.strerror} (ports below 1024 need root): "
            "pass --port 0 to let the system pick a free one")
    sock.listen()
    return sock


def check_memory(needed: int, what: str) -> None:
    """One line, before anything is allocated, if `needed` bytes cannot fit in this machine's memory."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return  # not Linux: nothing to compare with
    if needed > available:
        die(f"{what} need {needed:,} bytes of memory and this machine has {available:,} available")


def launcher_env() -> tuple[int, int, int] | None:
    """(rank, local rank, world size) from the variables a launcher sets, or None if none is set.
    A partial or malformed set (a hand-made environment, a launcher of another kind) is one line."""
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    present = [name for name in names if name in os.environ]
    if not present:
        return None
    how = "start this script with torchrun, which sets them all, e.g. torchrun --standalone --nproc-per-node 4"
    missing = [name for name in names if name not in os.environ]
    if missing:
        die(f"{', '.join(present)} set but not {', '.join(missing)}: {how}")
    values = {}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        try:
            values[name] = int(os.environ[name])
        except ValueError:
            die(f"{name}={os.environ[name]!r} is not an integer: {how}")
    if not (0 <= values["RANK"] < values["WORLD_SIZE"] and 0 <= values["LOCAL_RANK"] < values["LOCAL_WORLD_SIZE"]
            <= values["WORLD_SIZE"]):
        die(f"RANK={values['RANK']}, LOCAL_RANK={values['LOCAL_RANK']}, WORLD_SIZE={values['WORLD_SIZE']} and "
            f"LOCAL_WORLD_SIZE={values['LOCAL_WORLD_SIZE']} do not fit together: {how}")
    if not 0 < values["MASTER_PORT"] <= 65535 or not os.environ["MASTER_ADDR"].strip():
        die(f"MASTER_ADDR={os.environ['MASTER_ADDR']!r} and MASTER_PORT={os.environ['MASTER_PORT']} are not an "
            f"address and a port: {how}")
    return values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"]


def torchrun_ranks(script: str, args: argparse.Namespace | None = None) -> tuple[int, int, int]:
    """(rank, local rank, world size) of a worker that torchrun started, found as singlenode_cpu.py's
    main() finds them: one line on how to launch `script` if no launcher started it, the data sizes
    checked against the ranks and the memory (given the args), and the process set to end at once
    on a stop signal or on torchrun's death."""
    launched = launcher_env()
    if launched is None:
        die(f"start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 2 {script}")
    if args is not None:
        check_sizes(args, launched[2], procs_on_node=int(os.environ["LOCAL_WORLD_SIZE"]))
    exit_promptly_on_signals(launcher=PARENT_AT_START)
    return launched


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (it may be taken again before it is used)."""
    with listen_on_loopback(0) as sock:
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# Launch: the store a restarted job meets at, and processes that stop cleanly


def torchrun_store(timeout: timedelta) -> dist.Store | None:
    """The store for init_process_group under torchrun, or None to let env:// make one.

    Unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set, torchrun hands its workers its own
    rendezvous store (TORCHELASTIC_USE_AGENT_STORE=True), and that store outlives a restart with
    every key the dead workers wrote, gloo's addresses among them: a restarted gloo group can read
    a dead worker's address and fail to connect, or hang (pytorch/pytorch#135712). torch 2.13's
    env:// no longer keeps the attempts apart (torch/distributed/rendezvous.py,
    _create_c10d_store), so this does: each attempt meets under keys of its own. The attempt
    number is the agent's own restart count, which the agents of several nodes do not agree on
    (pytorch/pytorch#108158), so restarts on several nodes need the variable, which gives every
    attempt a new store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # no torchrun, or torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    nodes, restarts = (int(os.environ.get(name, "0")) for name in ("GROUP_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"))
    if nodes > 1 and restarts > 0:
        if os.environ.get("LOCAL_RANK", "0") != "0":
            sys.exit(2)  # one line per node says it all
        die("torchrun --max-restarts on several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment on every node: without it a restart can fail to reconnect (pytorch/pytorch#135712)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# The process that started this one, recorded when this module is first imported: as early as the
# scripts can, after the standard library and torch (about 1.5 s into a process's life).
PARENT_AT_START = os.getppid()


def exit_promptly_on_signals(launcher: int | None) -> None:
    """End this process at once on SIGTERM or SIGINT, and on SIGTERM when `launcher` (the pid of
    torchrun's agent or of mp_spawn.py's parent) dies. None: started by hand, by no launcher.

    torchrun passes a SIGTERM or SIGINT it receives (Ctrl-C; Slurm and Kubernetes send SIGTERM
    before they preempt a job) on to its workers, and sends SIGKILL 30 s later (its
    --shutdown-timeout). A Python signal handler, such as the one that raises KeyboardInterrupt,
    runs only between bytecodes, so a worker blocked in a collective or in the rendezvous would
    wait out that time; the system's default action ends it at once. The one process that must
    not die mid-write, rank 0 with --checkpoint, takes the signals over (common.Checkpoints): its
    blocking calls are collectives with ranks that the same signal ends at once, so they fail at
    once and its handler runs. torchrun also starts each worker in a session of its own, so a
    `kill -9` of torchrun (or of mp_spawn.py) reaches no worker: orphans would train on, and rank 0
    save, beside the job that a relaunch starts. Linux's parent-death signal ends them. A launcher
    that died before the request was made is caught by its pid; for torchrun that is the parent
    recorded at import, so an agent killed in the first second or so of a worker's life can
    still leave it running, and its rank 0 holding the checkpoint's lock against a relaunch.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if launcher is not None and sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != launcher:  # it died before the request: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------------------------------
# Checkpoints


# Settings that a resumed run must share with the run that wrote the checkpoint: with any other
# value it would silently become a different experiment. The world size may change (an elastic
# job can restart with fewer nodes); that only earns a warning.
RESUME_MUST_MATCH = ("model", "train_size", "batch_size", "lr", "seed", "precision", "clip_grad_norm")


def run_config(args: argparse.Namespace, world_size: int) -> dict:
    """What a checkpoint records about the run that wrote it (plain types: weights_only can read them)."""
    return {name: getattr(args, name) for name in RESUME_MUST_MATCH} | {"world_size": world_size}


class Unusable(Exception):
    """A checkpoint that must not be trained from, and the one line that says why."""


class Checkpoints:
    """The checkpoint file of one job: every rank reads it at start, rank 0 alone writes it.

    Rank 0 holds an exclusive lock (flock) on PATH.lock while it runs. A second job started on
    the same path (a relaunch that meets the workers of a job still running, say) finds it taken
    and stops before it touches anything. The kernel drops the lock when its holder dies, however
    it dies, so no stale lock outlives a crash (the file may; it is reused).

    Rank 0 writes from a thread, from a CPU copy of the state, so that training goes on while the
    file is written. Written in the foreground, a write slower than --timeout (a large model, a
    slow network file system) would leave the other ranks waiting in their next all-reduce until
    the process group gave up. One write runs at a time; a newer state replaces one still waiting.
    """

    def __init__(self, path: str, rank: int) -> None:
        self.path, self.rank = path, rank
        # A symbolic link is written through to the file it names: os.replace on the link itself
        # would put a regular file in its place.
        self.target = os.path.realpath(path)
        self.lock_fd: int | None = None
        self.pending: tuple[dict, list[str]] | None = None  # (state, lines to print once it is saved)
        self.error: str | None = None
        self.closing = False
        self.writing = False  # a write, or the printing of its lines, is under way in the thread
        self.wakeup = threading.Condition()  # re-entrant: the signal handler may run inside save()
        self.thread: threading.Thread | None = None
        self.handlers = {}
        if rank == 0 and threading.current_thread() is threading.main_thread():
            self.handlers = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def load(self, map_location: torch.device, config: dict, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer) -> tuple[dict | None, str]:
        """Return (the checkpoint or None, what this rank found: a line that every rank must share).

        A missing file means a fresh start. A file that exists but cannot be used stops the run
        with one line and is left as it is: silently starting afresh would throw the training away.
        """
        try:
            self._check_path()
            if self.rank == 0:
                self._lock()
                tmp = f"{self.target}.tmp"
                if os.path.isdir(tmp) and not os.path.islink(tmp):  # a write leaves a file, never a folder
                    raise Unusable(f"{tmp} is a folder, not what a checkpoint write leaves: move it away, or pass "
                                   "another --checkpoint")
                if os.path.lexists(tmp):  # ours to remove only once we hold the lock
                    os.remove(tmp)  # the torn remains of a write that crashed
                    print_line(f"removed {tmp}, left by a checkpoint write that did not finish")
                self._try_to_write(tmp)
            if not os.path.exists(self.target):
                return None, "no checkpoint: a fresh start"
            checkpoint, digest = self._read(map_location)
            self._validate(checkpoint, config, model, optimizer)
        except Unusable as problem:
            return None, f"error: {problem}"
        return checkpoint, f"epoch {checkpoint['epoch']}, sha256 {digest[:16]}"

    def require_agreement(self, found_by_rank: list[str]) -> None:
        """Stop every rank, with the same line, unless every rank found the same thing."""
        for rank, found in enumerate(found_by_rank):
            if found.startswith("error: "):
                die(found.removeprefix("error: ") + ("" if rank == 0 else f" (seen by rank {rank})"))
        for rank, found in enumerate(found_by_rank):
            if found != found_by_rank[0]:
                die(f"rank {rank} finds {found} at {self.path}, rank 0 finds {found_by_rank[0]}: every rank must "
                    "see the same file (on several nodes, put it on storage that all of them share)")

    def save(self, state: dict, line: str) -> None:
        """Queue `state` to be written (rank 0 only) and return at once; `line` is printed once it is on disk."""
        if self.error:
            error, self.error = self.error, None  # said once: close() will not say it again
            die(error, code=1)
        state = _cpu_copy(state)  # training changes the tensors in place while the thread writes
        with self.wakeup:
            lines = self.pending[1] if self.pending else []
            self.pending = (state, [*lines, line])
            self.wakeup.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self._write_pending, name="checkpoint-writer", daemon=True)
            self.thread.start()

    def close(self) -> None:
        """Wait for the writes still to come, and release the lock."""
        with self.wakeup:
            self.closing = True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join()
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        self._unlock()
        if self.error:
            die(self.error, code=1)

    def _stop(self, signum: int, frame) -> NoReturn:
        """SIGTERM or SIGINT on rank 0: let the write in flight finish, then end as the signal would
        have ended the process. The state queued behind it, if any, is dropped with its lines."""
        for sig in self.handlers:
            signal.signal(sig, signal.SIG_IGN)  # one stop is enough; SIGKILL still ends it
        # Neither the lock nor join(): this handler may run inside save() or close(), while this
        # thread holds the lock that the writer takes between two writes.
        self.pending = None
        while self.writing:
            time.sleep(0.01)
        self._unlock()
        # torchrun also sends this when another worker died and it is about to restart them all.
        print_line(f"rank 0 stopped by {signal.Signals(signum).name}: every epoch printed above is saved in "
                   f"{self.path}, and the same command resumes from there")
        os._exit(128 + signum)

    def _write_pending(self) -> None:
        while True:
            with self.wakeup:
                while self.pending is None and not self.closing:
                    self.wakeup.wait()
                if self.pending is None:
                    return
                (state, lines), self.pending = self.pending, None
                self.writing = True
            try:
                save_checkpoint(state, self.target)
            except Exception as exc:  # a full disk, a folder removed: the previous checkpoint is still whole
                self.error = f"could not save checkpoint {self.path}: {getattr(exc, 'strerror', None) or exc}"
                self.writing = False
                return
            for line in lines:  # printed only now: after a crash and restart no epoch shows up twice
                print_line(line)
            self.writing = False

    def _check_path(self) -> None:
        folder = os.path.dirname(self.target)
        if not os.path.isdir(folder):
            raise Unusable(f"cannot write checkpoint {self.path}: {folder} is not a directory")
        if not os.access(folder, os.W_OK):
            raise Unusable(f"cannot write checkpoint {self.path}: {folder} is not writable")
        if os.path.isdir(self.target):
            raise Unusable(f"checkpoint {self.path} is a directory: name a file")
        if os.path.exists(self.target) and not os.path.isfile(self.target):
            raise Unusable(f"checkpoint {self.path} is not a regular file (a FIFO, a socket or a device): name a file")

    def _try_to_write(self, tmp: str) -> None:
        """Create and remove the temporary file now, rather than fail after an epoch of training
        (a full disk, a read-only mount, a quota)."""
        try:
            with open(tmp, "wb") as f:
                f.write(b"0" * 4096)
                f.flush()
                os.fsync(f.fileno())
            os.remove(tmp)
        except OSError as exc:
            if os.path.lexists(tmp):
                os.remove(tmp)
            raise Unusable(f"cannot write checkpoint {self.path}: {exc.strerror or exc}") from None

    def _lock(self) -> None:
        lock_path = f"{self.target}.lock"
        try:
            # O_NOFOLLOW: a symbolic link here would have us write into whatever file it names.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise Unusable(f"cannot lock checkpoint {self.path}: {lock_path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # The holder removes the file as it lets go; a lock won on a removed file is no lock.
            if os.fstat(fd).st_ino != os.stat(lock_path).st_ino:
                raise BlockingIOError
        except (BlockingIOError, FileNotFoundError):
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise Unusable(f"another job is using checkpoint {self.path} ({holder} holds {lock_path}): wait "
                           "for it to finish or stop it, or pass another --checkpoint") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        self.lock_fd = fd

    def _unlock(self) -> None:
        if self.lock_fd is not None:
            lock_path = f"{self.target}.lock"
            with contextlib.suppress(OSError):  # gone with its folder, or removed by hand
                if os.stat(lock_path).st_ino == os.fstat(self.lock_fd).st_ino:  # ours, not a newer job's
                    os.remove(lock_path)  # while still holding it: see _lock
            os.close(self.lock_fd)
            self.lock_fd = None

    def _read(self, map_location: torch.device) -> tuple[dict, str]:
        """torch.load with weights_only=True, each failure told in one line; and the file's sha256."""
        try:
            with open(self.target, "rb") as f:
                raw = f.read()  # read once: the checks and the load see the same bytes
        except OSError as exc:
            raise Unusable(f"cannot read checkpoint {self.path}: {exc.strerror}") from None
        try:
            is_zip = zipfile.is_zipfile(io.BytesIO(raw))
        except Exception:  # a damaged header fails in many ways
            is_zip = False
        if not is_zip:
            try:
                torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
            except Exception:
                raise Unusable(f"cannot read checkpoint {self.path}: not a file written by torch.save "
                               "(truncated, or another format)") from None
            raise Unusable(f"cannot use checkpoint {self.path}: torch.save wrote it in the format of torch "
                           "before 1.6, which has no checksums; load it and save it again")
        try:
            # torch.load does not check the CRC32 that torch.save stores for every record, so a
            # flipped bit inside a tensor would load as a silently different weight.
            record = zipfile.ZipFile(io.BytesIO(raw)).testzip()
            damaged = f"{record} fails its CRC check" if record else None
        except Exception as exc:  # a damaged directory fails in many ways: every one means damaged
            damaged = f"its directory cannot be read: {type(exc).__name__}"
        if damaged:
            raise Unusable(f"cannot read checkpoint {self.path}: its bytes were damaged after it was written "
                           f"({damaged})")
        try:
            # weights_only=True: a pickle can name any Python function to call while it loads, so a
            # crafted file would run code. This loader accepts tensors and plain containers only.
            checkpoint = torch.load(io.BytesIO(raw), map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            raise Unusable(f"refusing to load {self.path}: it holds Python objects other than tensors and plain "
                           "types, and unpickling them could run code") from None
        except Exception as exc:  # a damaged archive fails in many ways; every one means unusable
            raise Unusable(f"cannot read checkpoint {self.path}: {str(exc).splitlines()[0]}") from None
        return checkpoint, hashlib.sha256(raw).hexdigest()

    def _validate(self, checkpoint, config: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every field, by type and range, before anything is loaded into the model or optimizer."""
        def bad(field: str, problem: str) -> Unusable:
            return Unusable(f"{self.path} is not a usable checkpoint: its {field} {problem}")

        missing = {"model", "optimizer", "epoch", "config"} - set(checkpoint if isinstance(checkpoint, dict) else ())
        if missing:
            raise Unusable(f"{self.path} is not a checkpoint of these scripts: it lacks {', '.join(sorted(missing))}")
        epoch = checkpoint["epoch"]
        if type(epoch) is not int or epoch < 0:
            raise bad("epoch", f"is {epoch!r}, where a count of epochs done (an integer from 0) belongs")
        saved = checkpoint["config"]
        if isinstance(saved, dict) and "clip_grad_norm" not in saved:
            saved = {**saved, "clip_grad_norm": None}  # written before --clip_grad_norm existed: no clipping
        if not isinstance(saved, dict) or set(config) - set(saved):
            keys = sorted(set(config) - set(saved)) if isinstance(saved, dict) else sorted(config)
            raise bad("config", f"lacks {', '.join(keys)}")
        for name in RESUME_MUST_MATCH:
            if saved[name] != config[name]:
                then, now = ("off" if value is None else value for value in (saved[name], config[name]))
                raise Unusable(f"{self.path} was written with --{name} {then}, this run has --{name} {now}: "
                               "use the same value, or another --checkpoint path to start afresh")
        if type(saved["world_size"]) is not int or saved["world_size"] < 1:
            raise bad("config", f"has world_size {saved['world_size']!r}, where a positive integer belongs")
        weights = checkpoint["model"]
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise bad("model", "is not a state_dict of tensors")
        expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
        if {key: tuple(t.shape) for key, t in weights.items()} != expected:
            raise Unusable(f"{self.path} holds weights of another model: its parameters do not match "
                           f"--model {config['model']}")
        self._validate_optimizer(checkpoint["optimizer"], optimizer, config, bad)
        if self.rank == 0 and saved["world_size"] != config["world_size"]:
            print_line(f"warning: {self.path} was written by {saved['world_size']} ranks and this run has "
                       f"{config['world_size']}: the global batch changes from "
                       f"{saved['world_size'] * config['batch_size']} to {config['world_size'] * config['batch_size']} "
                       "samples, so the result will differ from an uninterrupted run")

    @staticmethod
    def _validate_optimizer(saved, optimizer: torch.optim.Optimizer, config: dict, bad) -> None:
        """The optimizer's state fits this model's parameter groups, at the run's learning rate."""
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if not isinstance(groups, list) or not isinstance(saved.get("state"), dict) \
                or not all(isinstance(group, dict) and isinstance(group.get("params"), list) for group in groups):
            raise bad("optimizer", "is not an optimizer's state_dict")
        # param_groups, not state_dict(): ZeroRedundancyOptimizer's state_dict() needs a collective first.
        if [len(group["params"]) for group in groups] != [len(group["params"]) for group in optimizer.param_groups]:
            raise bad("optimizer", "holds state for other parameters than this model's")
        for group in groups:
            if group.get("lr") != config["lr"]:
                raise bad("optimizer", f"has learning rate {group.get('lr')!r}, and the run --lr {config['lr']}")
        ids = {index for group in groups for index in group["params"]}
        if not set(saved["state"]) <= ids or not all(isinstance(v, dict) for v in saved["state"].values()):
            raise bad("optimizer", "holds state for parameters it does not list")


def all_finite(model: torch.nn.Module) -> bool:
    """Whether every parameter is finite (one synchronisation with the device, not one per tensor)."""
    return bool(torch.stack([param.isfinite().all() for param in model.parameters()]).all())


def _cpu_copy(value):
    """`value` with every tensor copied to the CPU (dicts and lists walked), so that nothing the
    training changes afterwards can reach the copy."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_cpu_copy(item) for item in value)
    return value


def save_checkpoint(state: dict, path: str) -> None:
    """Write to a temporary file, fsync it, then rename it over `path`: a crash mid-write leaves the
    previous checkpoint whole, never a torn file. A write that fails removes its temporary file."""
    tmp_path = f"{path}.tmp"
    try:
        with open(tmp_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints: a folder that every rank writes a file of (fsdp2.py)


MANIFEST = "manifest.json"
# What a save writes into its folder: DCP's shards and .metadata (through .metadata.tmp), and the manifest.
SAVED_NAMES = re.compile(r"__\d+_\d+\.distcp|\.metadata(\.tmp)?|manifest\.json")


def _not_a_save(path: str) -> str | None:
    """None if nothing is at `path`, or a folder that holds only what a save writes; else what is there."""
    if not os.path.lexists(path):
        return None
    if os.path.islink(path) or not os.path.isdir(path):
        return "something other than a folder"
    others = sorted(name for name in os.listdir(path) if not SAVED_NAMES.fullmatch(name))
    return f"{', '.join(others[:3])}{' and more' if len(others) > 3 else ''}" if others else None


class ShardedCheckpoints:
    """The checkpoint folder of one job: torch.distributed.checkpoint (DCP) has every rank write its
    own file there, and reads them back on any number of ranks.

    The guarantees of Checkpoints, for a folder. A missing checkpoint (or an empty folder) is a fresh
    start. One that cannot be used stops every rank with the same line before training, and nothing
    in it is changed. Rank 0 holds an exclusive lock (flock) on PATH.lock, which keeps a second job
    off the path; the file stays, and is reused. Every save goes to the folder PATH.tmp. Once every
    file is there, rank 0 writes manifest.json into it (each file's size and sha256, the epoch and
    the run's settings) and swaps it in with two renames, PATH to PATH.old and PATH.tmp to PATH: a
    crash between the two leaves no PATH but a whole PATH.old, which the next start puts back.
    Every file is checked against its sha256 before DCP reads any: DCP itself checks nothing, and
    loads a flipped byte as a changed weight. The check finds damage, not tampering: DCP unpickles
    .metadata (pickle.load) and the values that are not tensors (torch.load, weights_only=False), and
    unpickling can run code, so resume only from checkpoints that you wrote.
    """

    def __init__(self, path: str, rank: int, world_size: int) -> None:
        self.path, self.rank, self.world_size = path, rank, world_size
        self.target = os.path.realpath(path)  # behind a symbolic link, the folder that it names moves
        self.tmp, self.old = f"{self.target}.tmp", f"{self.target}.old"
        self.lock_fd: int | None = None
        self.problem: str | None = None  # what rank 0 found while it tidied
        self.manifest: dict | None = None

    def tidy(self) -> None:
        """Rank 0, before any rank looks at PATH: take the lock, put back a checkpoint that a save cut
        short had moved aside, and remove a save that did not finish."""
        try:
            folder = os.path.dirname(self.target)
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
                raise Unusable(f"cannot write checkpoint {self.path}: {folder} is not a writable directory")
            lock_path = f"{self.target}.lock"
            # O_NOFOLLOW: a symbolic link here would have us lock (and create) whatever file it names.
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise Unusable(f"another job is using checkpoint {self.path} (it holds {lock_path}): wait for it "
                               "to finish or stop it, or pass another --checkpoint") from None
            self.lock_fd = fd
            for leftover in (self.old, self.tmp):  # ours to move or remove only if they hold what a save writes
                foreign = _not_a_save(leftover)
                if foreign:
                    raise Unusable(f"{leftover} holds {foreign}, which no save of these scripts writes: move it "
                                   "away, or pass another --checkpoint")
            if not os.path.lexists(self.target) and os.path.isdir(self.old):
                os.rename(self.old, self.target)
                print_line(f"put back {self.target}, which a save that did not finish had moved to {self.old}")
            if os.path.lexists(self.tmp):
                _remove(self.tmp)
                print_line(f"removed {self.tmp}, left by a save that did not finish")
        except Unusable as problem:
            self.problem = str(problem)
        except OSError as exc:
            self.problem = f"cannot use checkpoint {self.path}: {exc.filename}: {exc.strerror}"

    def check(self, config: dict) -> str:
        """What this rank finds at PATH, in a line that every rank must share: a fresh start, the
        manifest's epoch and digest, or "error: " and why it cannot be used. Each rank hashes its
        share of the files, so that the check reads the checkpoint once in all, not once per rank."""
        try:
            if self.problem:
                raise Unusable(self.problem)
            if os.path.lexists(self.target) and not os.path.isdir(self.target):
                raise Unusable(f"checkpoint {self.path} is not a directory: here --checkpoint names a folder, "
                               "which every rank writes a file of")
            if not os.path.isdir(self.target) or not os.listdir(self.target):
                return "no checkpoint: a fresh start"
            manifest, digest = self._read_manifest(config)
            names = sorted(manifest["files"])
            for name in names[self.rank::self.world_size]:
                self._check_file(name, manifest["files"][name])
        except Unusable as problem:
            return f"error: {problem}"
        except OSError as exc:
            return f"error: cannot read checkpoint {self.path}: {exc.filename}: {exc.strerror}"
        self.manifest = manifest
        return f"epoch {manifest['epoch']} by {manifest['world_size']} ranks, manifest sha256 {digest[:16]}"

    def require_agreement(self, found_by_rank: list[str]) -> dict | None:
        """Stop every rank, with the same line, unless every rank found the same thing; return the
        manifest (None: a fresh start)."""
        for rank, found in enumerate(found_by_rank):
            if found.startswith("error: "):
                die(found.removeprefix("error: ") + ("" if rank == 0 else f" (found by rank {rank})"))
        for rank, found in enumerate(found_by_rank):
            if found != found_by_rank[0]:
                die(f"rank {rank} finds {found} at {self.path}, rank 0 finds {found_by_rank[0]}: every rank must "
                    "see the same folder (on several nodes, put it on storage that all of them share)")
        return self.manifest

    def hash_share(self, metadata) -> dict[str, dict]:
        """The size and sha256 of this rank's share of the files of the save in PATH.tmp: those that
        `metadata` (what dcp.save returned) names, and .metadata itself."""
        names = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
        return {name: _size_and_sha256(os.path.join(self.tmp, name)) for name in names[self.rank::self.world_size]}

    def commit(self, shares: list[dict], epoch: int, config: dict) -> None:
        """Rank 0: write the manifest into PATH.tmp, then swap PATH.tmp in for PATH."""
        manifest = {"epoch": epoch, "world_size": len(shares), "config": config,
                    "files": {name: entry for share in shares for name, entry in share.items()}}
        try:
            with open(os.path.join(self.tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            _fsync_folder(self.tmp)
            if os.path.isdir(self.old):  # left by a save cut short after its second rename: PATH is whole
                shutil.rmtree(self.old)
            if os.path.lexists(self.target):
                os.rename(self.target, self.old)
            os.rename(self.tmp, self.target)  # a crash just before: the next start puts PATH.old back
            _fsync_folder(os.path.dirname(self.target))
            shutil.rmtree(self.old, ignore_errors=True)
        except OSError as exc:
            die(f"could not save checkpoint {self.path}: {exc.strerror or exc} (the last one saved is whole)",
                code=1)

    def close(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the lock
            self.lock_fd = None

    def _read_manifest(self, config: dict) -> tuple[dict, str]:
        try:
            with open(os.path.join(self.target, MANIFEST), "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise Unusable(f"{self.path} holds no {MANIFEST}: it is not a checkpoint of these scripts, or its "
                           "save never finished") from None
        try:
            manifest = json.loads(raw)
            files, saved = manifest["files"], manifest["config"]
            usable = (type(manifest["epoch"]) is int and manifest["epoch"] >= 0
                      and type(manifest["world_size"]) is int and manifest["world_size"] >= 1
                      and isinstance(saved, dict) and set(config) <= set(saved) and isinstance(files, dict)
                      and ".metadata" in files and all(
                          name == os.path.basename(name) and name not in (".", "..") and isinstance(entry, dict)
                          and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int
                          for name, entry in files.items()))
        except (ValueError, KeyError, TypeError):  # not JSON, or not a dict where one belongs
            usable = False
        if not usable:
            raise Unusable(f"cannot use checkpoint {self.path}: its {MANIFEST} is damaged, or not one that "
                           "these scripts write")
        for name in config:
            if saved[name] != config[name]:
                then, now = ("off" if value is None else value for value in (saved[name], config[name]))
                raise Unusable(f"{self.path} was written with --{name} {then}, this run has --{name} {now}: "
                               "use the same value, or another --checkpoint path to start afresh")
        return manifest, hashlib.sha256(raw).hexdigest()

    def _check_file(self, name: str, entry: dict) -> None:
        kind = "shard" if name.endswith(".distcp") else "file"
        try:
            found = _size_and_sha256(os.path.join(self.target, name))
        except FileNotFoundError:
            raise Unusable(f"cannot use checkpoint {self.path}: its {kind} {name} is missing") from None
        if found["bytes"] != entry["bytes"]:
            raise Unusable(f"cannot use checkpoint {self.path}: its {kind} {name} holds {found['bytes']:,} bytes, "
                           f"not the {entry['bytes']:,} written (cut short after it was written)")
        if found["sha256"] != entry["sha256"]:
            raise Unusable(f"cannot use checkpoint {self.path}: its {kind} {name} fails its sha256 check "
                           "(damaged after it was written)")


def _size_and_sha256(path: str) -> dict:
    with open(path, "rb") as f:
        return {"bytes": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _fsync_folder(path: str) -> None:
    """Make the names in a folder durable (a rename, a new file), as fsync makes a file's bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
