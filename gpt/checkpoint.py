"""Sharded, asynchronous checkpoints that are whole or absent, and the lock that keeps one job per folder.

OUT_DIR/step_00000100/ is one checkpoint: torch.distributed.checkpoint (DCP) files, each rank
writing its own shard, and manifest.json, written last, with each file's size and sha256 and what
a resume needs besides tensors (the step, the scaler, the model's config, the schedule). A save
is written into step_N.tmp/ in a background thread (dcp.async_save: training goes on), then
renamed: a folder without .tmp is whole. The last --keep are kept. What stays on the training path is
the copy of this rank's tensors to CPU memory (under ddp the whole replica on every rank, under
fsdp and hsdp its shard), into buffers kept from save to save (on CUDA pinned, so the copy runs at
the link's speed and one sync ends it), not fresh memory each time as async_save's default.

A resume reads the newest whole checkpoint. DCP reshards: a checkpoint written by 2 ranks under
ddp loads at 3 ranks under fsdp. Before loading, the ranks share out the manifest's files and
check each one's size and sha256, so a damaged or missing shard is one line, not a wrong model.

The waits that can outlast a training collective (a save's gather of results, the check before
a load) run on a gloo group of their own with its own timeout: under nccl, `barrier(timeout=)`
is not honoured, and async_save needs a CPU backend anyway.
"""
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

MANIFEST = "manifest.json"
NAME = re.compile(r"^step_(\d{8})$")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def reason(error: BaseException, rank: int) -> str:
    """One line for why a save failed. DCP's CheckpointException holds every rank's error: a disk's
    (an OSError) first, as a rank that lost its peer only says the connection closed."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (error, _) = min(error.failures.items(), key=lambda item: not isinstance(item[1][0], OSError))
    return f"rank {rank}: {type(error).__name__}: {error}"


def check_manifest(manifest: dict, step: int) -> None:
    """A ValueError unless the manifest has the fields and types that save() writes."""
    fields = {"step": int, "config": dict, "run": dict, "files": dict}
    for name, kind in fields.items():
        if not isinstance(manifest.get(name), kind):
            raise ValueError(f"its field {name!r} is missing or not a {kind.__name__}")
    if manifest["step"] != step or "scaler" not in manifest:
        raise ValueError(f"it says step {manifest['step']!r} in the folder of step {step}, or has no 'scaler'")
    for name, entry in manifest["files"].items():
        if os.path.basename(name) != name or not isinstance(entry, dict) or not isinstance(entry.get("size"), int) \
                or not isinstance(entry.get("sha256"), str):
            raise ValueError(f"its entry for {name!r} is not a file name with a size and a sha256")


class Checkpoints:
    def __init__(self, out_dir: str, rank: int, world_size: int, keep: int, timeout: float) -> None:
        self.out_dir, self.rank, self.world_size, self.keep = out_dir, rank, world_size, keep
        # waits that may outlast a training collective: gloo honours this timeout, nccl's barrier would not
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self.pending: tuple[Future, int] | None = None  # (the commit in flight, its step)
        self.lock_fd: int | None = None
        # The CPU copies of the tensors, made once and refilled at each save (DCP caches them by the source's
        # storage), pinned on CUDA with non-blocking copies; synchronous, as the next step changes the weights.
        # Reusing them is safe: a save waits for the one before (save()) before refilling them.
        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=cuda))

    # -- the lock --------------------------------------------------------------------------------

    def lock(self) -> str | None:
        """Rank 0 takes OUT_DIR/lock for the life of the job; every rank learns the verdict. Returns a
        line to print where the file system has no locks (the job goes on); raises if another job
        holds it."""
        verdict = [None, None]  # (error, warning)
        if self.rank == 0:
            self.lock_fd = os.open(os.path.join(self.out_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                verdict[0] = f"{self.out_dir} is in use by another job (it holds {self.out_dir}/lock)"
            except OSError as error:
                if error.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
                    raise
                verdict[1] = (f"no lock on {self.out_dir}: its file system does not support flock "
                              f"({errno.errorcode[error.errno]}); make sure no other job writes there")
            if verdict == [None, None]:  # ours alone: what a killed job's saves and checks left goes
                for name in os.listdir(self.out_dir):
                    if (name.endswith(".tmp") and NAME.match(name.removesuffix(".tmp"))) or name.startswith(".probe-"):
                        remove(os.path.join(self.out_dir, name))
        dist.broadcast_object_list(verdict, src=0, group=self.group)  # every rank stops alike, or none
        if verdict[0]:
            raise ValueError(verdict[0])
        return verdict[1]

    # -- saving ----------------------------------------------------------------------------------

    def save(self, state: dict, step: int, extra: dict) -> None:
        """Start writing `state` (DCP's state dicts) as step `step`; return once it is copied off
        the training path. `extra` (plain types) goes into the manifest. One save in flight at a
        time: this waits for the one before."""
        self.wait()
        folder = os.path.join(self.out_dir, f"step_{step:08d}")
        future = dcp.async_save(state, checkpoint_id=folder + ".tmp", process_group=self.group,
                                async_stager=self.stager)
        self.pending = self.executor.submit(self._commit, future, folder, {"step": step, **extra}), step

    def _commit(self, future: Future, folder: str, extra: dict) -> None:
        """In the background: once every rank's shard is written, each hashes its own files, rank 0
        writes the manifest and renames the folder into place, and drops the oldest."""
        tmp = folder + ".tmp"
        try:
            future.result()
            mine = {name: {"size": os.path.getsize(os.path.join(tmp, name)),
                           "sha256": sha256(os.path.join(tmp, name))}
                    for name in os.listdir(tmp) if name.startswith(f"__{self.rank}_") or
                    (self.rank == 0 and name == ".metadata")}
        except (Exception, CheckpointException) as error:  # DCP's is a BaseException, with every rank's errors
            mine = reason(error, self.rank)  # told to every rank below, so that all stop with the same line
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self.group)
        failed = sorted((not re.search(r"\[Errno \d+\]", part), part) for part in everyone
                        if isinstance(part, str))  # an OSError (a disk's) first
        if failed:
            last = self.committed()
            raise ValueError(f"the checkpoint of step {extra['step']} could not be saved ({failed[0][1]}); "
                             + (f"{last[-1]} and those before it are whole" if last else "no checkpoint was saved"))
        if self.rank == 0:
            files = {name: entry for part in everyone for name, entry in part.items()}
            with open(os.path.join(tmp, MANIFEST), "w") as file:
                json.dump({**extra, "files": files}, file, indent=1)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, folder)  # the commit: a folder without .tmp is whole
            for old in self.committed()[:-self.keep]:
                remove(os.path.join(self.out_dir, old))
        dist.barrier(group=self.group)

    def wait(self) -> None:
        """Until the save in flight is committed. Its failure (a full disk, a folder gone) raises here,
        as one line: every checkpoint before it is whole, and its .tmp folder goes at the next start."""
        if self.pending is not None:
            (pending, step), self.pending = self.pending, None
            try:
                pending.result()
            except ValueError:  # _commit's own line, the same on every rank
                raise
            except (Exception, CheckpointException) as error:  # after the gather: rank 0's manifest, a lost peer
                raise ValueError(f"the checkpoint of step {step} could not be saved ({reason(error, self.rank)})") \
                    from error

    # -- loading ---------------------------------------------------------------------------------

    def committed(self) -> list[str]:
        """The checkpoints' folder names, oldest first: whole, unless something outside this job
        damaged one (newest() checks before a load)."""
        names = os.listdir(self.out_dir) if os.path.isdir(self.out_dir) else []
        return sorted(n for n in names if NAME.match(n))

    def newest(self) -> tuple[str, dict] | None:
        """(folder, manifest) of the newest whole checkpoint, or None. Every rank agrees on which
        (rank 0's view of a shared folder), and the ranks check its files between them."""
        newest = [self.committed()[-1] if self.committed() else None]
        dist.broadcast_object_list(newest, src=0, group=self.group)
        if newest[0] is None:
            return None
        folder, problems, manifest = os.path.join(self.out_dir, newest[0]), [], {}
        try:
            with open(os.path.join(folder, MANIFEST)) as file:
                manifest = json.load(file)
            check_manifest(manifest, int(NAME.match(newest[0])[1]))
            files = sorted(manifest["files"])
            problems += [f"{name} is not in its manifest" for name in sorted(set(os.listdir(folder)) - {MANIFEST}
                                                                              - set(files))][:1]
            for name in files[self.rank::self.world_size]:
                path, entry = os.path.join(folder, name), manifest["files"][name]
                if not os.path.isfile(path):
                    problems.append(f"{name} is missing")
                elif os.path.getsize(path) != entry["size"] or sha256(path) != entry["sha256"]:
                    problems.append(f"{name} is damaged: its size or sha256 is not the manifest's")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            problems.append(f"its {MANIFEST} cannot be read ({type(error).__name__}: {error})")
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, problems, group=self.group)
        found = [p for part in everyone for p in part]
        if found:
            raise ValueError(f"checkpoint {folder}: {found[0]}; move the folder aside to resume from the one before")
        return folder, manifest

    def load(self, folder: str, state: dict) -> None:
        """Read the checkpoint into `state` in place: DCP reads the pieces of each tensor that this
        rank holds, whatever the world size or layout that wrote it. A checkpoint without a name this run
        loads (an older train.py's, which saved the optimizer's state nested, not by name) is one line."""
        try:
            dcp.load(state, checkpoint_id=folder, process_group=self.group)
        except (RuntimeError, CheckpointException) as error:  # DCP's planner: "Missing key in checkpoint state_dict"
            said = reason(error, self.rank)
            if "Missing key in checkpoint" not in said:
                raise
            raise ValueError(f"checkpoint {folder}: {said}; written by an older train.py or another program: move "
                             "the folder aside to start afresh, or resume it with the train.py that wrote it") from None

    def close(self) -> None:
        self.wait()
        self.executor.shutdown()
        self.stager.close()  # frees (and unpins) the copies
        if self.lock_fd is not None:
            os.close(self.lock_fd)
