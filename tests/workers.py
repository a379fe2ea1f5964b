"""Functions that tests/harness.spawn runs on every rank (its workers receive them by name, pickled)."""
import sys
from collections.abc import Callable
from unittest import mock

import torch


def train_script(rank: int, world_size: int, script: str, argv: list[str]) -> dict:
    """Parse argv as the script would, run its train() on this rank, return the final weights."""
    module = __import__(script)
    sys.argv = [f"{script}.py", *argv]
    args = module.parse_args()
    model = module.train(args, rank, world_size)
    return model.state_dict()


def train_script_per_rank(rank: int, world_size: int, script: str, argv_by_rank: list[list[str]]) -> dict:
    """train_script with arguments of each rank's own: what ranks on different nodes may see."""
    return train_script(rank, world_size, script, argv_by_rank[rank])


def bucket_layouts(rank: int, world_size: int, backward_passes: int) -> list[list[list[str]]]:
    """The parameters in each of DDP's gradient buckets, by name, at each backward pass of the
    default model, as a communication hook sees them."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from model import build_model

    torch.manual_seed(0)
    model = DDP(build_model("mlp"))
    names = {param.data_ptr(): name for name, param in model.module.named_parameters()}
    passes: list[list[list[str]]] = []

    def record(state, bucket):
        passes[-1].append([names[param.data_ptr()] for param in bucket.parameters()])
        return allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, record)
    for _ in range(backward_passes):
        passes.append([])
        model(torch.ones(2, 20)).sum().backward()
    return passes


def train_scripts(rank: int, world_size: int, runs: list[tuple[str, list[str]]]) -> list[dict]:
    """train_script for each (script, argv) in turn, in one process group: one start-up for several
    runs. Each run's output follows the previous one's on this rank's stdout."""
    return [train_script(rank, world_size, script, argv) for script, argv in runs]


def failure(run: Callable[[], object], module: object, name: str, replacement: object) -> str | None:
    """run() with module.name replaced by something broken: the message of the SystemExit with which the
    script fails its own check, or None where this rank passed it."""
    with mock.patch.object(module, name, replacement):
        try:
            run()
        except SystemExit as exc:
            return str(exc)
    return None


def warmed_up(rank: int, world_size: int) -> dict:
    """What this worker inherited from the fork server's warmup (tests/forkserver_warmup.py)."""
    import gc
    gpt_data = sys.modules.get("gpt.data")
    return {"frozen": gc.get_freeze_count(), "deepspeed": "deepspeed" in sys.modules,
            "synthetic drawn": gpt_data is not None and gpt_data.synthetic_stream.cache_info().currsize == 1}
