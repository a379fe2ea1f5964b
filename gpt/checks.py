"""What train.py checks before any step (the layout, the data, OUT_DIR, --export) and at a save (the weights): a
ValueError, one line, and nothing trained or saved on bad input. What some ranks find is every rank's error
(agree): a host that cannot see the data stops the job with its cause, not with a closed connection elsewhere.

The order: what each rank can see alone (the arguments, the layout, the data's headers and sizes), agreed; the
same data on every rank, agreed; OUT_DIR made and tried; its lock (train.py); then the data read in full for
the id check. A refused job has written nothing but OUT_DIR, and one refused for a held lock has read no data.
"""
import argparse
import contextlib
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import data
import hf
import parallelize
from model import CONFIGS, GPTConfig


class JobError(ValueError):
    """An error that some ranks found, agreed by every rank (agree): `cause`, its line; `finders`, the ranks that
    found it; `where`, each rank's host and node (torchrun's agent)."""

    def __init__(self, cause: str, finders: list[int], where: list[str]) -> None:
        super().__init__(cause)
        self.cause, self.finders, self.where = cause, finders, where

    def who(self) -> str:
        """The ranks that found it, by host: "ranks 2, 3 on hostb (node 1)"."""
        hosts: dict[str, list[int]] = {}
        for rank in self.finders:
            hosts.setdefault(self.where[rank], []).append(rank)
        return " and ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on {host}"
                            for host, r in hosts.items())

    def lines(self, rank: int) -> tuple[str | None, str]:
        """(what this rank prints, or None; its line for torchrun). The cause is printed once, by the first rank
        that found it, with the ranks that found it unless every rank did; on each host, the first rank that found
        nothing says that it stopped for another. Every rank's line for torchrun names the cause: the agent's
        summary of its failed workers shows it, on every host."""
        if rank in self.finders:
            everyone = len(self.finders) == len(self.where)
            line = f"error: {self.cause}" + ("" if everyone else f" (found by {self.who()})")
            return (line if rank == self.finders[0] else None), line
        here = [r for r, host in enumerate(self.where) if host == self.where[rank] and r not in self.finders]
        return (f"stopped: {self.who()} found an error" if rank == here[0] else None), \
            f"stopped: {self.who()} found an error: {self.cause}"


class Parser(argparse.ArgumentParser):
    """argparse's, but a bad option is its one error line, without the usage before it (--help prints that),
    printed once under torchrun (by rank 0), and written to torchrun's error file, whose summary shows it in
    place of `error_file: <N/A>`. Exit 2, as argparse's."""

    def error(self, message: str):
        line = f"{self.prog}: error: {message}"
        if os.environ.get("RANK", "0") == "0":
            print(line, file=sys.stderr, flush=True)
        elastic_error(line)
        sys.exit(2)


def where() -> str:
    """This rank's host and node (torchrun's agent), as the lines name them."""
    return f"{socket.gethostname()} (node {os.environ.get('GROUP_RANK', '0')})"


def failure(error: BaseException, rank: int) -> str | None:
    """A rank's failure during the run (not agreed: its own exception, or a collective that failed on a peer's):
    noted in the job's store, where the first failure noted stays, before this rank's exit closes its connections.
    Returns the line to end with when another rank's failure came first (this one's is then its consequence: a
    closed connection), printed by one rank a host; None when this rank's is the first (the caller raises it,
    with its traceback). Either way torchrun's error file gets the line that names the first failure."""
    line = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    mine = json.dumps([rank, where(), line])
    # A collective that failed (a peer gone: killed, out of memory, its host lost, or failed itself) is a
    # consequence: it reads what a peer noted, and notes nothing (a rank killed by SIGKILL notes nothing either).
    consequence = isinstance(error, dist.DistError) or any(
        words in str(error) for words in ("Connection closed by peer", "Connection reset by peer", "Timed out"))
    try:
        first = note(mine, only_read=consequence)
        finder, host, cause = json.loads(first)
        said = first != mine and _store().add(f"stopped on {where()}", 1) == 1  # one line a host
    except Exception:  # no store to tell: this rank's own error, as Python prints it
        first, finder, host, cause, said = mine, rank, where(), line, False
    if consequence and first == mine:  # no rank noted one: this rank found nothing itself, and says so
        elastic_error(f"stopped: {line} (no rank noted a failure: a peer killed, stopped or hung, or its host lost)")
        print(f"stopped: a collective failed, and no rank noted a failure (a peer killed, stopped or hung, or its "
              f"host lost): {line}", file=sys.stderr, flush=True)
        return "stopped"
    if finder == rank:
        elastic_error(f"error: {cause} (rank {rank} on {host})")
        return None
    elastic_error(f"stopped: rank {finder} on {host} failed: {cause}")
    if said:
        print(f"stopped: rank {finder} on {host} failed: {cause}", file=sys.stderr, flush=True)
    return "stopped"


def elastic_error(line: str) -> None:
    """The line in torchrun's error file for this worker, which its summary prints in place of a traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as file:  # torch.distributed.elastic's format (ErrorHandler.record_exception)
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, file)


def _store() -> dist.Store:
    store = dist.distributed_c10d._get_default_store()  # private in torch 2.13: the group's own store
    store.set_timeout(timedelta(seconds=10))  # its host may be gone too: not its default minutes
    return store


def note(failure: str, only_read: bool = False) -> str:
    """The first failure noted in the job's store ([rank, where, line] as JSON): `failure`, where no rank's is yet
    (with only_read, it is not noted, and returned when none is)."""
    store = _store()
    if only_read:
        return store.get("failure").decode() if store.check(["failure"]) else failure
    return store.compare_set("failure", "", failure).decode()


def report(error: ValueError, rank: int) -> None:
    """An error's one line, as JobError.lines says (a plain ValueError: found alike by every rank, printed by rank
    0), and the line in torchrun's error file for this worker, which its summary prints in place of a traceback.
    A plain ValueError is noted in the job's store as well: where only this rank met it (not rank 0), its peers'
    next collective fails, and they name it from there (failure)."""
    line = f"error: {error}"
    if not isinstance(error, JobError):
        with contextlib.suppress(Exception):  # no group: nobody to tell
            note(json.dumps([rank, where(), f"ValueError: {error}"]))
    printed, line = error.lines(rank) if isinstance(error, JobError) else (line if rank == 0 else None, line)
    if printed:
        print(printed, file=sys.stderr, flush=True)
    elastic_error(line)


def agree(found: str | None) -> None:
    """Every rank calls it at the same point, with what it found wrong (one line) or None: if any rank found
    something, every rank raises the first such rank's cause as a JobError, naming every rank that found one."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (found, where()))
    finders = [rank for rank, (cause, _) in enumerate(every) if cause is not None]
    if finders:  # the first one's cause (others may have found others: they show once it is mended)
        raise JobError(every[finders[0]][0], finders, [host for _, host in every])


PER_HOST = ("data", "out_dir", "export", "init_from", "config")  # options whose paths another host may mount elsewhere


def arguments_and_data(args: argparse.Namespace, world_size: int) -> tuple[data.Tokens, GPTConfig]:
    """(the data, the model's config), once every rank has looked at what it can see alone: the layout against
    the model, and the data's files (their headers and sizes, none read in full), the same on every rank."""
    tokens = config = found = mine = None
    try:
        tokens = data.load(args.data, args.vocab_size, args.data_dtype)
        # the shape: --model's, else --init_from's (its config.json), else tiny's; both: they must agree (hf.check)
        shape = hf.shape(args.init_from) if not args.model else CONFIGS[args.model]
        config = GPTConfig(vocab_size=tokens.vocab_size, seq_len=args.seq_len, **shape)
        if args.init_from:
            hf.check(args.init_from, config, args.model)  # its config.json and files: the weights read after the lock
        parallelize.check_layout(args, config, world_size)
        data.check(tokens, args.seq_len)
        # The same files on every rank (a host whose copy differs, or lacks a shard, would train on other
        # tokens): each rank's files' names, sizes and first and last bytes, compared with rank 0's below.
        mine = data.fingerprint(tokens)
    except ValueError as error:
        found = str(error)
    except OSError as error:  # a file this rank may not read
        found = f"--data {error.filename or args.data}: {error.strerror}"
    except Exception as error:  # anything else, said by the rank that met it: never a rank left out of agree
        found = f"{type(error).__name__}: {error}"
    agree(found)
    # The same options on every rank (each node's torchrun passes its own command line: one that differs, as
    # another --lr or --max_steps, would train another schedule or hang at a collective that the others skip),
    # paths aside (each host may mount them elsewhere: --data's files are compared, OUT_DIR is tried).
    options = {name: value for name, value in vars(args).items() if name not in PER_HOST}
    first = [mine, options]
    dist.broadcast_object_list(first, src=0)
    differ = [f"--{name} {value} where rank 0 has {first[1].get(name)}" for name, value in options.items()
              if value != first[1].get(name)]
    agree(f"every rank must be given the same options: {'; '.join(differ)}" if differ else
          None if mine == first[0] else f"--data {args.data}: {data.difference(mine, first[0])}")
    return tokens, config


def same_config(saved: dict | None, config: GPTConfig) -> bool:
    """Whether a checkpoint's config is the run's (one written before a field was added: that field's default)."""
    try:
        return GPTConfig(**saved) == config
    except (TypeError, ValueError):
        return False


def out_dir(args: argparse.Namespace, rank: int) -> None:
    """OUT_DIR made, and tried: rank 0 makes it and writes a file there, which every rank must see (DCP writes
    each rank's shard into one folder, so OUT_DIR must be one that every rank shares: on several nodes, a shared
    file system); --export's path and --tensorboard's folder tried too."""
    problem = [None, None]  # (what is wrong, the file rank 0 wrote)
    if rank == 0:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            if os.path.exists(os.path.join(args.out_dir, "metrics.jsonl")):  # a resume's: appended to
                open(os.path.join(args.out_dir, "metrics.jsonl"), "a").close()
            problem[1] = os.path.join(args.out_dir, f".probe-{os.urandom(6).hex()}")  # this job's alone
            open(problem[1], "w").close()  # the folder takes new files
        except OSError as error:
            problem[0] = f"{error.filename}: {error.strerror}"
        if args.export and not problem[0]:  # a file of its own beside it (never export()'s .tmp: another job's)
            try:
                if os.path.isdir(args.export):
                    raise IsADirectoryError(21, "is a folder")
                probe = os.path.join(os.path.dirname(args.export) or ".", f".probe-{os.urandom(6).hex()}")
                open(probe, "wb").close()
                os.remove(probe)
            except OSError as error:  # said of --export's path: the file it would write
                problem[0] = f"{args.export}: {error.strerror}"
        if isinstance(args.tensorboard, str) and not problem[0]:  # its own folder: made and tried now, not at step 1
            try:
                os.makedirs(args.tensorboard, exist_ok=True)
                probe = os.path.join(args.tensorboard, f".probe-{os.urandom(6).hex()}")
                open(probe, "wb").close()
                os.remove(probe)
            except OSError as error:
                problem[0] = f"--tensorboard {args.tensorboard}: {error.strerror}"
        if problem[0] and problem[1]:
            with contextlib.suppress(OSError):
                os.remove(problem[1])
    dist.broadcast_object_list(problem, src=0)  # rank 0's probe, which every rank looks for below
    agree(problem[0] if rank == 0 else None)  # rank 0's finding: named as such on every host
    seen = os.path.exists(problem[1])
    try:
        agree(None if seen else f"--out_dir {args.out_dir}: the file that rank 0 wrote there is not seen: "
                                "checkpoints need a folder that every rank shares")
    finally:  # after it every rank has looked: rank 0 may remove the file (another job's lock() may have)
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.remove(problem[1])


def token_ids(args: argparse.Namespace, tokens: data.Tokens, rank: int, world_size: int,
              device: torch.device) -> None:
    """Every token id must fit the vocab: an embedding fed one that does not fails with a cryptic device-side
    error, possibly hours in. The ranks read a share of each file each, and each rank that finds one outside
    says so (agree); once per OUT_DIR and file: its largest id is kept there for the next start, which reads
    only a file changed since (data.remembered). Called once OUT_DIR is this job's (its lock taken)."""
    if not tokens.files:  # synthetic: its ids are below its vocab by construction
        return
    # Rank 0's view of the kept ids decides for every rank: all then read the same files and join the same
    # collectives, or none does (a rank that judged alone could skip them and hang the others).
    kept = [data.remembered(args.out_dir, tokens.files) if rank == 0 else None]
    dist.broadcast_object_list(kept, src=0)
    largest = kept[0]
    unread = [i for i, n in enumerate(largest) if n is None]
    if not unread:
        return
    mine, found = [], None
    try:
        mine = [data.largest_id(tokens.files[i].tokens, rank, world_size) for i in unread]
    except OSError as error:  # a read that fails here: a damaged disk, a vanished mount
        found = f"--data {args.data}: {error.strerror} while reading its ids"
    bad = [(n, tokens.files[i].path) for i, n in zip(unread, mine, strict=False) if n >= tokens.vocab_size]
    if bad:
        n, path = max(bad)
        found = (f"--data {path}: token id {n} is outside the vocab of {tokens.vocab_size}: set --vocab_size"
                 + (", or --data_dtype uint32 if the files hold uint32 ids"
                    if any(f.format == "raw uint16" for f in tokens.files) else ""))
    agree(found)
    every = torch.tensor(mine, device=device)
    dist.all_reduce(every, op=dist.ReduceOp.MAX)  # each rank read a share of each file
    for i, n in zip(unread, every.tolist(), strict=True):
        largest[i] = n
    if rank == 0:  # no collective here
        try:
            data.remember(args.out_dir, tokens.files, largest)
        except OSError as error:  # costs the next start a read of the data, nothing more
            print(f"the data's check is not kept in {args.out_dir}: {error}", flush=True)


def weights_are_finite(parameters) -> bool:
    """Whether every rank's weights (its shards, under FSDP) are finite: one all-reduce. A finite loss
    and gradient can still step the weights to inf or nan (a huge lr or weight decay)."""
    flag = torch.stack([torch.isfinite(p.to_local() if isinstance(p, DTensor) else p).all()
                        for p in parameters]).all().to(torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
