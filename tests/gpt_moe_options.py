"""gpt/train.py with moe-tiny's GPTConfig changed by MOE_OPTIONS (JSON: fields and values) and, with MOE_BIAS (JSON: one
number per expert), every MoE layer's expert biases starting there, not at 0: a router so skewed that every token
takes the same experts and the others none. With MOE_NO_REDUCE set, moe_step sums no rank's routing but its own (the
test that shows the MoE proof can fail); with MOE_NO_TP_SUM, the experts' gradients not summed over the tp ranks;
with MOE_NO_TP_ROUTING, each tp rank's routing its own, not summed for the auxiliary loss; with MOE_NO_PP_ROUTING,
each pipeline stage's routing its own, not sent on; with MOE_NO_CP_ROUTING, each cp rank's routing its own; with
MOE_NO_CP_AUX_GRAD, the cp ranks' routing summed but not the auxiliary loss's gradient; with MOE_EP_MUTANT=combine,
ep_forward's results sent back in its experts' order, not in the order received; with MOE_EP_MUTANT=splits, its
dispatch's split sizes swapped (what each rank sends for what it receives). For tests/test_gpt_moe.py; main() is
gpt/train.py's."""
import inspect
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

import model  # noqa: E402  gpt/model.py, as train imported it

model.CONFIGS["moe-tiny"] = {**model.CONFIGS["moe-tiny"], **json.loads(os.environ.get("MOE_OPTIONS", "{}"))}
zero_buffers, moe_step = train.parallelize.zero_buffers, train.parallelize.moe_step


def skewed(gpt: torch.nn.Module) -> None:
    zero_buffers(gpt)
    for module in gpt.modules():
        if isinstance(module, model.MoE):
            module.expert_bias.copy_(torch.tensor(json.loads(os.environ["MOE_BIAS"])))


def unreduced(model: torch.nn.Module) -> None:
    all_reduce = train.parallelize.dist.all_reduce
    train.parallelize.dist.all_reduce = lambda tensor, *args, **kwargs: None
    try:
        moe_step(model)
    finally:
        train.parallelize.dist.all_reduce = all_reduce


def local_routing(layer, group, x):
    return model.MoE.forward(layer, x)


if "MOE_NO_TP_SUM" in os.environ:
    train.parallelize.tp_moe_gradients = lambda model: None
if "MOE_NO_TP_ROUTING" in os.environ:
    train.parallelize.tp_moe_forward = local_routing
if "MOE_NO_CP_ROUTING" in os.environ:
    train.context.moe_forward = lambda layer, group, forward, x: forward(x)
if "MOE_NO_CP_AUX_GRAD" in os.environ:
    train.context.SumOver.backward = staticmethod(lambda ctx, grad: (grad, None))
if "MOE_NO_PP_ROUTING" in os.environ:
    stage_forward = train.pipeline.Stage.forward
    train.pipeline.Stage.forward = lambda self, x, routing=None: stage_forward(self, x)
EP_MUTANTS = {"combine": ("torch.empty_like(y).index_copy(0, order, y)", "y"),
              "splits": ("AllToAll.apply(x, splits_out, splits_in, group)",
                         "AllToAll.apply(x, splits_in, splits_out, group)")}
if "MOE_EP_MUTANT" in os.environ:  # ep_forward's source, changed in one place, in parallelize.py's namespace
    source = inspect.getsource(train.parallelize.ep_forward)
    was, now = EP_MUTANTS[os.environ["MOE_EP_MUTANT"]]
    assert source.count(was) == 1, f"ep_forward no longer says {was}"
    exec(source.replace(was, now), train.parallelize.__dict__)
if "MOE_BIAS" in os.environ:
    train.parallelize.zero_buffers = skewed
if "MOE_NO_REDUCE" in os.environ:
    train.parallelize.moe_step = unreduced
main = train.main
if __name__ == "__main__":  # run by hand under torchrun, as gpt/train.py is (the tests' harness calls main())
    main()
