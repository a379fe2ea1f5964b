"""gpt/train.py with context parallel broken in one place, as CP_MUTANT says: `chunks`, each rank's tokens a plain
1/cp of the sequence (not head-tail), their positions still head-tail's; `positions`, the head-tail tokens at the
places 0, 1, ... of a sequence of their own (rotary tables and learned positions of the wrong places); `mask`, the
gathered keys masked as if in the sequence's order, not the ranks'; `merge`, the ring's partial results averaged,
not weighted by their share of the softmax. For the test that shows the cp proof can fail (tests/test_gpt_context.py);
main() is gpt/train.py's."""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpt"))
for name in ("model", "data", "train"):  # the root's model.py and data.py, preloaded: gpt/ has its own
    sys.modules.pop(name, None)
import train  # noqa: E402

import context  # noqa: E402  gpt/context.py, as train imported it

split, mutant = context.split_sequences, os.environ["CP_MUTANT"]


def plain_chunks(group, module, args, kwargs):
    size = args[0].shape[1] // group.size()
    mine = torch.arange(group.rank() * size, (group.rank() + 1) * size, device=args[0].device)
    _, kwargs = split(group, module, args, kwargs)
    return tuple(t[:, mine] for t in args), kwargs


def own_positions(group, module, args, kwargs):
    args, kwargs = split(group, module, args, kwargs)
    return args, {**kwargs, "positions": torch.arange(args[0].shape[1], device=args[0].device)}


def sequence_order(group, q, k, v, dropout_p):
    mine = context.positions(q.shape[2] * group.size(), group.size(), group.rank(), q.device)
    k, v = (context.Gather.apply(t, group).permute(1, 2, 0, 3, 4).flatten(2, 3) for t in (k, v))
    theirs = torch.arange(k.shape[2], device=q.device)  # the ranks' order taken for the sequence's
    return F.scaled_dot_product_attention(q, k, v, attn_mask=theirs[None, :] <= mine[:, None], dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


if mutant == "mask":
    context.ATTENTION["allgather"] = sequence_order
elif mutant == "merge":
    context.merge = lambda out, lse, part, part_lse: ((out + part) / 2, torch.logaddexp(lse, part_lse))
else:
    context.split_sequences = {"chunks": plain_chunks, "positions": own_positions}[mutant]
main = train.main
