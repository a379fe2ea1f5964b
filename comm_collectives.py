"""Every collective of torch.distributed, shown on every rank and checked; a hand-written ring all-reduce.

Each rank prints what it holds before and after each operation, prefixed `[rank r/w]`, and checks the
result against numpy's answer, computed without communication: a mismatch on any rank makes every rank exit
with status 1. Last, the data-parallel step of PyTorch's tutorial (all_reduce the gradients after backward)
against DDP. After comm_intro.py; explained in docs/communication.md.

    torchrun --standalone --nproc-per-node 4 comm_collectives.py  # any number of processes, gloo on CPUs
"""
import argparse
import copy
import math
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  imported later (DDP does), its defaults would hold the group into exit
from torch.nn.parallel import DistributedDataParallel as DDP

from data import make_datasets
from model import build_model

SEGMENT_BYTES = 4 * 2**20  # ring_all_reduce sends big chunks in pieces of at most this size
BARRIER_DELAY = 0.5  # seconds one rank comes late to a barrier
NAME_WIDTH = 30  # the column of the operations' names in the output


def parse_args() -> argparse.Namespace:
    return argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options


def fmt(value: object) -> str:
    """Tensors, arrays, lists of them or plain objects on one short line: 3.0 prints as 3."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(item) for item in value) + "]"
    return f"{value:g}" if isinstance(value, float) else repr(value)


def check(got: object, expected: object, tolerance: float = 0.0) -> bool:
    """Tensors (a list is stacked) against numpy: shape, dtype kind and values must match. Objects: ==."""
    if isinstance(got, list) and got and all(isinstance(item, torch.Tensor) for item in got):
        got = torch.stack(got)
    if not isinstance(got, torch.Tensor):
        return got == expected
    got, expected = got.numpy(), np.asarray(expected)
    same_kind = got.shape == expected.shape and got.dtype.kind == expected.dtype.kind
    return same_kind and bool(np.allclose(got, expected, rtol=tolerance, atol=tolerance))  # 0: exactly equal


def line(rank: int, world_size: int, name: str, text: str, ok: bool = True, expected: object = None) -> bool:
    """Print what this rank holds and, if there is an expected value, whether it is right; return `ok`."""
    verdict = "" if expected is None else "  ok" if ok else f"  MISMATCH, expected {fmt(expected)}"
    print(f"[rank {rank}/{world_size}] {name:<{NAME_WIDTH}} {text}{verdict}\n", end="", flush=True)  # one write
    return ok


def report(rank: int, world_size: int, name: str, before: object, after: object, expected: object,
           tolerance: float = 0.0) -> bool:
    ok = check(after, expected, tolerance)
    return line(rank, world_size, name, f"before {fmt(before)}  after {fmt(after)}", ok, expected)


def labels(rank: int | np.ndarray, count: int) -> np.ndarray:
    """Rank r's data to move: 10r, 10r+1, ... (23 is rank 2's element 3). For an array of ranks, a row each."""
    return np.add.outer(10 * np.asarray(rank), np.arange(count)).astype(np.float32)


def addends(rank: int | np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """Rank r's data to reduce: small integers, whose sums and products over 8 ranks are exact in float32."""
    return np.stack([rank + 1, rank + 2, rank % 3 + 1, 2**rank], axis=-1).astype(dtype)


def demo_broadcast_and_reduce(rank: int, world_size: int) -> bool:
    tensor = torch.tensor(labels(rank, 3))
    before = tensor.clone()
    dist.broadcast(tensor, src=0)  # the source calls it too: it sends, every other rank overwrites its tensor
    ok = report(rank, world_size, "broadcast from rank 0", before, tensor, labels(0, 3))
    root, tensor = world_size - 1, torch.tensor(addends(rank))  # any rank can be the root
    before = tensor.clone()
    dist.reduce(tensor, dst=root)
    name, expected = f"reduce SUM to rank {root}", addends(np.arange(world_size)).sum(0)
    if rank != root:  # only the root's result is defined
        return line(rank, world_size, name, f"before {fmt(before)}  after: at rank {root}") and ok
    return report(rank, world_size, name, before, tensor, expected) and ok


def demo_all_reduce(rank: int, world_size: int) -> bool:
    ok = True
    for name, reference in {"SUM": np.sum, "AVG": np.mean, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max,
                            "BAND": np.bitwise_and.reduce, "BOR": np.bitwise_or.reduce,
                            "BXOR": np.bitwise_xor.reduce}.items():
        dtype = np.int64 if name.startswith("B") else np.float32  # gloo's bitwise reductions refuse floats
        tensor = torch.tensor(addends(rank, dtype))
        before = tensor.clone()
        dist.all_reduce(tensor, op=getattr(dist.ReduceOp, name))  # every rank ends with the same result
        expected = reference(addends(np.arange(world_size), dtype), axis=0).astype(dtype)
        ok &= report(rank, world_size, f"all_reduce {name}", before, tensor, expected)
    tensor = torch.tensor(addends(rank))
    before = tensor.clone()
    work = dist.all_reduce(tensor, async_op=True)  # returns at once; the communication runs in the background
    expected = addends(np.arange(world_size)).sum(0)  # work that leaves `tensor` alone overlaps with it
    work.wait()  # before it returns, `tensor` may hold partial sums, and writing it may change what is sent
    return report(rank, world_size, "all_reduce async_op=True", before, tensor, expected) and ok


def demo_gathers(rank: int, world_size: int) -> bool:
    tensor, expected = torch.tensor(labels(rank, 2)), labels(np.arange(world_size), 2)
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]  # one slot per rank
    dist.all_gather(gathered, tensor)
    ok = report(rank, world_size, "all_gather", tensor, gathered, expected)
    flat = torch.empty(world_size * tensor.numel())
    dist.all_gather_single(flat, tensor)  # one flat tensor, as FSDP gathers (all_gather_into_tensor: deprecated)
    ok &= report(rank, world_size, "all_gather_single", tensor, flat, expected.reshape(-1))
    gathered = [torch.empty_like(tensor) for _ in range(world_size)] if rank == 0 else None
    dist.gather(tensor, gather_list=gathered, dst=0)  # only the root passes a list; the others pass None, and call
    ok &= report(rank, world_size, "gather to rank 0", tensor, gathered, expected if rank == 0 else None)
    pieces, received = list(torch.tensor(expected)) if rank == 0 else None, torch.zeros(2)
    dist.scatter(received, scatter_list=pieces, src=0)  # rank r receives piece r, the root too
    return report(rank, world_size, "scatter from rank 0", pieces, received, labels(rank, 2)) and ok


def demo_reduce_scatter_and_all_to_all(rank: int, world_size: int) -> bool:
    # Rank r holds one piece per rank, 10r + i: rows of a (ranks x pieces) table.
    table, flat = labels(np.arange(world_size), world_size), torch.tensor(labels(rank, world_size))
    pieces, output = list(flat.view(world_size, 1)), torch.zeros(1)
    dist.reduce_scatter(output, pieces)  # rank i receives the sum of every rank's piece i
    ok = report(rank, world_size, "reduce_scatter SUM", pieces, output, table.sum(0)[rank : rank + 1])
    output = torch.zeros(1)
    dist.reduce_scatter_single(output, flat)  # an all-reduce's first half (reduce_scatter_tensor: deprecated)
    ok &= report(rank, world_size, "reduce_scatter_single SUM", flat, output, table.sum(0)[rank : rank + 1])
    received = [torch.zeros(1) for _ in range(world_size)]
    dist.all_to_all(received, pieces)  # rank r sends its piece i to rank i: a transpose of the table
    ok &= report(rank, world_size, "all_to_all", pieces, received, table[:, rank : rank + 1])
    received = torch.zeros(world_size)
    dist.all_to_all_single(received, flat)  # input_split_sizes would allow uneven pieces
    return report(rank, world_size, "all_to_all_single", flat, received, table[:, rank]) and ok


def demo_barriers(rank: int, world_size: int) -> bool:
    """Nobody leaves a barrier before all have come. monitored_barrier (gloo only) also names the late ranks."""
    barriers = {"barrier": dist.barrier, "monitored_barrier": lambda: dist.monitored_barrier(
        timeout=timedelta(seconds=10 * BARRIER_DELAY), wait_all_ranks=True)}
    ok = True
    for (name, barrier), late_rank in zip(barriers.items(), (0, world_size - 1), strict=True):
        dist.all_reduce(torch.zeros(1))  # lines the ranks up: they start the clock together
        start = time.monotonic()
        if rank == late_rank:
            time.sleep(BARRIER_DELAY)
        barrier()
        waited = time.monotonic() - start  # at least half: ranks leave the lining-up at different times
        ok &= line(rank, world_size, f"{name}, rank {late_rank} late", f"left after {waited:.2f} s",
                   waited >= BARRIER_DELAY / 2, f"at least {BARRIER_DELAY / 2} s")
    return ok


def demo_objects(rank: int, world_size: int) -> bool:
    """Picklable objects, sent as byte tensors: for small metadata, between trusted peers (unpickling runs code)."""
    every = [{"rank": r, "square": r * r} for r in range(world_size)]
    objects = [f"from rank {rank}", every[rank]]
    before = list(objects)
    dist.broadcast_object_list(objects, src=0)
    ok = report(rank, world_size, "broadcast_object_list from 0", before, objects, ["from rank 0", every[0]])
    gathered = [None] * world_size
    dist.all_gather_object(gathered, every[rank])
    ok &= report(rank, world_size, "all_gather_object", every[rank], gathered, every)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(every[rank], gathered, dst=0)
    ok &= report(rank, world_size, "gather_object to rank 0", every[rank], gathered, every if rank == 0 else None)
    received, pieces = [None], [f"for rank {r}" for r in range(world_size)] if rank == 0 else None
    dist.scatter_object_list(received, pieces, src=0)
    return report(rank, world_size, "scatter_object_list from 0", pieces, received, [f"for rank {rank}"]) and ok


def exchange(send: torch.Tensor, recv: torch.Tensor, next_rank: int, prev_rank: int,
             group: dist.ProcessGroup | None) -> list[dist.Work]:
    """Send to the next rank and receive from the previous one together: were every rank to send first, each
    would wait for its neighbour to receive, and none would. Both ends skip empty pieces (they agree on sizes)."""
    ops = [dist.P2POp(dist.irecv, recv, group=group, group_peer=prev_rank)] if recv.numel() else []
    ops += [dist.P2POp(dist.isend, send, group=group, group_peer=next_rank)] if send.numel() else []
    return dist.batch_isend_irecv(ops) if ops else []


_scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # kept between calls: see ring_all_reduce


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum `tensor` over the ranks of `group` in place, as dist.all_reduce(tensor), from messages only.

    The flat tensor is cut into n chunks (n ranks). Reduce-scatter, n-1 steps: at step s rank r sends chunk
    (r - s) mod n to rank r+1 and receives chunk (r - s - 1) mod n, adding its own part; then rank r holds the
    sum of chunk (r + 1) mod n. All-gather, n-1 steps: each rank passes on the complete chunk it got last.
    Every rank sends 2(n-1)/n of the tensor, the least any all-reduce can (Patarasuk and Yuan 2009). Big
    chunks go in segments of SEGMENT_BYTES, two in flight: adding one overlaps with receiving the next.
    """
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if world_size == 1 or tensor.numel() == 0:
        return
    next_rank, prev_rank = (rank + 1) % world_size, (rank - 1) % world_size
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.flatten()  # a view: results land in place
    # Views: messages go straight from and into the tensor. The first numel % n are one longer; some may be empty.
    chunks = flat.tensor_split(world_size)
    segments = max(1, math.ceil(chunks[0].numel() * flat.element_size() / SEGMENT_BYTES))
    # Partial sums arrive here, beside this rank's addend: room for the two segments in flight. The same
    # memory from call to call: a fresh buffer page-faults in on every call, up to a fifth of the time on CPU.
    rows, row_length = min(segments, 2), math.ceil(chunks[0].numel() / segments)
    key = (flat.dtype, flat.device)
    if key not in _scratch or _scratch[key].numel() < rows * row_length:
        _scratch[key] = flat.new_empty(rows * row_length)
    scratch = _scratch[key][: rows * row_length].view(rows, row_length)
    for step in range(world_size - 1):  # reduce-scatter
        sends = chunks[(rank - step) % world_size].tensor_split(segments)
        recvs = chunks[(rank - step - 1) % world_size].tensor_split(segments)
        incoming = [scratch[k % 2, : part.numel()] for k, part in enumerate(recvs)]
        works = [exchange(sends[0], incoming[0], next_rank, prev_rank, group)]
        for k in range(segments):
            if k + 1 < segments:  # the next segment travels while this one is added
                works.append(exchange(sends[k + 1], incoming[k + 1], next_rank, prev_rank, group))
            for work in works[k]:
                work.wait()  # the segment has arrived (and ours has left): only now may it be read
            recvs[k].add_(incoming[k])
    for step in range(world_size - 1):  # all-gather: complete chunks are received where they belong
        for work in exchange(chunks[(rank + 1 - step) % world_size], chunks[(rank - step) % world_size],
                             next_rank, prev_rank, group):
            work.wait()  # the next step forwards what this one received
    if not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))


def demo_ring_all_reduce(rank: int, world_size: int) -> bool:
    tensor = torch.tensor(labels(rank, 7))  # 7: chunks of unequal sizes at most world sizes
    before = tensor.clone()
    ring_all_reduce(tensor)
    return report(rank, world_size, "ring_all_reduce (hand-written)", before, tensor,
                  labels(np.arange(world_size), 7).sum(0))


def average_gradients(model: torch.nn.Module) -> None:
    """After backward each rank's gradients are its own batch's; their mean over the ranks is the gradient
    over every batch, so every replica takes the same step. DDP does this overlapped with backward."""
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


def demo_data_parallel(rank: int, world_size: int) -> bool:
    train_set, _ = make_datasets(16 * world_size, 1)
    torch.manual_seed(0)  # the same initial weights on every rank
    by_hand = build_model()
    ddp = DDP(copy.deepcopy(by_hand))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1) for model in (by_hand, ddp)]
    x, y = train_set[16 * rank : 16 * (rank + 1)]  # a batch of its own on every rank
    for _ in range(3):
        for model, optimizer in zip((by_hand, ddp), optimizers, strict=True):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()  # DDP averages the gradients here
            if model is by_hand:
                average_gradients(model)  # by hand: after backward, before the step
            optimizer.step()
    mine, theirs = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (by_hand, ddp.module))
    ok = line(rank, world_size, "by hand vs DDP, 3 steps", f"by hand {fmt(mine[:3])}  DDP {fmt(theirs[:3])}",
              check(mine, theirs.numpy(), tolerance=1e-5), "the same")  # DDP divides before summing, by hand after
    replicas = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(replicas, mine)  # replicas that differ by a bit drift apart from here on
    same = all(torch.equal(replica, mine) for replica in replicas)
    return line(rank, world_size, "replicas after 3 steps", f"{'identical' if same else 'different'} on "
                f"{world_size} ranks", same, "identical") and ok


DEMOS = (demo_broadcast_and_reduce, demo_all_reduce, demo_gathers, demo_reduce_scatter_and_all_to_all, demo_barriers,
         demo_objects, demo_ring_all_reduce, demo_data_parallel)


def main() -> None:
    parse_args()
    if "RANK" not in os.environ:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        raise SystemExit("error: start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 4 "
                         "comm_collectives.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://: meets at MASTER_ADDR:MASTER_PORT
    try:
        total = torch.zeros((), dtype=torch.int64)  # mismatches
        for demo in DEMOS:
            total += not demo(rank, world_size)
            dist.barrier()  # not needed by the collectives: it keeps each demo's lines together in the output
        dist.all_reduce(total)  # every rank learns of any mismatch, so all of them exit with the same status
        if rank == 0:
            print(f"{total.item()} mismatches" if total.item() else "all results match", f"on {world_size} ranks")
    finally:
        dist.destroy_process_group()
    if total.item():
        raise SystemExit(1)


if __name__ == "__main__":
    main()
