"""Functions that tests/harness.spawn runs on every rank (spawn needs them importable by name)."""
import sys

import torch


def train_script(rank: int, world_size: int, script: str, argv: list[str]) -> dict:
    """Parse argv as the script would, run its train() on this rank, return the final weights."""
    module = __import__(script)
    sys.argv = [f"{script}.py", *argv]
    args = module.parse_args()
    model = module.train(args, rank, rank, world_size, torch.device("cpu"))
    return model.state_dict()
