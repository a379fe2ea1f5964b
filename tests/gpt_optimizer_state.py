"""gpt/train.py that reports, after a resume, where each optimizer state tensor lives and where a
fresh run's optimizer keeps it (tests/test_gpt_checkpoints.py). main() is gpt/train.py's."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

_resume = train.resume


def where(optimizer: torch.optim.Optimizer) -> list[dict[str, str]]:
    return [{key: f"{value.device}/{value.dtype}" for key, value in optimizer.state[p].items()}
            for group in optimizer.param_groups for p in group["params"]]


def resume(args, checkpoints, parts, optimizers, scaler, config, rank):
    step = _resume(args, checkpoints, parts, optimizers, scaler, config, rank)
    (model,), (optimizer,) = parts, optimizers  # no pipeline: one model, one optimizer
    fresh = train.make_optimizer(model, args)
    for group in fresh.param_groups:
        group["lr"] = 0.0  # a step that creates the state a fresh run's first step creates, and changes nothing
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    fresh.step()
    model.zero_grad(set_to_none=True)
    print("[optimizer state] " + json.dumps({"resumed": where(optimizer), "fresh": where(fresh)}), flush=True)
    return step


train.resume = resume
main = train.main
