"""Plumbing that the training scripts share and that is not the DDP lesson.

Argument checks, a free port, the store that a restarted torchrun job meets at, signals, and
checkpoints: one job per file, written in the background and atomically, loaded only when whole.
Every distributed call (init_process_group, DDP, DistributedSampler, all_reduce, ...) stays in the
scripts, where the reader can see it.
"""
import argparse
import ctypes
import errno
import fcntl
import hashlib
import io
import os
import pickle
import signal
import socket
import sys
import threading
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
    sys.exit(code)


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
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """The knobs that every training script takes, with defaults that run in seconds on a CPU."""
    parser.add_argument("--max_epochs", type=positive_int, default=10, help="epochs to train in all")
    parser.add_argument("--batch_size", type=positive_int, default=32, help="samples per step on each rank")
    parser.add_argument("--lr", type=positive_float, default=0.005, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the model's weights and the shuffle")
    parser.add_argument("--model", choices=sorted(MODELS), default="mlp", help="which model from model.py")
    parser.add_argument("--train_size", type=positive_int, default=data.TRAIN_SIZE, help="training samples")
    parser.add_argument("--val_size", type=positive_int, default=data.VAL_SIZE, help="validation samples")
    parser.add_argument(
        "--timeout", type=positive_float, default=120.0,
        help="seconds a collective waits for a peer before the process group gives up",
    )
    parser.add_argument(
        "--checkpoint", default=None, metavar="PATH",
        help="after every epoch rank 0 saves here; if the file exists at start, training resumes from it",
    )


def reject_old_launcher_flag(parser: argparse.ArgumentParser) -> None:
    """python -m torch.distributed.launch without --use-env appends --local-rank=N to the arguments.
    Say what to do about it, rather than argparse's bare "unrecognized arguments"."""

    class Reject(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is what python -m torch.distributed.launch passes without --use-env; "
                         "start this script with torchrun, or add --use-env (it reads LOCAL_RANK from the environment)")

    parser.add_argument("--local-rank", "--local_rank", action=Reject, help=argparse.SUPPRESS)


def check_world_size(world_size: int, args: argparse.Namespace) -> None:
    if world_size > args.train_size:
        die(f"{world_size} ranks but only {args.train_size} training samples: every rank needs at least one")


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
        if exc.errno != errno.EADDRINUSE:
            raise
        die(f"port {port} on 127.0.0.1 is already in use: pass --port 0 to let the system pick a free one, "
            "or name another")
    sock.listen()
    return sock


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


def exit_promptly_on_signals() -> None:
    """End this process at once on SIGTERM or SIGINT, and on SIGTERM when its parent dies.

    torchrun passes a SIGTERM or SIGINT it receives (Ctrl-C; Slurm and Kubernetes send SIGTERM
    before they preempt a job) on to its workers, and sends SIGKILL 30 s later (its
    --shutdown-timeout). A Python signal handler, such as the one that raises KeyboardInterrupt,
    runs only between bytecodes, so a worker blocked in a collective or in the rendezvous would
    wait out that time; the system's default action ends it at once. The one process that must
    not die mid-write, rank 0 with a checkpoint write in flight, takes the signals over while it
    runs (common.Checkpoints). torchrun also starts each worker in a session of its own, so a
    `kill -9` of torchrun (or of mp_spawn.py) reaches no worker: orphans would train on, and rank 0
    save, beside the job that a relaunch starts. Linux's parent-death signal ends them.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform == "linux":
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before the prctl: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)


# ---------------------------------------------------------------------------------------------
# Checkpoints


# Settings that a resumed run must share with the run that wrote the checkpoint: with any other
# value it would silently become a different experiment. The world size may change (an elastic
# job can restart with fewer nodes); that only earns a warning.
RESUME_MUST_MATCH = ("model", "train_size", "batch_size", "lr", "seed")


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
        self.lock_fd: int | None = None
        self.pending: tuple[dict, list[str]] | None = None  # (state, lines to print once it is saved)
        self.error: str | None = None
        self.closing = False
        self.wakeup = threading.Condition()  # re-entrant: the signal handler may run inside save()
        self.thread: threading.Thread | None = None
        self.handlers = {}
        if rank == 0 and threading.current_thread() is threading.main_thread():
            self.handlers = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGINT, signal.SIGTERM)}

    def load(self, map_location: torch.device, config: dict, model: torch.nn.Module) -> tuple[dict | None, str]:
        """Return (the checkpoint or None, what this rank found: a line that every rank must share).

        A missing file means a fresh start. A file that exists but cannot be used stops the run
        with one line and is left as it is: silently starting afresh would throw the training away.
        """
        try:
            self._check_folder()
            if self.rank == 0:
                self._lock()
                if os.path.exists(f"{self.path}.tmp"):  # ours to remove only once we hold the lock
                    os.remove(f"{self.path}.tmp")  # the torn remains of a write that crashed
                    print_line(f"removed {self.path}.tmp, left by a checkpoint write that did not finish")
            if not os.path.exists(self.path):
                return None, "no checkpoint: a fresh start"
            checkpoint, digest = self._read(map_location)
            self._validate(checkpoint, config, model)
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
            die(self.error, code=1)
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
        with self.wakeup:
            self.pending, self.closing = None, True
            self.wakeup.notify()
        if self.thread is not None:
            self.thread.join()
        self._unlock()
        print_line(f"stopped by {signal.Signals(signum).name}: every epoch printed above is saved in {self.path}; "
                   "run the same command to resume")
        os._exit(128 + signum)

    def _write_pending(self) -> None:
        while True:
            with self.wakeup:
                while self.pending is None and not self.closing:
                    self.wakeup.wait()
                if self.pending is None:
                    return
                (state, lines), self.pending = self.pending, None
            try:
                save_checkpoint(state, self.path)
            except Exception as exc:  # a full disk, a folder removed: the previous checkpoint is still whole
                self.error = f"could not save checkpoint {self.path}: {getattr(exc, 'strerror', None) or exc}"
                return
            for line in lines:  # printed only now: after a crash and restart no epoch shows up twice
                print_line(line)

    def _check_folder(self) -> None:
        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise Unusable(f"cannot write checkpoint {self.path}: {folder} is not a directory")
        if not os.access(folder, os.W_OK):
            raise Unusable(f"cannot write checkpoint {self.path}: {folder} is not writable")

    def _lock(self) -> None:
        lock_path = f"{self.path}.lock"
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
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
            os.remove(f"{self.path}.lock")  # while still holding it: see _lock
            os.close(self.lock_fd)
            self.lock_fd = None

    def _read(self, map_location: torch.device) -> tuple[dict, str]:
        """torch.load with weights_only=True, each failure told in one line; and the file's sha256."""
        with open(self.path, "rb") as f:
            raw = f.read()  # read once: the checks and the load see the same bytes
        if not zipfile.is_zipfile(io.BytesIO(raw)):
            raise Unusable(f"cannot read checkpoint {self.path}: not a file written by torch.save "
                           "(truncated, or another format)")
        try:
            # torch.load does not check the CRC32 that torch.save stores for every record, so a
            # flipped bit inside a tensor would load as a silently different weight.
            damaged = zipfile.ZipFile(io.BytesIO(raw)).testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            damaged = str(exc)
        if damaged:
            raise Unusable(f"cannot read checkpoint {self.path}: its bytes were damaged after it was written "
                           f"({damaged} fails its CRC check)")
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

    def _validate(self, checkpoint: dict, config: dict, model: torch.nn.Module) -> None:
        missing = {"model", "optimizer", "epoch", "config"} - set(checkpoint if isinstance(checkpoint, dict) else ())
        if missing:
            raise Unusable(f"{self.path} is not a checkpoint of these scripts: it lacks {', '.join(sorted(missing))}")
        for name in RESUME_MUST_MATCH:
            saved, now = checkpoint["config"].get(name), config[name]
            if saved != now:
                raise Unusable(f"{self.path} was written with --{name} {saved}, this run has --{name} {now}: "
                               f"use the same value, or another --checkpoint path to start afresh")
        expected = {key: tuple(t.shape) for key, t in model.state_dict().items()}
        saved_shapes = {key: tuple(t.shape) for key, t in checkpoint["model"].items()}
        if saved_shapes != expected:
            raise Unusable(f"{self.path} holds weights of another model: its parameters do not match "
                           f"--model {config['model']}")
        saved_world = checkpoint["config"]["world_size"]
        if self.rank == 0 and saved_world != config["world_size"]:
            print_line(f"warning: {self.path} was written by {saved_world} ranks and this run has "
                       f"{config['world_size']}: the global batch changes from {saved_world * config['batch_size']} "
                       f"to {config['world_size'] * config['batch_size']} samples, so the result will differ from "
                       "an uninterrupted run")


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
