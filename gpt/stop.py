"""Stopping on a signal: every rank agrees after the same step, so all save it and the same command resumes.

gpt/train.py calls StopRequest.agreed() after every step; gpt/bench.py --stop_agreement measures what it costs.
"""
import contextlib
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist


class StopRequest:
    """SIGTERM (a preemption: Slurm and Kubernetes send it first, and torchrun passes it on to its
    workers, then kills them 30 s later), SIGINT or SIGHUP (a closed terminal or ssh session; torchrun
    passes it on too), noted by a handler and agreed by every rank at a step boundary, so that all
    stop after the same step and save it. A worker often gets the signal twice (from Slurm and from
    torchrun; Linux's parent-death signal once per re-parenting): the second changes nothing.
    `kill -9` is the way to stop without saving.

    The agreement costs no round trip per step. One all-reduce (max) carries each rank's signal and
    how many steps it proposes until the next agreement (about SECONDS of its steps, at most twice
    the last interval and MAX_STEPS; the fewest proposed wins); it starts at one agreement and is
    read at the next, by when it has long arrived. Every rank reads the same numbers, so all agree
    after the same steps and stop after the same one, at most two intervals after a signal: about
    2 s of steps (two steps, where a step takes longer), inside torchrun's 30 s. A pause that could
    outlast that, an evaluation, is followed by now(), a blocking agreement.
    `blocking=True` is the old way, an all-reduce waited for after every step (gpt/bench.py compares)."""

    SECONDS, MAX_STEPS = 1.0, 100

    def __init__(self, timeout: float | None, blocking: bool = False) -> None:
        self.signal, self.number, self.name, self.blocking = 0, 0, None, blocking
        # A CPU flag: no device sync; not the checkpoint thread's group. new_group's timeout is not the world
        # group's but the backend's default (30 minutes for gloo): a vanished host would stall the job that long.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout) if timeout else None)
        self.interval = self.steps_left = 1  # the first agreement: after the first step
        self.since = time.perf_counter()
        self.sent = None if blocking else self.send(1)
        # A signal ignored when the run starts stays ignored: under nohup, SIGHUP.
        self.previous = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
                         if signal.getsignal(sig) is not signal.SIG_IGN}

    def handle(self, signum: int, frame) -> None:
        self.signal = self.signal or signum

    def send(self, steps: int) -> tuple[torch.Tensor, dist.Work]:
        flag = torch.tensor([self.signal, -steps], dtype=torch.int64)  # max: any rank's signal, the fewest steps
        return flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def agreed(self) -> bool:
        """Whether every rank stops after this step: every rank calls it once after every step."""
        if self.blocking:
            flag, work = self.send(1)
            work.wait()
        else:
            self.steps_left -= 1
            if self.steps_left:
                return False
            flag, work = self.sent
            work.wait()  # started an interval ago: long done, unless a rank lags (it waits, as any collective would)
            now = time.perf_counter()
            pace, self.since = (now - self.since) / self.interval, now  # this rank's seconds per step, lately
            # at most twice the last interval: a pace measured over few steps (a GPU's host runs ahead) errs little
            proposal = max(1, min(self.MAX_STEPS, 2 * self.interval, int(self.SECONDS / max(pace, 1e-6))))
            self.interval = self.steps_left = int(-flag[1])  # proposed an interval ago: the same on every rank
            self.sent = self.send(proposal)
        return self.said(flag)

    def now(self) -> bool:
        """Whether every rank stops after this step, agreed at once (a blocking all-reduce, on the same
        group: every rank's ops run in the order they were issued): after an evaluation, whose time could
        otherwise stretch the wait for the next agreement past torchrun's 30 s."""
        flag = torch.tensor([self.signal], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return self.said(flag)

    def said(self, flag: torch.Tensor) -> bool:
        self.number = int(flag[0])
        self.name = signal.Signals(self.number).name if self.number else None
        return bool(self.number)

    def restore(self) -> None:
        """The all-reduce in flight finished (every rank started it), then the handlers as they were."""
        if self.sent is not None:
            with contextlib.suppress(Exception):  # a peer that died: gloo has already failed the work
                self.sent[1].wait()
            self.sent = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
