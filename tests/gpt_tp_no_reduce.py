"""gpt/train.py with one collective of tensor parallel left out: the all-reduce over the tp ranks of the
gradients that sequence parallel leaves partial (the norms', each tp rank summed over its own tokens only),
which FSDP2 does as it takes a gradient (FSDPParam._get_grad_inner_tensor, torch 2.13). For the test that
shows the tp proof can fail (tests/test_gpt.py). Run as a script of the harness: main() is gpt/train.py's."""
import sys
from pathlib import Path

from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train", "parallelize"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

take = FSDPParam._get_grad_inner_tensor


def unreduced(self, grad):
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad._local_tensor  # this rank's partial sum, taken for the whole: the all-reduce left out
    return take(self, grad)


FSDPParam._get_grad_inner_tensor = unreduced
main = train.main
