"""expert_parallel.py at 2 and 4 ranks: the MoE layer's output and gradients equal the same layer in one process
with the same routing; the tokens each expert receives are those its router kept on every rank; training ends
with one process's weights; without the shared weights' all-reduce the run fails its check."""
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from harness import spawn
from test_errors import assert_one_line, run_main
from workers import failure, train_script

import expert_parallel

ARGV = ["--steps", "3", "--capacity_factor", "1.0", "--n_experts", "4"]  # 1.0: some tokens are dropped


def layer_and_training(rank: int, world_size: int) -> dict:
    sys.argv = ["expert_parallel.py", *ARGV]
    args = expert_parallel.parse_args()
    moe = expert_parallel.build(args, world_size, rank).blocks[0].mlp  # this rank's experts
    whole = expert_parallel.build(args, 1, 0).blocks[0].mlp  # all of them, in this process
    parts = torch.randn(world_size, 4, 8, args.n_embd, generator=torch.Generator().manual_seed(3))  # every rank's x
    grads = torch.randn(world_size, 4, 8, args.n_embd, generator=torch.Generator().manual_seed(4))
    x, reference_x = parts[rank].clone().requires_grad_(), parts.clone().requires_grad_()
    (moe(x) * grads[rank]).sum().backward()  # this rank's part, its experts anywhere
    out, received = moe(x).detach(), dict(moe.received)
    reference_out, routed = [], 0
    for r in range(world_size):  # one process, every part alone: the same capacities, the same routing
        reference_out.append(whole(reference_x[r]))
        routed = routed + whole.routed
    sum(((o * g).sum() for o, g in zip(reference_out, grads, strict=True))).backward()
    dist.all_reduce(moe.router.weight.grad)  # the router's gradient: every rank's part
    experts = {name: (p.grad - dict(whole.named_parameters())[name].grad).abs().max().item()
               for name, p in moe.named_parameters()}
    results = {"out": (out - reference_out[rank].detach()).abs().max().item(),
               "x grad": (x.grad - reference_x.grad[rank]).abs().max().item(), "gradients": experts,
               "received": received, "routed": {e: int(routed[e]) for e in received}}
    sent, forward = [], expert_parallel.AllToAll.forward

    def counted(ctx, x, counts_out, counts_in):  # the floats this rank sends to other ranks
        sent.append(sum(n for r, n in enumerate(counts_in) if r != rank) * x.shape[1])
        return forward(ctx, x, counts_out, counts_in)
    with mock.patch.object(expert_parallel.AllToAll, "forward", staticmethod(counted)):
        train_script(rank, world_size, "expert_parallel", ["--steps", "0"])
    results["sent"] = sent
    results["weights"] = train_script(rank, world_size, "expert_parallel", ARGV)
    results["broken"] = failure(lambda: train_script(rank, world_size, "expert_parallel", [*ARGV[:1], "0", *ARGV[2:]]),
                                expert_parallel, "average_gradients", lambda model, world_size: None)  # no all-reduce
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return {n: spawn(layer_and_training, n, timeout=120)[0] for n in (2, 4)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_layer_s_output_and_gradients_are_one_process_s(runs, world_size):
    """fp32, to 1e-5: an expert's gradient sums its rows in another order when they come from several ranks."""
    for result in runs[world_size]:
        assert result["out"] <= 1e-6 and result["x grad"] <= 1e-5
        assert max(result["gradients"].values()) <= 1e-5 and "router.weight" in result["gradients"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_expert_receives_the_tokens_every_rank_s_router_kept_for_it(runs, world_size):
    experts = set()
    for result in runs[world_size]:
        assert result["received"] == result["routed"] and sum(result["received"].values()) > 0
        experts |= set(result["received"])
    assert experts == set(range(4))


@pytest.mark.parametrize("world_size", [2, 4])
def test_training_ends_with_one_process_s_weights(runs, world_size):
    """3 AdamW steps, to 1e-4: Adam divides each number's gradient by its own running RMS, so the 1e-8
    differences of a near-zero gradient can change its step."""
    sys.argv = ["expert_parallel.py", *ARGV]
    args = expert_parallel.parse_args()
    reference = expert_parallel.build(args, 1, 0)
    tokens = torch.randint(expert_parallel.VOCAB_SIZE, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    for _ in range(args.steps + 1):
        expert_parallel.one_process_step(reference, tokens, world_size, args.aux_weight)
        optimizer.step()
        optimizer.zero_grad()
    whole, seen = reference.state_dict(), set()
    for result in runs[world_size]:
        for name, tensor in result["weights"].items():
            assert torch.allclose(tensor, whole[name], atol=1e-4, rtol=0), name
            seen.add(name)
    assert seen == set(whole)


@pytest.mark.parametrize("world_size", [2, 4])
def test_each_all_to_all_sends_about_what_uniform_routing_predicts(runs, world_size):
    """k·T·(N-1)/N·d floats per call: the assignments whose expert is elsewhere (T = 128 / N tokens per rank,
    k = 2, d = 32; capacity 1.25 drops few). 2 blocks × dispatch and combine, forward and backward: 8 calls.
    The router is random, so only the mean over ranks and calls is held, to 10%."""
    formula = 2 * (128 // world_size) * (world_size - 1) / world_size * 32
    calls = [n for result in runs[world_size] for n in result["sent"]]
    assert len(calls) == 8 * world_size and abs(sum(calls) / len(calls) / formula - 1) < 0.1


@pytest.mark.parametrize("world_size", [2, 4])
def test_without_the_shared_weights_all_reduce_the_run_fails_its_check(runs, world_size):
    assert all("differs from one process" in result["broken"] for result in runs[world_size])


def one_layer(*argv: str) -> expert_parallel.MoE:
    """A block's MoE with all its experts, in this process, built as the script builds it."""
    sys.argv = ["expert_parallel.py", *argv]
    return expert_parallel.build(expert_parallel.parse_args(), 1, 0).blocks[0].mlp


def test_capacity_keeps_first_choices_before_second_ones_and_drops_the_rest():
    """Against a plain loop: every token's first choice in token order, then the second choices, each kept while
    its expert has room (capacity ceil(0.5 × 32 tokens × 2 / 4) = 8); the output sums the kept choices'."""
    moe = one_layer("--capacity_factor", "0.5", "--n_experts", "4")
    tokens = torch.randn(32, moe.router.in_features, generator=torch.Generator().manual_seed(5))
    out = moe(tokens.view(4, 8, -1)).detach().view(32, -1)
    weights, experts = moe.router(tokens).softmax(-1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    load, expected, dropped = [0] * 4, torch.zeros_like(tokens), 0
    for choice in range(2):
        for t in range(len(tokens)):
            e = int(experts[t, choice])
            if load[e] < 8:
                load[e] += 1
                expected[t] += weights[t, choice] * moe.experts[str(e)](tokens[t])
            else:
                dropped += 1
    assert moe.dropped == dropped > 0 and moe.routed.tolist() == load
    assert torch.allclose(out, expected.detach(), atol=1e-6)


def test_with_one_expert_per_token_the_router_still_learns_from_the_loss():
    """Top-1: the gate's raw probability scales the expert's output (renormalised, it would be 1, and constant)."""
    moe = one_layer("--top_k", "1", "--aux_weight", "0")
    moe(torch.randn(2, 8, moe.router.in_features, generator=torch.Generator().manual_seed(6))).square().sum().backward()
    assert moe.router.weight.grad.abs().max() > 1e-4


@pytest.mark.parametrize("argv, env, message", [
    ([], {}, "start this script with torchrun"),
    (["--n_experts", "6"], {"RANK": "0", "WORLD_SIZE": "4"}, "4 ranks must divide --n_experts 6"),
    (["--top_k", "5"], {}, "--top_k must be at most --n_experts"),
    (["--capacity_factor", "0"], {}, "--capacity_factor must be above 0"),
    (["--steps", "-1"], {}, "--aux_weight and --steps must be 0 or more"),
])
def test_bad_input_is_one_line(argv, env, message):
    assert_one_line(*run_main("expert_parallel.py", *argv, env=env)[::2], message)
