"""Debugging a hang: a collective that only some ranks call, made to fail fast and named.

The classic deadlock of distributed code is a collective behind a rank guard, such as an all_reduce
inside `if rank == 0:`. That rank waits in it for ranks that never call it, the others wait in
their next collective for that rank, and the job prints nothing for as long as the process group
waits: 30 minutes for gloo and 10 for nccl, unless init_process_group gets a timeout. This script
runs that bug, reduced to one step of a training loop (the all_reduce of a loss for the log, then
an all_gather of every rank's wish to stop early), and shows three ways to see it:

    torchrun --standalone --nproc-per-node 2 debug_hang.py
    torchrun --standalone --nproc-per-node 3 debug_hang.py --monitored_barrier --stuck_rank 2
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 debug_hang.py
    torchrun --standalone --nproc-per-node 2 debug_hang.py --fixed

1. --timeout: every rank's collective gives up after that many seconds, and every rank says where.
2. --monitored_barrier: dist.monitored_barrier before the next collective; rank 0 names the ranks
   that did not arrive (so rank 0 must be one that does: hence --stuck_rank 2).
3. TORCH_DISTRIBUTED_DEBUG=DETAIL: each collective is first compared across ranks, and the
   mismatch is reported at once, naming both collectives.
--fixed calls the all_reduce on every rank and guards only the print: nothing waits. docs/troubleshooting.md
lists what to set when a real job hangs. Explained in docs/past_the_basics.md.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import common


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=common.timeout_seconds, default=5.0,
                        help="seconds (1 to 1e7) a collective waits for a peer before the process group gives up")
    parser.add_argument("--stuck_rank", type=common.number_in(0, 10**6, int), default=0,
                        help="the rank that calls all_reduce inside `if rank == STUCK_RANK:` (below the world size)")
    parser.add_argument("--monitored_barrier", action="store_true",
                        help="call dist.monitored_barrier before the next collective: rank 0 names the missing ranks")
    parser.add_argument("--fixed", action="store_true",
                        help="call the all_reduce on every rank, as it should be: nothing hangs")
    common.reject_old_launcher_flag(parser)
    return parser.parse_args()


def step(args: argparse.Namespace, rank: int, world_size: int) -> None:
    """One step of a training loop, reduced to its collectives; one line on stderr and exit 1 if a
    collective fails."""
    if rank == 0:
        who = "every rank calls all_reduce" if args.fixed else f"rank {args.stuck_rank} alone calls all_reduce"
        # The level torch read from TORCH_DISTRIBUTED_DEBUG as torch.distributed was imported: the
        # variable must be in the environment that starts the processes; setting os.environ later
        # changes nothing.
        print(f"{world_size} ranks | {who} | timeout {args.timeout:g} s | "
              f"TORCH_DISTRIBUTED_DEBUG={dist.get_debug_level().name}", flush=True)
    started = time.monotonic()
    where = "all_reduce"
    try:
        loss = torch.tensor([float(rank + 1)])  # stands for this rank's mean loss
        if args.fixed:
            dist.all_reduce(loss)  # on every rank: only the print below is behind the guard
        elif rank == args.stuck_rank:
            # THE BUG: a collective behind a rank guard. This rank waits in it for the others, who
            # never call it: they have gone on to the all_gather below, where they wait for this one.
            dist.all_reduce(loss)
        if rank == 0 and args.fixed:
            print(f"mean loss over the ranks: {loss.item() / world_size:g}", flush=True)
        if args.monitored_barrier:
            where = "monitored_barrier"
            # Rank 0 waits for every other rank to arrive, then names those that did not. Its timeout
            # must be given: left out, it is the backend's default (30 minutes), not the group's.
            dist.monitored_barrier(timeout=timedelta(seconds=args.timeout), wait_all_ranks=True)
        where = "all_gather"
        # Every rank's next collective: does any rank want to stop early? An all_gather needs every
        # rank's part, so no rank gets past it without the stuck one. (A broadcast can complete on a
        # rank that hears from rank 0 alone; an all_reduce would be paired by gloo with the guarded
        # all_reduce, and add unrelated numbers: see uneven_inputs.py.)
        wishes = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(wishes, torch.zeros(1))
    except RuntimeError as exc:  # gloo's timeouts and DETAIL's report alike
        message = str(exc).replace("\n", " ")
        common.die(f"[rank {rank}/{world_size}] {where} failed after {time.monotonic() - started:.1f} s: {message}",
                   code=1)
    common.print_line(f"[rank {rank}/{world_size}] step done in {time.monotonic() - started:.1f} s")


def main() -> None:
    args = parse_args()
    rank, _, world_size = common.torchrun_ranks("debug_hang.py")  # as singlenode_cpu.py
    if world_size < 2:
        common.die("a hang takes two ranks or more: torchrun --standalone --nproc-per-node 2 debug_hang.py")
    if args.stuck_rank >= world_size:
        common.die(f"--stuck_rank {args.stuck_rank} names no rank: there are {world_size} (0 to {world_size - 1})")
    timeout = timedelta(seconds=args.timeout)
    # The timeout bounds every collective of this group: the wait of a hang, but also the longest a
    # rank may legitimately lag behind the others (rank 0 saving a checkpoint, say).
    dist.init_process_group("gloo", store=common.torchrun_store(timeout), rank=rank, world_size=world_size,
                            timeout=timeout)
    try:
        step(args, rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    common.exit_now()
