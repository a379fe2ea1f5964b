"""Keep training when a replica dies: per-step fault tolerance with torchft, on a CPU (docs/fault_tolerance.md).

singlenode_cpu.py's model and data, trained by replica groups that torchft coordinates: a lighthouse decides,
step by step, which replicas are alive (the quorum); each replica's Manager averages the gradients over those
alone and takes the step only where that all-reduce went through; a replica that comes back heals, copying
the weights and the optimizer's state from a live peer, and trains on. Nobody stops for it.

    python fault_tolerance.py --replicas 2 --steps 60 --kill 1:10   # replica 1 dies at step 10, comes back
    python fault_tolerance.py --replicas 3 --steps 12 --diloco 4    # DiLoCo: all-reduces every 4th step only

This process starts the lighthouse (loopback, a free port) and a process per replica group, starts a killed
one again, and stops them all at the end; --replica_id and --lighthouse run one replica alone, on this host,
against a lighthouse started apart (`torchft_lighthouse --min_replicas 1`). A cluster's way: docs/.
"""
import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from data import make_datasets
from model import build_model

os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers (Rust) log every quorum at info
try:
    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo
    from torchft.optim import OptimizerWrapper
except ImportError:
    sys.exit("error: torchft is not installed: pip install -r requirements-torchft.txt")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2, help="replica groups (a process each here)")
    p.add_argument("--steps", type=int, default=60, help="steps to train (committed ones; --diloco: inner ones)")
    p.add_argument("--batch_size", type=int, default=32, help="samples per replica per step")
    p.add_argument("--lr", type=float, default=0.005, help="Adam's learning rate (DiLoCo: the inner optimizer's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of each step's batch")
    p.add_argument("--kill", help="R:S: replica R SIGKILLs itself as step S starts, and is started again; "
                                  "R:S:mid: in step S, after its quorum, before its all-reduce")
    p.add_argument("--step_time", type=float, default=0.25, help="seconds each step also sleeps, as if computing: "
                                                                 "time for a restarted replica to come back")
    p.add_argument("--diloco", type=int, metavar="H", help="DiLoCo: H local steps, then an outer step")
    p.add_argument("--out_dir", help="each replica saves its final weights here, replica_R.pt (one launcher a folder)")
    p.add_argument("--lighthouse_port", type=int, default=0, help="the lighthouse's port (default: a free one)")
    p.add_argument("--replica_id", type=int, help="be replica R alone, joining --lighthouse")
    p.add_argument("--lighthouse", help="a running lighthouse's address, http://HOST:PORT")
    p.add_argument("--barrier", type=int, help=argparse.SUPPRESS)  # the launcher's store: wait for every replica
    p.add_argument("--restarted", action="store_true", help=argparse.SUPPRESS)  # started again after --kill
    args = p.parse_args()
    if min(args.replicas, args.steps, args.batch_size, 1 if args.diloco is None else args.diloco) < 1:
        p.error("--replicas, --steps, --batch_size and --diloco must be at least 1")
    if args.batch_size * args.replicas > 4096 or args.step_time < 0 or (args.diloco or 0) > args.steps:
        p.error("--batch_size × --replicas must be at most 4096 (the samples), --step_time not negative, "
                "--diloco at most --steps")
    if args.kill and (args.diloco or args.replicas < 2):
        p.error("--kill needs --replicas 2 or more (a replica heals from another), and no --diloco")
    if args.out_dir and not os.path.isdir(args.out_dir):
        p.error(f"--out_dir {args.out_dir} is not a folder")
    if (args.replica_id is None) != (args.lighthouse is None):
        p.error("--replica_id and --lighthouse go together: one replica, joining a running lighthouse")
    if args.replica_id is not None and not 0 <= args.replica_id < args.replicas:
        p.error(f"--replica_id {args.replica_id} is out of range: --replicas {args.replicas} are 0 to "
                f"{args.replicas - 1}")
    if args.kill:
        kill = re.fullmatch(r"([0-9]+):([0-9]+)(:mid)?", args.kill)
        if not (kill and int(kill[1]) < args.replicas and 0 < int(kill[2]) < args.steps):
            p.error(f"--kill must be R:S or R:S:mid, R below {args.replicas}, S from 1 to {args.steps - 1}")
        args.kill = (int(kill[1]), int(kill[2]), "mid" if kill[3] else "start")
    return args


def batch(train_set, step: int, replica: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica `replica`'s share of step `step`'s global batch, whatever happened before that step."""
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed * 100003 + step))
    return train_set[order[replica * args.batch_size:(replica + 1) * args.batch_size]]


def say(line: str) -> None:
    """A line in one write: the replicas share the launcher's output, where print's two writes (the text, then
    the newline; unbuffered, as under PYTHONUNBUFFERED) could be split by another process's."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checksum(model: torch.nn.Module) -> str:  # the weights' sum, printed: equal weights print equal sums
    return f"{sum(p.double().sum().item() for p in model.parameters()):.12f}"


def average_gradients(model: torch.nn.Module, manager: Manager) -> None:
    """The gradients, in one flat tensor, averaged over this step's quorum by Manager.allreduce (summed over the
    replicas taking part, divided by their number). A peer dying during it is an error the Manager keeps for
    should_commit, not an exception. Not torchft's DistributedDataParallel: in torchft 0.2.0 its comm hook
    raises AssertionError when a peer dies mid-all-reduce (torchft/ddp.py, `assert fut._fut`)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    manager.allreduce(flat).wait()
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def crash(args: argparse.Namespace, step: int, moment: str) -> None:
    """The failure this lesson injects (--kill): a SIGKILL, no exception, no goodbye; not again once restarted."""
    if args.kill == (args.replica_id, step, moment) and not args.restarted:
        os.kill(os.getpid(), signal.SIGKILL)


def replica(args: argparse.Namespace) -> None:
    """One replica group: a store of its own, a Manager in the lighthouse's quorum, and the training loop."""
    torch.manual_seed(args.seed)  # every replica starts from the same weights (else init_sync=True copies them)
    model, r = build_model(), args.replica_id
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_set, _ = make_datasets(4096, 1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # this group's (torchrun's)
    try:
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, replica_id=f"replica_{r}",
            state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},  # what a peer heals from
            load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
            lighthouse_addr=args.lighthouse, hostname="127.0.0.1", store_addr="127.0.0.1", store_port=store.port,
            rank=0, world_size=1, init_sync=False, use_async_quorum=args.diloco is None,
            timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=5))
    except RuntimeError as error:  # torchft's servers say why in the first line: no lighthouse there, say
        sys.exit(f"error: replica {r}: {str(error).splitlines()[0]}")
    def counting(*a, allreduce=manager.allreduce, **k):  # the Manager's all-reduces, counted
        counted[0] += 1
        return allreduce(*a, **k)
    counted, manager.allreduce = [0], counting
    if args.barrier:  # started by the launcher, which stops it (also if the launcher is SIGKILLed: Linux's prctl)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if sys.platform == "linux":
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if args.barrier and not args.restarted:  # every replica's Manager up (heartbeating): step 0's quorum has all
        barrier, deadline = dist.TCPStore("127.0.0.1", args.barrier, is_master=False), time.monotonic() + 60
        barrier.add("ready", 1)
        while barrier.add("ready", 0) < args.replicas:
            if time.monotonic() > deadline:
                sys.exit(f"error: replica {r}: the other replicas did not start within 60 s")
            time.sleep(0.01)
    (diloco if args.diloco else per_step)(args, model, inner, manager, counted, train_set)
    if args.out_dir:
        torch.save(model.state_dict(), os.path.join(args.out_dir, f"replica_{r}.pt"))
    manager.shutdown(wait=False)


def per_step(args: argparse.Namespace, model, inner, manager: Manager, counted: list, train_set) -> None:
    """torchft's per-step fault tolerance: a quorum every step, the gradients averaged over it, the step taken
    only where that all-reduce went through."""
    optimizer, r, expected = OptimizerWrapper(manager, inner), args.replica_id, 0
    while manager.current_step() < args.steps:
        crash(args, manager.current_step(), "start")
        before = counted[0]
        optimizer.zero_grad()  # starts this step's quorum: which replicas take part
        manager.wait_quorum()  # (else it runs beside the forward; waited for here, to print its step)
        step = manager.current_step()  # a replica that came back: the others' step (it heals from one of them)
        if args.restarted and step == 0:
            sys.exit(f"error: replica {r} came back to no live peer to heal from (the others had finished?)")
        crash(args, step, "mid")
        x, y = batch(train_set, step, r, args)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        average_gradients(model, manager)
        optimizer.step()  # only if should_commit: no error in the all-reduce (a dead peer's fails on all)
        time.sleep(args.step_time)
        say(f"replica {r} step {step}: {manager.num_participants()} of {args.replicas} replicas, all-reduces "
            f"{counted[0] - before}, "
            f"{'committed' if manager.current_step() > step else 'not committed'}"
            f"{', healed from a peer' if step > expected else ''}, loss {loss.item():.4f}, "
            f"weights {checksum(model)}")
        expected = manager.current_step()


def diloco(args: argparse.Namespace, model, inner, manager: Manager, counted: list, train_set) -> None:
    """DiLoCo: each replica takes --diloco H steps of its own (Adam), then the replicas all-reduce each tensor's
    change since the last outer step and apply its average with an outer optimizer (the paper's Nesterov SGD)."""
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with DiLoCo(manager, [model], inner, outer, sync_every=args.diloco):
        for step in range(args.steps):
            before = counted[0]
            inner.zero_grad()
            x, y = batch(train_set, step, args.replica_id, args)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            inner.step()  # every H-th: also the outer step, with its quorum and its all-reduces
            time.sleep(args.step_time)
            outer_step = f", outer step {manager.current_step()} over {manager.num_participants()} replicas"
            say(f"replica {args.replica_id} step {step}: all-reduces {counted[0] - before}"
                f"{outer_step if counted[0] > before else ''}, loss {loss.item():.4f}, weights {checksum(model)}")


def launch(args: argparse.Namespace) -> int:
    """The lighthouse, and a process per replica; the one --kill names is started again when it dies."""
    try:
        if args.out_dir:  # one launcher a folder: its lock, held till it exits (a second would overwrite replica_R.pt)
            os.lockf(os.open(os.path.join(args.out_dir, "lock"), os.O_RDWR | os.O_CREAT), os.F_TLOCK, 0)
        # A dead replica drops out of the quorum after 1 s without a heartbeat; a live one late to its quorum
        # is waited for up to 10 s. A join timeout shorter than a step once let a quorum form before a live
        # replica asked, and the replicas then fell out of step, each quorum's late ones healing every step.
        lighthouse = LighthouseServer(bind=f"127.0.0.1:{args.lighthouse_port}", min_replicas=1,
                                      join_timeout_ms=10_000, heartbeat_timeout_ms=1000)
    except BlockingIOError:
        sys.exit(f"error: --out_dir {args.out_dir} is in use by another launcher (it holds {args.out_dir}/lock)")
    except RuntimeError as error:  # a port already taken, say
        sys.exit(f"error: the lighthouse cannot listen on 127.0.0.1:{args.lighthouse_port}: {error}")
    for signum in (signal.SIGTERM, signal.SIGINT):  # so that `finally` stops the replicas
        signal.signal(signum, lambda signum, _: sys.exit(128 + signum))
    address = f"http://127.0.0.1:{lighthouse.address().rsplit(':', 1)[1]}"  # it names the host: loopback's safer
    barrier = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def start(r: int, *more: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--replica_id", str(r), "--lighthouse",
                                 address, "--barrier", str(barrier.port), *more])
    replicas, failed, restarted = {}, [], False
    try:
        for r in range(args.replicas):  # inside the try: a signal now still stops those started
            replicas[r] = start(r)
        say(f"launcher: lighthouse at {address}, {args.replicas} replicas started")
        while replicas:
            for r, proc in [(r, proc) for r, proc in replicas.items() if proc.poll() is not None]:
                del replicas[r]
                if proc.returncode == -signal.SIGKILL and args.kill and r == args.kill[0] and not restarted:
                    restarted = True
                    say(f"launcher: replica {r} died; starting it again")
                    replicas[r] = start(r, "--restarted")
                elif proc.returncode:
                    say(f"launcher: replica {r} exited with code {proc.returncode}")
                    failed.append(r)
            time.sleep(0.05)
    finally:
        for proc in replicas.values():
            proc.kill()
            proc.wait()
        lighthouse.shutdown()
    return 1 if failed else 0


def main() -> None:
    args = parse_args()
    sys.exit(launch(args) if args.replica_id is None else replica(args))


if __name__ == "__main__":
    main()
