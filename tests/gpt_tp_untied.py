"""gpt/train.py whose tensor parallel leaves the head untied from the embedding, as parallelize_module
leaves it: the head's gradient never reaches the embedding. For the test that shows the tp proof can fail
(tests/test_gpt.py); DTensor redistributes whatever a plan leaves out, so no collective of the plan can
simply be dropped (gpt_tp_no_reduce.py drops the one FSDP makes for tp). Run as a script of the harness:
main() is gpt/train.py's."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train", "parallelize"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

tensor_parallel = train.parallelize.tensor_parallel


def untied(model, mesh) -> None:
    tensor_parallel(model, mesh)
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())  # a matrix of its own


train.parallelize.tensor_parallel = untied
main = train.main
