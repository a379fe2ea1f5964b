"""First steps with torch.distributed: messages between two ranks, the first collective, a group of some of
the ranks, and the three ways for processes to find each other.

Every rank prints what it sends and receives, prefixed with its rank, and checks what it received against
the value it knows to expect; a mismatch makes every rank exit with status 1. Point-to-point messages need a
partner, so with one process those parts say so and are skipped. Next: comm_collectives.py, every collective.

    torchrun --standalone --nproc-per-node 4 comm_intro.py       # any count from 1 to 8; gloo on CPU
    torchrun --standalone --nproc-per-node 2 comm_intro.py --backend nccl   # one GPU per process

Started with plain python, it prints how to launch it and exits with status 2.
Explained in docs/communication.md.
"""
import argparse
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo",
        help="gloo for CPU tensors, nccl for CUDA tensors (one GPU per process); default: nccl if CUDA is available",
    )
    parser.add_argument("--timeout", type=common.timeout_seconds, default=60.0,
                        help="seconds a collective waits for a peer before the process group gives up")
    return parser.parse_args()


def say(rank: int, world_size: int, text: str) -> None:
    common.print_line(f"[rank {rank}/{world_size}] {text}")


def fmt(tensor: torch.Tensor) -> str:
    return "[" + ", ".join(f"{value:g}" for value in tensor.tolist()) + "]"


def check(rank: int, world_size: int, what: str, got: torch.Tensor, expected: list[float]) -> bool:
    """Print what this rank holds and whether it is what it should be; return True if it is."""
    ok = got.tolist() == expected
    verdict = "ok" if ok else "MISMATCH, expected [" + ", ".join(f"{value:g}" for value in expected) + "]"
    say(rank, world_size, f"{what}: {fmt(got)}  {verdict}")
    return ok


def blocking_send_recv(rank: int, world_size: int, device: torch.device) -> bool:
    """Rank 0 sends every other rank a message of its own; each of them receives it."""
    if rank == 0:
        for dst in range(1, world_size):
            message = torch.full((3,), 100.0 + dst, device=device)
            # Returns once the message has been handed over; after that `message` may be changed or freed.
            dist.send(message, dst=dst)
            say(rank, world_size, f"send to rank {dst}: {fmt(message)}")
        return True
    # Only the bytes travel, not the shape or the dtype: the receiver allocates a tensor of the sender's shape
    # and dtype beforehand, and recv fills it in place. A different size makes gloo fail.
    message = torch.zeros(3, device=device)
    dist.recv(message, src=0)  # blocks until the message is here
    return check(rank, world_size, "recv from rank 0", message, [100.0 + rank] * 3)


def nonblocking_send_recv(rank: int, world_size: int, device: torch.device) -> bool:
    """Every other rank sends rank 0 a message at once; rank 0 waits for all of them together."""
    if rank != 0:
        message = torch.tensor([rank, rank * rank], dtype=torch.float32, device=device)
        work = dist.isend(message, dst=0)  # returns at once: the send goes on in the background
        # Until wait() returns the send may still be reading `message`: changing it now could change what
        # arrives, and freeing it could send garbage. Here we only wait.
        work.wait()
        say(rank, world_size, f"isend to rank 0: {fmt(message)}")
        return True
    inbox = {src: torch.zeros(2, device=device) for src in range(1, world_size)}
    works = [dist.irecv(buffer, src=src) for src, buffer in inbox.items()]  # all posted before waiting on any
    for work in works:
        work.wait()  # before this returns a receive buffer may hold anything, also half a message
    results = [check(rank, world_size, f"irecv from rank {src}", buffer, [src, src * src])
               for src, buffer in inbox.items()]
    return all(results)


def ring_exchange(rank: int, world_size: int, device: torch.device) -> bool:
    """Every rank sends to the next rank and receives from the previous one, all at the same time."""
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size  # the same rank when there are two
    outgoing = torch.full((2,), float(rank), device=device)
    incoming = torch.zeros(2, device=device)
    ops = [dist.P2POp(dist.isend, outgoing, next_rank), dist.P2POp(dist.irecv, incoming, prev_rank)]
    # With blocking calls every rank would sit in send() waiting for its neighbour to receive, and none would
    # get to recv(): a cycle of waits, a deadlock. batch_isend_irecv starts all of them together (with nccl,
    # as one group, which nccl needs for sends and receives that depend on each other).
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return check(rank, world_size, f"ring: sent {fmt(outgoing)} to rank {next_rank}, got from rank {prev_rank}",
                 incoming, [float(prev_rank)] * 2)


def first_all_reduce(rank: int, world_size: int, device: torch.device) -> bool:
    """Every rank contributes rank + 1 and every rank receives the sum, then the mean."""
    ok = True
    sum_of_ranks = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    for op, expected in ((dist.ReduceOp.SUM, sum_of_ranks), (dist.ReduceOp.AVG, sum_of_ranks / world_size)):
        tensor = torch.tensor([rank + 1.0], device=device)
        before = fmt(tensor)
        # Every rank must call it, with a tensor of the same shape and dtype: the ones that do not are waited
        # for until the timeout. The result replaces the tensor, on every rank.
        dist.all_reduce(tensor, op=op)
        ok &= check(rank, world_size, f"all_reduce {op.name}: before {before}, after", tensor, [expected])
    return ok


def subgroup(rank: int, world_size: int, device: torch.device) -> bool:
    """A group of the even ranks, and an all_reduce among them only."""
    members = list(range(0, world_size, 2))
    # Every rank calls new_group with the same list, also the ranks left out: making a group is collective.
    group = dist.new_group(ranks=members)
    if rank not in members:
        say(rank, world_size, f"new_group {members}: not a member, so it takes no part in the group's all_reduce")
        return True
    tensor = torch.tensor([float(rank)], device=device)
    dist.all_reduce(tensor, group=group)  # collectives on a group involve only its members
    return check(rank, world_size, f"all_reduce in new_group {members} (rank {dist.get_rank(group)} there)",
                 tensor, [float(sum(members))])


def rendezvous(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> bool:
    """The group so far came from env://. Make it again with tcp:// and then file://."""
    # The other two ways need a port and a file that every rank knows: rank 0 chooses them and the env://
    # group carries them to the others.
    if rank == 0:
        # file:// wants a file that does not exist or is empty, on a file system all ranks see (one host, or
        # a shared one). The store deletes it when the last rank leaves.
        with tempfile.NamedTemporaryFile(prefix="comm_intro_", delete=False) as file:
            choice = [common.free_port(), file.name]
    else:
        choice = [None, None]
    dist.broadcast_object_list(choice, src=0)
    port, path = choice
    ok = True
    # tcp://: rank 0 starts a small key-value server (a TCPStore) on the port, at an address every rank can
    # reach, and the others connect to it. The port was chosen free above: a fixed one may be taken by another
    # job. torchrun runs such a server itself and tells the ranks to use only its own
    # (TORCHELASTIC_USE_AGENT_STORE=True); for a server of our own, as when processes are started by hand:
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # file://: the ranks meet in a shared file instead; it is also how Windows users start gloo
    # (file:///C:/path/to/file).
    for init_method in (f"tcp://{os.environ['MASTER_ADDR']}:{port}", Path(path).as_uri()):
        dist.destroy_process_group()  # one default group at a time
        # Only env:// reads the rank and world size from the environment; the others are told them.
        dist.init_process_group(args.backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=args.timeout))
        tensor = torch.ones(1, device=device)
        dist.all_reduce(tensor)
        ok &= check(rank, world_size, f"init_method={init_method}, all_reduce of ones", tensor, [float(world_size)])
    return ok


def main() -> None:
    args = parse_args()
    launched = common.launcher_env()  # None without a launcher; one line if its variables are incomplete
    if launched is None:
        common.die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 4 comm_intro.py")
    # torchrun sets these for every process it starts.
    rank, local_rank, world_size = launched
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            common.die("--backend nccl needs CUDA GPUs and this machine has none: use --backend gloo")
        # nccl works on tensors in GPU memory: one GPU per process, chosen by the rank on this node, and set
        # before init_process_group so that the communicator is built on it.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")

    # env://, the default, reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from the environment. Every
    # rank waits here until all WORLD_SIZE ranks have arrived.
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    say(rank, world_size, f"joined with env:// at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, "
        f"backend {args.backend}, device {device}")
    try:
        failures = 0
        if world_size == 1:
            say(rank, world_size, "send/recv, isend/irecv and the ring need a second rank: skipped")
        else:
            for lesson in (blocking_send_recv, nonblocking_send_recv, ring_exchange):
                failures += not lesson(rank, world_size, device)
                dist.barrier()  # not needed by the messages: it keeps each part's lines together in the output
        for lesson in (first_all_reduce, subgroup):
            failures += not lesson(rank, world_size, device)
            dist.barrier()  # as above, for the output only
        failures += not rendezvous(args, rank, world_size, device)
        # Every rank must learn whether any rank saw a mismatch, so that all of them exit with the same status.
        total = torch.tensor([failures], device=device)
        dist.all_reduce(total)
        if rank == 0:
            common.print_line(f"{total.item()} mismatches on {world_size} ranks" if total.item() else
                              f"all results match on {world_size} ranks")
    finally:
        if dist.is_initialized():  # not when a new init_process_group failed
            dist.destroy_process_group()
    if total.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    common.exit_now()  # skips the interpreter's teardown of torch (see common)
