"""What train.py checks before any step (the data, OUT_DIR, --export) and at a save (the weights), each the same on
every rank: a ValueError, one line, and nothing trained or saved on bad input."""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import data


def check_input(args: argparse.Namespace, tokens: data.Tokens, rank: int, world_size: int,
                device: torch.device) -> None:
    """Bad data or paths stop every rank alike, before any step, with one line (a ValueError).

    Every token id must fit the vocab: an embedding fed one that does not fails with a cryptic
    device-side error, possibly hours in. The ranks scan a share of each file each, and an
    all-reduce (max) tells all of them; once per OUT_DIR and file: its largest id is kept there for
    the next start, which reads only a file changed since (data.remembered). Rank 0 tries --out_dir
    and --export, and tells the others; then every rank looks for the file rank 0 wrote there: DCP
    writes each rank's shard into one folder, so OUT_DIR must be one that every rank shares (on
    several nodes, a shared file system)."""
    data.check(tokens, args.seq_len)
    largest, unread = [], []
    if tokens.files:  # none for synthetic: its ids are below its vocab by construction
        # Rank 0's view of the kept ids decides for every rank: all then read the same files and join
        # the same all-reduce, or none does (a rank that judged alone could skip it and hang the others).
        kept = [data.remembered(args.out_dir, tokens.files) if rank == 0 else None]
        dist.broadcast_object_list(kept, src=0)
        largest = kept[0]
        unread = [i for i, n in enumerate(largest) if n is None]
        if unread:
            found = torch.tensor([data.largest_id(tokens.files[i].tokens, rank, world_size) for i in unread],
                                 device=device)
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # each rank read a share of each file
            for i, n in zip(unread, found.tolist(), strict=True):
                largest[i] = n
        if max(largest) >= tokens.vocab_size:
            raise ValueError(f"--data {tokens.name}: token id {max(largest)} is outside the vocab of "
                             f"{tokens.vocab_size}: set --vocab_size"
                             + (", or --data_dtype uint32 if the files hold uint32 ids"
                                if any(f.format == "raw uint16" for f in tokens.files) else ""))
    problem = [None, None]  # (what is wrong, the file rank 0 wrote)
    if rank == 0:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
            open(os.path.join(args.out_dir, "metrics.jsonl"), "a").close()
            problem[1] = os.path.join(args.out_dir, f".probe-{os.urandom(6).hex()}")  # this job's alone
            open(problem[1], "w").close()  # the folder takes new files
            if args.export:
                if os.path.isdir(args.export):
                    raise IsADirectoryError(21, "is a folder", args.export)
                open(args.export + ".tmp", "wb").close()  # the file export() will write, then rename
                os.remove(args.export + ".tmp")
        except OSError as error:
            problem[0] = f"{error.filename}: {error.strerror}"
    dist.broadcast_object_list(problem, src=0)  # every rank stops, or none does
    unseen = torch.tensor(0 if problem[0] or os.path.exists(problem[1]) else rank + 1, device=device)
    dist.all_reduce(unseen, op=dist.ReduceOp.MAX)  # after it every rank has looked: rank 0 may remove the file
    if rank == 0 and problem[1] and os.path.exists(problem[1]):
        os.remove(problem[1])
    if problem[0]:
        raise ValueError(problem[0])
    if unseen.item():
        raise ValueError(f"--out_dir {args.out_dir}: rank {unseen.item() - 1} does not see the file that rank 0 "
                         "wrote there: checkpoints need a folder that every rank shares")
    if rank == 0 and unread:  # no collective here; only once OUT_DIR passed: bad data or paths create nothing
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
