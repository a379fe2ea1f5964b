"""Every collective operation of torch.distributed, shown on every rank and checked, and a hand-written
ring all-reduce.

DDP is built on these operations. Each one below prints what every rank holds before and after it, and
each result is compared with the answer computed on the rank itself, without any communication (numpy):
a mismatch makes every rank exit with status 1. Nothing assumes two ranks: lists are sized by the world
size and the roots are not always rank 0. Then ring_all_reduce() builds a bandwidth-optimal all-reduce
out of point-to-point messages, and the data-parallel step of PyTorch's distributed tutorial
(gradients averaged with all_reduce after backward) is shown to give the same weights as DDP.
comm_intro.py comes first (send/recv, the first all_reduce, groups, rendezvous).

    torchrun --standalone --nproc-per-node 4 comm_collectives.py       # any count from 1 to 8; gloo on CPU
    torchrun --standalone --nproc-per-node 2 comm_collectives.py --backend nccl   # one GPU per process

Started with plain python, it prints how to launch it and exits with status 2.
Explained in docs/communication.md.
"""
import argparse
import copy
import math
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import common

SEGMENT_BYTES = 4 * 2**20  # ring_all_reduce moves big chunks in pieces of at most this size
BARRIER_DELAY = 0.5  # seconds one rank arrives late at the barriers
NAME_WIDTH = 30  # column of the operation names in the output


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo",
        help="gloo for CPU tensors, nccl for CUDA tensors (one GPU per process); default: nccl if CUDA is available",
    )
    parser.add_argument("--timeout", type=common.timeout_seconds, default=60.0,
                        help="seconds a collective waits for a peer before the process group gives up")
    return parser.parse_args()


# --- Printing and checking ------------------------------------------------------------------------------

def fmt(value: object) -> str:
    """A tensor or array, a list of them, or plain objects, on one short line: 3.0 prints as 3."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(item) for item in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    return repr(value)


def to_numpy(value: object) -> object:
    """Tensors (or lists of tensors) as one numpy array; anything else unchanged."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, list) and value and all(isinstance(item, torch.Tensor) for item in value):
        return np.stack([item.detach().cpu().numpy() for item in value])
    return value


def check(got: object, expected: object, tolerance: float = 0.0) -> bool:
    """True if `got` equals `expected`: same shape and dtype kind and, with tolerance 0, the same values
    exactly. Tensors and lists of tensors are compared as numpy arrays, other objects with ==."""
    got = to_numpy(got)
    if isinstance(got, np.ndarray) or isinstance(expected, np.ndarray):
        expected = np.asarray(expected)
        if not isinstance(got, np.ndarray) or got.shape != expected.shape or got.dtype.kind != expected.dtype.kind:
            return False
        if tolerance == 0.0:
            return bool(np.array_equal(got, expected))
        return bool(np.allclose(got, expected, rtol=tolerance, atol=tolerance))
    return got == expected


def line(rank: int, world_size: int, name: str, text: str) -> None:
    common.print_line(f"[rank {rank}/{world_size}] {name:<{NAME_WIDTH}} {text}")


def verdict(ok: bool, expected: object) -> str:
    return "ok" if ok else f"MISMATCH, expected {fmt(expected)}"


def report(rank: int, world_size: int, name: str, before: object, after: object, expected: object,
           tolerance: float = 0.0) -> bool:
    """Print what this rank held before and after an operation; check the result. Returns True if right."""
    ok = check(after, expected, tolerance)
    line(rank, world_size, name, f"before {fmt(before)}  after {fmt(after)}  {verdict(ok, expected)}")
    return ok


def labels(rank: int, count: int) -> np.ndarray:
    """What rank r holds for the operations that move data: 10r, 10r+1, ... so that every number shows
    where it came from (23 is rank 2's element 3)."""
    return (10 * rank + np.arange(count)).astype(np.float32)


def addends(rank: int) -> np.ndarray:
    """What rank r holds for the reductions: small integers, so that every sum and product over up to 8
    ranks is exact in float32 and the result does not depend on the order in which ranks are added."""
    return np.array([rank + 1, rank + 2, rank % 3 + 1, 2**rank], dtype=np.float32)


def every_rank(values: Callable[[int], np.ndarray], world_size: int) -> np.ndarray:
    """(world_size, ...) array of what each rank starts with: each rank computes it locally."""
    return np.stack([values(r) for r in range(world_size)])


def as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


# --- One demonstration per collective. Each runs on every rank and returns True if its result is right. ---

def demo_broadcast(rank: int, world_size: int, device: torch.device) -> bool:
    tensor = as_tensor(labels(rank, 3), device)
    before = tensor.clone()
    # Every rank calls it, the source too: the source sends, every other rank overwrites its tensor.
    dist.broadcast(tensor, src=0)
    return report(rank, world_size, "broadcast from rank 0", before, tensor, labels(0, 3))


def demo_reduce(rank: int, world_size: int, device: torch.device) -> bool:
    root = world_size - 1  # any rank can be the root
    tensor = as_tensor(addends(rank), device)
    before = tensor.clone()
    dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM)
    if rank != root:
        # Only the root's tensor is defined afterwards; gloo leaves partial sums in the others.
        line(rank, world_size, f"reduce SUM to rank {root}", f"before {fmt(before)}  after: only rank {root} has it")
        return True
    return report(rank, world_size, f"reduce SUM to rank {root}", before, tensor,
                  every_rank(addends, world_size).sum(0))


# NCCL has no bitwise reductions; PREMUL_SUM (multiply by a factor, then sum) is made only by the private
# dist._make_nccl_premul_sum and only nccl runs it.
REDUCTIONS = {
    "SUM": lambda a: a.sum(0),
    "AVG": lambda a: a.sum(0) / len(a),
    "PRODUCT": lambda a: a.prod(0),
    "MIN": lambda a: a.min(0),
    "MAX": lambda a: a.max(0),
    "BAND": np.bitwise_and.reduce,
    "BOR": np.bitwise_or.reduce,
    "BXOR": np.bitwise_xor.reduce,
}
BITWISE = ("BAND", "BOR", "BXOR")


def demo_all_reduce(rank: int, world_size: int, device: torch.device) -> bool:
    ok = True
    for name, reference in REDUCTIONS.items():
        title = f"all_reduce {name}"
        if name in BITWISE and dist.get_backend() == "nccl":
            line(rank, world_size, title, "skipped: NCCL has no bitwise reductions")
            continue
        # The bitwise reductions need integers (gloo raises for floats).
        start = addends(rank).astype(np.int64) if name in BITWISE else addends(rank)
        tensor = as_tensor(start, device)
        before = tensor.clone()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, name))  # every rank ends with the same result
        expected = reference(every_rank(addends, world_size).astype(start.dtype))
        # AVG divides, and nccl may scale before summing: allow float rounding there.
        ok &= report(rank, world_size, title, before, tensor, expected, tolerance=1e-6 if name == "AVG" else 0.0)
    line(rank, world_size, "all_reduce PREMUL_SUM", "skipped: made only by a private function, for nccl")
    return ok


def demo_all_gather(rank: int, world_size: int, device: torch.device) -> bool:
    tensor = as_tensor(labels(rank, 2), device)
    # One output slot per rank, each the shape of the input: the list is sized by the world size.
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor)
    ok = report(rank, world_size, "all_gather", tensor, gathered, every_rank(lambda r: labels(r, 2), world_size))
    # The same into one tensor of world_size × the input's length (in torch < 2.13: all_gather_into_tensor,
    # still there but deprecated). No list of small tensors: what DDP and FSDP use.
    flat = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=device)
    dist.all_gather_single(flat, tensor)
    expected = np.concatenate([labels(r, 2) for r in range(world_size)])
    return report(rank, world_size, "all_gather_single", tensor, flat, expected) and ok


def demo_gather(rank: int, world_size: int, device: torch.device) -> bool:
    root = 0
    tensor = as_tensor(labels(rank, 2), device)
    # Only the root passes a list to fill; every other rank passes None (and still calls gather).
    gathered = [torch.empty_like(tensor) for _ in range(world_size)] if rank == root else None
    dist.gather(tensor, gather_list=gathered, dst=root)
    if rank != root:
        line(rank, world_size, f"gather to rank {root}", f"before {fmt(tensor)}  after: sent to rank {root}")
        return True
    return report(rank, world_size, f"gather to rank {root}", tensor, gathered,
                  every_rank(lambda r: labels(r, 2), world_size))


def demo_scatter(rank: int, world_size: int, device: torch.device) -> bool:
    root = 0
    # The root holds one piece per rank and keeps piece `root` itself; the others only receive.
    pieces = [as_tensor(labels(r, 2), device) for r in range(world_size)] if rank == root else None
    received = torch.zeros(2, device=device)
    before = pieces if rank == root else received.clone()
    dist.scatter(received, scatter_list=pieces, src=root)
    return report(rank, world_size, f"scatter from rank {root}", before, received, labels(rank, 2))


def demo_reduce_scatter(rank: int, world_size: int, device: torch.device) -> bool:
    # Every rank holds one piece per rank; rank i receives the sum over ranks of everybody's piece i.
    def pieces_of(r: int) -> np.ndarray:
        return labels(r, world_size)  # piece i of rank r is the number 10r + i

    expected = every_rank(pieces_of, world_size).sum(0)[rank : rank + 1]
    inputs = [as_tensor(piece, device) for piece in pieces_of(rank).reshape(world_size, 1)]
    output = torch.zeros(1, device=device)
    dist.reduce_scatter(output, inputs, op=dist.ReduceOp.SUM)
    ok = report(rank, world_size, "reduce_scatter SUM", inputs, output, expected)
    # The same from one tensor of world_size pieces (in torch < 2.13: reduce_scatter_tensor). It is the first
    # half of an all-reduce: afterwards each rank holds the complete sum of one piece.
    flat = as_tensor(pieces_of(rank), device)
    output = torch.zeros(1, device=device)
    dist.reduce_scatter_single(output, flat, op=dist.ReduceOp.SUM)
    return report(rank, world_size, "reduce_scatter_single SUM", flat, output, expected) and ok


def demo_all_to_all(rank: int, world_size: int, device: torch.device) -> bool:
    # Rank r sends its piece i (the number 10r + i) to rank i: afterwards rank i holds piece i of every
    # rank, in rank order. A transpose of the (ranks × pieces) table.
    sent = [as_tensor(piece, device) for piece in labels(rank, world_size).reshape(world_size, 1)]
    received = [torch.zeros(1, device=device) for _ in range(world_size)]
    dist.all_to_all(received, sent)
    expected = every_rank(lambda r: labels(r, world_size), world_size)[:, rank : rank + 1]
    ok = report(rank, world_size, "all_to_all", sent, received, expected)
    # The same with one tensor in and one out, split evenly (input_split_sizes allow uneven pieces).
    flat_sent = as_tensor(labels(rank, world_size), device)
    flat_received = torch.zeros(world_size, device=device)
    dist.all_to_all_single(flat_received, flat_sent)
    return report(rank, world_size, "all_to_all_single", flat_sent, flat_received, expected.reshape(-1)) and ok


def timed_barrier(rank: int, world_size: int, device: torch.device, late_rank: int, barrier: Callable[[], None]):
    """Seconds this rank spent from a common start to leaving `barrier`, when `late_rank` arrives
    BARRIER_DELAY late. A barrier lets nobody leave before everybody has arrived."""
    dist.all_reduce(torch.zeros(1, device=device))  # line the ranks up, so that they start the clock together
    start = time.monotonic()
    if rank == late_rank:
        time.sleep(BARRIER_DELAY)
    barrier()
    return time.monotonic() - start


def demo_barrier(rank: int, world_size: int, device: torch.device) -> bool:
    late_rank = 0
    waited = timed_barrier(rank, world_size, device, late_rank, dist.barrier)
    # Half the delay leaves room for the ranks leaving the lining-up all_reduce at slightly different times.
    ok = waited >= BARRIER_DELAY / 2
    line(rank, world_size, f"barrier, rank {late_rank} late", f"left after {waited:.2f} s  "
         f"{verdict(ok, f'at least {BARRIER_DELAY / 2} s')}")
    return ok


def demo_monitored_barrier(rank: int, world_size: int, device: torch.device) -> bool:
    # Rank 0 waits for every other rank with a timeout and, if one does not come, raises naming it
    # (wait_all_ranks=True: all of them) instead of hanging. Only gloo implements it: with nccl, a gloo
    # group beside the nccl one (new_group, like every group, is called by every rank).
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    late_rank = world_size - 1

    def barrier() -> None:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=10 * BARRIER_DELAY), wait_all_ranks=True)

    waited = timed_barrier(rank, world_size, device, late_rank, barrier)
    ok = waited >= BARRIER_DELAY / 2
    line(rank, world_size, f"monitored_barrier, rank {late_rank} late", f"left after {waited:.2f} s  "
         f"{verdict(ok, f'at least {BARRIER_DELAY / 2} s')}")
    return ok


def demo_objects(rank: int, world_size: int, device: torch.device) -> bool:
    """Collectives of picklable Python objects. Pickled into byte tensors and sent twice (sizes, then
    bytes): for small metadata, never for tensors. Unpickling can run code: only between trusted peers."""
    def mine(r: int) -> dict:
        return {"rank": r, "square": r * r}

    objects = [f"from rank {rank}", mine(rank)]  # the same length on every rank
    before = list(objects)
    dist.broadcast_object_list(objects, src=0)
    ok = report(rank, world_size, "broadcast_object_list from 0", before, objects, ["from rank 0", mine(0)])

    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine(rank))
    ok &= report(rank, world_size, "all_gather_object", mine(rank), gathered, [mine(r) for r in range(world_size)])

    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(mine(rank), gathered, dst=0)
    if rank == 0:
        ok &= report(rank, world_size, "gather_object to rank 0", mine(rank), gathered,
                     [mine(r) for r in range(world_size)])
    else:
        line(rank, world_size, "gather_object to rank 0", f"before {fmt(mine(rank))}  after: sent to rank 0")

    received = [None]
    pieces = [f"for rank {r}" for r in range(world_size)] if rank == 0 else None
    dist.scatter_object_list(received, pieces, src=0)
    ok &= report(rank, world_size, "scatter_object_list from 0", pieces if rank == 0 else [None], received,
                 [f"for rank {rank}"])
    return ok


def demo_async(rank: int, world_size: int, device: torch.device) -> bool:
    tensor = as_tensor(addends(rank), device)
    before = tensor.clone()
    work = dist.all_reduce(tensor, async_op=True)  # returns at once; the communication runs in the background
    # Work that does not touch `tensor` overlaps with the communication, here the reference answer. Until
    # wait() returns, `tensor` belongs to the all-reduce: reading it may see partial sums, and writing it
    # may change what is sent.
    expected = every_rank(addends, world_size).sum(0)
    work.wait()  # with nccl: makes the current CUDA stream wait, so kernels queued after it see the result
    return report(rank, world_size, "all_reduce async_op=True", before, tensor, expected)


# --- A ring all-reduce from point-to-point messages ----------------------------------------------------------

def _exchange(send: torch.Tensor, recv: torch.Tensor, next_rank: int, prev_rank: int,
              group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Start sending `send` to the next rank and receiving `recv` from the previous one; return the works."""
    ops = []
    # Both ends skip an empty piece: they agree on every piece's size, and an empty message is wasted latency.
    # (So with fewer elements than ranks, some ranks sit out some steps. With nccl that is allowed only once
    # the group has run some other operation, which the batch_isend_irecv docs ask of partial batches.)
    if recv.numel() > 0:  # posted first, so that the neighbour's data can land as soon as it arrives
        ops.append(dist.P2POp(dist.irecv, recv, group=group, group_peer=prev_rank))
    if send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, group=group, group_peer=next_rank))
    # Send and receive are started together. Were every rank to call a blocking send first, each would wait
    # for its neighbour to receive, and none would: a deadlock. (With nccl the batch is one grouped launch.)
    return dist.batch_isend_irecv(ops) if ops else []


_scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def scratch_space(like: torch.Tensor, rows: int, row_length: int) -> torch.Tensor:
    """A (rows, row_length) buffer of like's dtype and device, the same memory from call to call. A fresh
    buffer of megabytes is new memory that the OS maps a page at a time on first touch: on a CPU those page
    faults cost up to a fifth of the all-reduce. (PyTorch's caching allocator already does this on GPUs.)
    Not for calls from several threads at once."""
    key = (like.dtype, like.device)
    if key not in _scratch or _scratch[key].numel() < rows * row_length:
        _scratch[key] = like.new_empty(rows * row_length)
    return _scratch[key][: rows * row_length].view(rows, row_length)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum `tensor` over the ranks of `group`, in place, like dist.all_reduce(tensor), from point-to-point
    messages only.

    The flattened tensor is cut into n chunks (n = world size). Reduce-scatter, n-1 steps: at step s rank r
    sends chunk (r - s) mod n to rank r+1 and receives chunk (r - s - 1) mod n from rank r-1, adding its own
    part to it; afterwards rank r holds the complete sum of chunk (r + 1) mod n. All-gather, n-1 steps: each
    rank passes on the complete chunk it received last. Every rank sends 2(n-1) chunks, 2(n-1)/n of the
    tensor, the least that any all-reduce must send (Patarasuk and Yuan 2009): less than twice the tensor,
    however many ranks there are. Big chunks go in segments of SEGMENT_BYTES, two in flight, so that adding
    one segment overlaps with receiving the next (gloo and NCCL do the same).
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world_size == 1 or tensor.numel() == 0:
        return
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size
    # A view shares the tensor's memory, so results land in place; a non-contiguous tensor needs a copy.
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()
    # Views, not copies, so messages go straight from and into the tensor. Sizes differ by at most one
    # element (the first numel % n chunks are longer); with fewer elements than ranks some are empty.
    chunks = flat.tensor_split(world_size)
    segments = max(1, math.ceil(chunks[0].numel() * flat.element_size() / SEGMENT_BYTES))
    # Received partial sums land here, not in the chunk, which still holds this rank's addend: room for the
    # two segments in flight, not for a whole chunk.
    scratch = scratch_space(flat, min(segments, 2), math.ceil(chunks[0].numel() / segments))

    for step in range(world_size - 1):  # reduce-scatter
        sends = chunks[(rank - step) % world_size].tensor_split(segments)
        recvs = chunks[(rank - step - 1) % world_size].tensor_split(segments)
        incoming = [scratch[k % 2, : part.numel()] for k, part in enumerate(recvs)]
        works = _exchange(sends[0], incoming[0], next_rank, prev_rank, group)
        for k in range(segments):
            current = works
            if k + 1 < segments:  # start the next segment now, so that it travels while this one is added
                works = _exchange(sends[k + 1], incoming[k + 1], next_rank, prev_rank, group)
            for work in current:
                work.wait()  # the segment has arrived (and ours has left): only now may it be read
            recvs[k].add_(incoming[k])

    for step in range(world_size - 1):  # all-gather: complete chunks are received where they belong
        works = _exchange(chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size],
                          next_rank, prev_rank, group)
        for work in works:
            work.wait()  # the next step forwards what this one received

    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


def demo_ring_all_reduce(rank: int, world_size: int, device: torch.device) -> bool:
    # 7 elements: chunks of unequal size for most world sizes, and empty ones beyond 7 ranks.
    start = (np.arange(7) + 10 * rank).astype(np.float32)
    tensor = as_tensor(start, device)
    before = tensor.clone()
    ring_all_reduce(tensor)
    expected = every_rank(lambda r: (np.arange(7) + 10 * r).astype(np.float32), world_size).sum(0)
    return report(rank, world_size, "ring_all_reduce (hand-written)", before, tensor, expected)


# --- The data-parallel step by hand, as in PyTorch's distributed tutorial, against DDP ----------------------

def average_gradients(model: torch.nn.Module) -> None:
    """After backward, each rank's gradients come from its own batch. Summing them over the ranks and
    dividing by the world size gives every rank the gradient of the loss over all batches, so every
    replica takes the same step. DDP does this too, overlapped with backward, in buckets."""
    world_size = dist.get_world_size()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad /= world_size


def demo_data_parallel(rank: int, world_size: int, device: torch.device) -> bool:
    torch.manual_seed(0)  # the same initial weights on every rank
    by_hand = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    ddp = DDP(copy.deepcopy(by_hand), device_ids=[device.index] if device.type == "cuda" else None)
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (by_hand, ddp)]
    before = by_hand[0].weight[0, :3].clone()
    batches = torch.Generator().manual_seed(1000 + rank)  # a different batch on every rank
    for _ in range(3):
        x = torch.randn(16, 8, generator=batches).to(device)
        y = x.sum(dim=1, keepdim=True)
        for model, optimizer in zip((by_hand, ddp), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # DDP averages the gradients here
            if model is by_hand:
                average_gradients(model)  # by hand: after backward, before the step
            optimizer.step()
    mine = torch.cat([p.detach().reshape(-1) for p in by_hand.parameters()])
    theirs = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    # DDP divides before summing, by hand after: the same up to float rounding.
    ok = check(mine, to_numpy(theirs), tolerance=1e-5)
    line(rank, world_size, "by hand vs DDP, 3 steps", f"weights before {fmt(before)}  after by hand "
         f"{fmt(by_hand[0].weight[0, :3])}  DDP {fmt(ddp.module[0].weight[0, :3])}  {verdict(ok, 'the same')}")
    # Every replica must hold exactly the same weights, or they drift apart from here on.
    replicas = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(replicas, mine)
    same = all(torch.equal(replica, mine) for replica in replicas)
    line(rank, world_size, "replicas after 3 steps", f"{'identical' if same else 'different'} on {world_size} "
         f"ranks  {verdict(same, 'identical')}")
    return ok and same


DEMOS = (demo_broadcast, demo_reduce, demo_all_reduce, demo_all_gather, demo_gather, demo_scatter,
         demo_reduce_scatter, demo_all_to_all, demo_barrier, demo_monitored_barrier, demo_objects, demo_async,
         demo_ring_all_reduce, demo_data_parallel)


def main() -> None:
    args = parse_args()
    launched = common.launcher_env()  # None without a launcher; one line if its variables are incomplete
    if launched is None:
        common.die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 4 comm_collectives.py")
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

    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        failures = 0
        for demo in DEMOS:
            failures += not demo(rank, world_size, device)
            # Not needed by the collectives: it keeps each operation's lines together in the output.
            dist.barrier()
        # Every rank must learn whether any rank saw a mismatch, so that all of them exit with the same status.
        total = torch.tensor([failures], device=device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if rank == 0:
            common.print_line(f"{total.item()} mismatches on {world_size} ranks" if total.item() else
                              f"all results match on {world_size} ranks")
    finally:
        dist.destroy_process_group()
    if total.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    common.exit_now()  # skips the interpreter's teardown of torch (see common)
