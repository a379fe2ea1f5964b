"""How fast the collectives are on this machine, measured the way NVIDIA's nccl-tests measure them, with the
hand-written ring_all_reduce of comm_collectives.py beside dist.all_reduce.

For each size, a power of two from --min-bytes to --max-bytes, every operation is checked once, warmed up,
then timed: barrier, --iters iterations, in --rounds rounds that alternate between the operations (a slow
moment of a shared machine then hits all of them alike). The time of one operation is the mean over the
iterations, averaged across ranks. As in nccl-tests:
    algbw = size / time (GB/s, 1 GB = 1e9 bytes)
    busbw = algbw × factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1
where size is the whole buffer (the gathered output of all_gather, the input of reduce_scatter). busbw is
comparable with the bandwidth of the link, whatever the number of ranks n. "vs all_reduce" is the ring's
busbw over all_reduce's at the same size (all_reduce's time over the ring's), measured in the same run.

    torchrun --standalone --nproc-per-node 4 bench_comm.py
    torchrun --standalone --nproc-per-node 2 bench_comm.py --min-bytes 16M --max-bytes 64M --json
    torchrun --standalone --nproc-per-node 8 bench_comm.py --backend nccl

Rank 0 prints a table (or, with --json, one JSON document). Started with plain python, it prints how to
launch it and exits with status 2.
Explained in docs/benchmarks.md.
"""
import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

import benchtools
from benchtools import die, print_line
from comm_collectives import ring_all_reduce

OPERATIONS = ("all_reduce", "ring_all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
COUNT = benchtools.number_in(1, 10_000, int)  # iterations or rounds: more would run for days


def size_in_bytes(text: str) -> int:
    """'1024', '64K', '16M' or '1G' (powers of 1024, as nccl-tests reads them)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in UNITS else ""
    try:
        value = int(text[: len(text) - len(unit)]) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 64K or 16M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="nccl" if torch.cuda.is_available() else "gloo",
        help="gloo for CPU tensors, nccl for CUDA tensors (one GPU per process); default: nccl if CUDA is available",
    )
    parser.add_argument("--ops", nargs="+", choices=OPERATIONS, default=list(OPERATIONS), help="what to time")
    parser.add_argument("--min-bytes", type=size_in_bytes, default=size_in_bytes("1K"), help="smallest size")
    parser.add_argument("--max-bytes", type=size_in_bytes, default=size_in_bytes("64M"), help="largest size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="element type")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per operation and size")
    parser.add_argument("--iters", type=COUNT, default=5, help="timed iterations per round")
    parser.add_argument("--rounds", type=COUNT, default=4,
                        help="rounds per size, each timing every operation once in turn")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    parser.add_argument("--timeout", type=benchtools.timeout_seconds, default=300.0,
                        help="seconds a collective waits for a peer before the process group gives up")
    args = parser.parse_args()
    if args.min_bytes > args.max_bytes:
        parser.error("--min-bytes is larger than --max-bytes")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")
    return args


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of two from min_bytes (rounded up to one) to max_bytes."""
    size = 1 << (min_bytes - 1).bit_length()
    result = []
    while size <= max_bytes:
        result.append(size)
        size *= 2
    return result


def element_count(operation: str, size: int, element_size: int, world_size: int) -> int:
    """Elements in the whole buffer, as nccl-tests counts them: all_gather, reduce_scatter and all_to_all
    split the buffer into world_size equal pieces, so the count is rounded down to a multiple of it."""
    count = size // element_size
    if operation in ("all_gather", "reduce_scatter", "all_to_all"):
        count -= count % world_size
    return count


def bus_factor(operation: str, world_size: int) -> float:
    """busbw / algbw. An all-reduce must send and receive 2(n-1)/n of the buffer on every rank; all_gather,
    reduce_scatter and all_to_all (n-1)/n; broadcast the buffer once."""
    n = world_size
    if operation in ("all_reduce", "ring_all_reduce"):
        return 2 * (n - 1) / n
    if operation in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if operation == "broadcast":
        return 1.0
    raise ValueError(f"no bus factor for {operation}")


def bandwidths(operation: str, size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second) for `size_bytes` moved in `seconds`."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * bus_factor(operation, world_size)


def prepare(operation: str, count: int, rank: int, world_size: int, dtype: torch.dtype,
            device: torch.device) -> tuple[Callable[[], object], Callable[[], int]]:
    """(run, check): run() does the operation once; check() returns how many elements of its last result
    are wrong. Every rank starts with the value rank + 1, so every right answer is known in advance."""
    def full(elements: int, value: float) -> torch.Tensor:
        return torch.full((elements,), value, dtype=dtype, device=device)

    def pieces(elements: int) -> torch.Tensor:  # piece i of the buffer holds i + 1
        return (torch.arange(world_size, device=device) + 1).to(dtype).repeat_interleave(elements // world_size)

    total = world_size * (world_size + 1) // 2  # the sum of rank + 1 over the ranks
    piece = count // world_size
    if operation in ("all_reduce", "ring_all_reduce"):
        result = full(count, rank + 1)  # in place
        reduce = dist.all_reduce if operation == "all_reduce" else ring_all_reduce
        run, expected = (lambda: reduce(result)), full(count, total)
    elif operation == "all_gather":
        source, result = full(piece, rank + 1), full(count, 0)
        run, expected = (lambda: dist.all_gather_single(result, source)), pieces(count)
    elif operation == "reduce_scatter":
        source, result = full(count, rank + 1), full(piece, 0)
        run, expected = (lambda: dist.reduce_scatter_single(result, source)), full(piece, total)
    elif operation == "broadcast":
        result = full(count, rank + 1)  # in place
        run, expected = (lambda: dist.broadcast(result, src=0)), full(count, 1)
    elif operation == "all_to_all":
        # Rank r sends its piece i to rank i; every piece holds r + 1, so piece j received comes from rank j.
        source, result = full(count, rank + 1), full(count, 0)
        run, expected = (lambda: dist.all_to_all_single(result, source)), pieces(count)
    else:
        raise ValueError(f"unknown operation {operation}")
    return run, lambda: int((result != expected).sum())


def timed(run: Callable[[], object], iterations: int, device: torch.device) -> float:
    """Seconds for `iterations` calls of run, finished (nccl returns before the GPU is done)."""
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    benchtools.finish(device)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, size: int, rank: int, world_size: int, device: torch.device) -> list[dict]:
    """Check, warm up and time every operation at one size; one row per operation, the same on every rank."""
    dtype = DTYPES[args.dtype]
    element_size = torch.empty((), dtype=dtype).element_size()
    counts = {op: element_count(op, size, element_size, world_size) for op in args.ops}
    prepared = {op: prepare(op, counts[op], rank, world_size, dtype, device) for op in args.ops}
    wrong = []
    for run, check in prepared.values():
        run()
        wrong.append(check())  # on the first result, before repeated in-place calls make the values grow
        for _ in range(args.warmup):
            run()
    seconds = torch.zeros(len(args.ops), dtype=torch.float64)
    for _ in range(args.rounds):
        for i, (run, _) in enumerate(prepared.values()):
            # Every rank starts the clock together: otherwise the first to arrive also times its wait for the last.
            dist.barrier()
            seconds[i] += timed(run, args.iters, device)
    # Each rank timed its own calls: average over ranks, and sum the wrong elements of all ranks.
    totals = torch.cat([seconds / (args.rounds * args.iters), torch.tensor(wrong, dtype=torch.float64)]).to(device)
    dist.all_reduce(totals)
    mean_seconds, wrong = (totals[: len(args.ops)] / world_size).tolist(), totals[len(args.ops):].tolist()
    rows = []
    for op, op_seconds, op_wrong in zip(args.ops, mean_seconds, wrong, strict=True):
        size_bytes = counts[op] * element_size
        algbw, busbw = bandwidths(op, size_bytes, op_seconds, world_size)
        rows.append({"operation": op, "bytes": size_bytes, "count": counts[op], "time_us": op_seconds * 1e6,
                     "algbw_GBps": algbw, "busbw_GBps": busbw, "wrong": int(op_wrong)})
    by_op = {row["operation"]: row for row in rows}
    if "all_reduce" in by_op and "ring_all_reduce" in by_op:
        # all_reduce's time over the ring's: the ring's busbw over all_reduce's (same size and factor), and
        # still defined with one rank, where every busbw is 0.
        by_op["ring_all_reduce"]["vs_all_reduce"] = by_op["all_reduce"]["time_us"] / by_op["ring_all_reduce"][
            "time_us"]
    return rows


def print_table(args: argparse.Namespace, world_size: int, description: str, rows: list[dict]) -> None:
    print_line(f"# bench_comm.py: {args.backend}, {world_size} ranks, {args.dtype}, {args.rounds} rounds × "
               f"{args.iters} timed iterations ({args.warmup} warm-up) per operation and size")
    print_line(f"# {description}")
    print_line(f"# {'size (B)':>10} {'count':>10}  {'operation':<16} {'time (us)':>11} {'algbw (GB/s)':>12} "
               f"{'busbw (GB/s)':>12} {'wrong':>5}  vs all_reduce")
    for row in rows:
        ratio = f"{row['vs_all_reduce']:.3f}" if "vs_all_reduce" in row else ""
        print_line(f"  {row['bytes']:>10} {row['count']:>10}  {row['operation']:<16} {row['time_us']:>11.1f} "
                   f"{row['algbw_GBps']:>12.3f} {row['busbw_GBps']:>12.3f} {row['wrong']:>5}  {ratio}".rstrip())


def main() -> None:
    args = parse_args()
    launched = benchtools.launcher_env()  # None without a launcher
    if launched is None:
        die("start this script with torchrun, e.g. torchrun --standalone --nproc-per-node 4 bench_comm.py")
    rank, local_rank, world_size, procs_on_node = launched
    device = benchtools.pick_device(args.backend, local_rank, procs_on_node)
    # Each operation keeps its buffers and its expected result, up to 3 times the size, on every process here.
    benchtools.check_memory(3 * args.max_bytes * len(args.ops) * procs_on_node,
                            f"--max-bytes {args.max_bytes} for {len(args.ops)} operations on {procs_on_node} "
                            f"process{'es' if procs_on_node > 1 else ''}")
    element_size = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    if args.min_bytes < element_size * world_size:
        die(f"--min-bytes must hold at least one {args.dtype} per rank: {element_size * world_size} bytes")

    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout))
    try:
        rows = [row for size in sizes(args.min_bytes, args.max_bytes)
                for row in measure(args, size, rank, world_size, device)]
    finally:
        dist.destroy_process_group()
    if rank == 0:  # every rank holds the same rows (averaged across ranks): one prints them
        description = benchtools.machine(device)
        if args.json:
            print_line(json.dumps({
                "backend": args.backend, "world_size": world_size, "dtype": args.dtype, "warmup": args.warmup,
                "iters": args.iters, "rounds": args.rounds, "machine": description, "rows": rows,
            }, indent=1))
        else:
            print_table(args, world_size, description, rows)
    if any(row["wrong"] for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
    benchtools.exit_now()  # skips the interpreter's teardown of torch (see benchtools)
