"""First steps with torch.distributed: messages between ranks, the first collective, a group of some ranks,
and three ways to meet (docs/communication.md; next: comm_collectives.py). Each rank prints what it received,
`[rank r/w]` first, and checks it; a mismatch on any rank makes every rank exit 1.

    torchrun --standalone --nproc-per-node 4 comm_intro.py  # any number of processes, gloo on CPUs
"""
import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args() -> argparse.Namespace:
    return argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options


def say(rank: int, world_size: int, text: str) -> None:
    print(f"[rank {rank}/{world_size}] {text}\n", end="", flush=True)  # one write: ranks' lines never run together


def fmt(values: torch.Tensor | list[float]) -> str:
    return "[" + ", ".join(f"{value:g}" for value in (values.tolist() if torch.is_tensor(values) else values)) + "]"


def check(rank: int, world_size: int, what: str, got: torch.Tensor, expected: list[float]) -> bool:
    """Print what this rank holds and whether it is what it should be; return True if it is."""
    ok = got.tolist() == expected
    say(rank, world_size, f"{what}: {fmt(got)}  {'ok' if ok else 'MISMATCH, expected ' + fmt(expected)}")
    return ok


def blocking_send_recv(rank: int, world_size: int) -> bool:
    """Rank 0 sends every other rank a message of its own; each of them receives it."""
    if rank == 0:
        for dst in range(1, world_size):
            message = torch.full((3,), 100.0 + dst)
            dist.send(message, dst=dst)  # returns once the message is handed over: `message` may then change
            say(rank, world_size, f"send to rank {dst}: {fmt(message)}")
        return True
    message = torch.zeros(3)  # only bytes travel: the receiver allocates the sender's shape and dtype
    dist.recv(message, src=0)  # blocks until the message is here
    return check(rank, world_size, "recv from rank 0", message, [100.0 + rank] * 3)


def nonblocking_send_recv(rank: int, world_size: int) -> bool:
    """Every other rank sends rank 0 a message at once; rank 0 waits for all of them together."""
    if rank != 0:
        message = torch.tensor([rank, rank * rank], dtype=torch.float32)
        work = dist.isend(message, dst=0)  # returns at once: the send goes on in the background
        work.wait()  # until then the send may still read `message`: changing it could change what arrives
        say(rank, world_size, f"isend to rank 0: {fmt(message)}")
        return True
    inbox = {src: torch.zeros(2) for src in range(1, world_size)}
    works = [dist.irecv(buffer, src=src) for src, buffer in inbox.items()]  # all posted before waiting on any
    for work in works:
        work.wait()  # until then a receive buffer may hold anything, also half a message
    return all([check(rank, world_size, f"irecv from rank {src}", buffer, [src, src * src])
                for src, buffer in inbox.items()])


def ring_exchange(rank: int, world_size: int) -> bool:
    """Every rank sends to the next rank and receives from the previous one, all at the same time."""
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size  # the same rank when there are two
    outgoing, incoming = torch.full((2,), float(rank)), torch.zeros(2)
    ops = [dist.P2POp(dist.isend, outgoing, next_rank), dist.P2POp(dist.irecv, incoming, prev_rank)]
    # Blocking, every rank would sit in send() and none would reach recv(): batch_isend_irecv starts both.
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return check(rank, world_size, f"ring: sent {fmt(outgoing)} to rank {next_rank}, got from rank {prev_rank}",
                 incoming, [float(prev_rank)] * 2)


def first_all_reduce(rank: int, world_size: int) -> bool:
    """Every rank contributes rank + 1 and every rank receives the sum, then the mean."""
    ok = True
    sum_of_ranks = world_size * (world_size + 1) / 2  # 1 + 2 + ... + world_size
    for op, expected in ((dist.ReduceOp.SUM, sum_of_ranks), (dist.ReduceOp.AVG, sum_of_ranks / world_size)):
        tensor = torch.tensor([rank + 1.0])
        dist.all_reduce(tensor, op=op)  # every rank calls it, with one shape and dtype; the result replaces tensor
        ok &= check(rank, world_size, f"all_reduce {op.name}: before [{rank + 1:g}], after", tensor, [expected])
    return ok


def subgroup(rank: int, world_size: int) -> bool:
    """A group of the even ranks, and an all_reduce among them only."""
    members = list(range(0, world_size, 2))
    group = dist.new_group(ranks=members)  # every rank calls it, also those left out: making a group is collective
    if rank not in members:
        say(rank, world_size, f"new_group {members}: not a member, so it takes no part in the group's all_reduce")
        return True
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor, group=group)  # only the group's members take part
    return check(rank, world_size, f"all_reduce in new_group {members} (rank {dist.get_rank(group)} there)",
                 tensor, [float(sum(members))])


def rendezvous(rank: int, world_size: int) -> bool:
    """The group so far came from env://. Make it again with tcp:// and then with file://."""
    choice = [None, None]
    if rank == 0:
        with socket.socket() as sock:  # a port free now: a fixed one may be another job's
            sock.bind((os.environ["MASTER_ADDR"], 0))
            choice[0] = sock.getsockname()[1]
        with tempfile.NamedTemporaryFile(prefix="comm_intro_", delete=False) as file:
            choice[1] = file.name  # file://: a file that every rank sees (one host, or a shared file system)
    dist.broadcast_object_list(choice, src=0)  # the env:// group tells the other ranks rank 0's choice
    # Not torchrun's store (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 of tcp:// serves one, as if started by hand.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    ok = True
    for init_method in (f"tcp://{os.environ['MASTER_ADDR']}:{choice[0]}", Path(choice[1]).as_uri()):
        dist.destroy_process_group()  # one default group at a time
        # Only env:// reads the rank and world size from the environment; the others are told them.
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        tensor = torch.ones(1)
        dist.all_reduce(tensor)
        ok &= check(rank, world_size, f"init_method={init_method}, all_reduce of ones", tensor, [float(world_size)])
    return ok


def main() -> None:
    parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        raise SystemExit("error: start this script with torchrun --standalone --nproc-per-node 4 comm_intro.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")  # env://, the default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; waits for all
    say(rank, world_size, f"joined with env:// at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    try:
        total = torch.zeros((), dtype=torch.int64)  # mismatches
        if world_size == 1:
            say(rank, world_size, "send/recv, isend/irecv and the ring need a second rank: skipped")
        messages = [blocking_send_recv, nonblocking_send_recv, ring_exchange] if world_size > 1 else []
        for part in (*messages, first_all_reduce, subgroup):
            total += not part(rank, world_size)
            dist.barrier()  # not needed by the messages: it keeps each part's lines together in the output
        total += not rendezvous(rank, world_size)
        dist.all_reduce(total)  # every rank learns of any mismatch, so all of them exit with the same status
        if rank == 0:
            print(f"{total.item()} mismatches" if total.item() else "all results match", f"on {world_size} ranks")
    finally:
        if dist.is_initialized():  # not when an init_process_group in rendezvous() failed
            dist.destroy_process_group()
    raise SystemExit(1 if total.item() else 0)  # 1: a mismatch on some rank


if __name__ == "__main__":
    main()
