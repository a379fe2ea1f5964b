"""unused_parameters.py: both fixes train as one process does; without a fix DDP stops, one step too late;
static_graph refuses a branch that comes and goes."""
import ast
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import spawn
from launch import REPO
from reference import sampler_order
from torch.nn.parallel import DistributedDataParallel as DDP

import unused_parameters
from data import make_datasets

# 301 samples: DistributedSampler repeats 1 or 2 of them at 2 or 3 ranks; batches of 7, the last one short.
SIZES = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
TRAINED = {  # name: arguments; each must end with the weights of one process trained on the global batch
    "find_unused, branch on odd steps": [*SIZES, "--fix", "find_unused"],
    "find_unused, branch never used": [*SIZES, "--fix", "find_unused", "--branch", "never"],
    "static_graph, branch never used": [*SIZES, "--fix", "static_graph", "--branch", "never"],
}
REFUSED = {  # name: (arguments, the one line that each rank stops with)
    "no fix": ([*SIZES, "--fix", "none"],
               "error: step 1: Expected to have finished reduction in the prior iteration before starting a new one. "
               "Use --fix find_unused"),
    "static_graph, branch on odd steps": (
        [*SIZES, "--fix", "static_graph"],
        "error: step 1: Your training graph has changed in this iteration, e.g., one parameter is unused in first "
        "iteration, but then got used in the second iteration. Use --fix find_unused"),
}


def parse(argv: list[str]):
    saved, sys.argv = sys.argv, ["unused_parameters.py", *argv]
    try:
        return unused_parameters.parse_args()
    finally:
        sys.argv = saved


def what_ddp_does(rank: int, world_size: int) -> dict:
    """Plain DDP and DDP(find_unused_parameters=True), one step at a time, on data of each rank's own."""
    found = {}
    data = torch.randn(5, 20, generator=torch.Generator().manual_seed(rank))  # (batch, features), rank's own

    # Plain DDP, a step without the branch: backward returns, and the optimizer steps, without error.
    torch.manual_seed(0)
    model = DDP(unused_parameters.WithBranch())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(data, use_branch=False).sum().backward()
    optimizer.step()
    weights = [torch.empty_like(model.module.body.net[0].weight) for _ in range(world_size)]
    dist.all_gather(weights, model.module.body.net[0].weight.detach())
    found["replicas equal after the unused step"] = all(torch.equal(w, weights[0]) for w in weights)

    # find_unused_parameters=True: a branch taken by rank 0 only, then by no rank.
    torch.manual_seed(0)
    model = DDP(unused_parameters.WithBranch(), find_unused_parameters=True)
    model(data, use_branch=rank == 0).sum().backward()
    found["branch grad, rank 0 only"] = model.module.branch.grad.clone()
    torch.manual_seed(0)
    alone = unused_parameters.WithBranch()  # rank 0's gradient, in this process
    alone(torch.randn(5, 20, generator=torch.Generator().manual_seed(0))).sum().backward()
    found["rank 0's own branch grad"] = alone.branch.grad
    model.zero_grad(set_to_none=True)
    model(data, use_branch=False).sum().backward()
    found["branch grad None when no rank uses it"] = model.module.branch.grad is None
    return found


def unused_parameters_runs(rank: int, world_size: int) -> dict:
    """Every run of TRAINED in turn in one process group, then what_ddp_does, then the REFUSED runs."""
    results = {name: unused_parameters.train(parse(argv), rank, world_size).state_dict()
               for name, argv in TRAINED.items()}
    results |= what_ddp_does(rank, world_size)
    for name, (argv, _) in REFUSED.items():  # last: a refused run leaves its DDP wrapper broken
        try:
            unused_parameters.train(parse(argv), rank, world_size)
            results[name] = None
        except SystemExit as stop:
            results[name] = stop.code
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[dict], list[str]]]:
    """{world_size: (what every rank returned, every rank's stdout)}, one process group each."""
    return {n: spawn(unused_parameters_runs, n, timeout=90) for n in (2, 3)}


def one_process(argv: list[str], world_size: int, set_to_none: bool = True) -> dict:
    """One process, no torch.distributed: each step takes every rank's batch at once, and the branch on the
    same steps as the script. A step that skips it leaves its .grad None, so Adam skips it too (unless
    set_to_none=False: a zero gradient, which Adam's momentum turns into a step)."""
    args = parse(argv)
    train_set, _ = make_datasets(args.train_size, args.val_size)
    x, y = train_set.tensors
    torch.manual_seed(args.seed)
    model = unused_parameters.WithBranch()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(args.max_epochs):
        shards = sampler_order(len(x), world_size, args.seed, epoch)
        for step, start in enumerate(range(0, len(shards[0]), args.batch_size)):
            batch = [i for shard in shards for i in shard[start:start + args.batch_size]]
            optimizer.zero_grad(set_to_none=set_to_none)
            use_branch = args.branch == "odd_steps" and step % 2 == 1
            F.mse_loss(model(x[batch], use_branch=use_branch), y[batch]).backward()
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", TRAINED)
def test_each_fix_trains_as_one_process_with_the_global_batch(runs, world_size, name):
    """Not bitwise: DDP's average of the ranks' mean losses sums in another order than one batch's mean."""
    results, _ = runs[world_size]
    expected = one_process(TRAINED[name], world_size)
    for key, tensor in expected.items():
        torch.testing.assert_close(results[0][name][key], tensor, rtol=0, atol=1e-5, msg=key)
    for rank in range(1, world_size):
        for key, tensor in results[0][name].items():
            assert torch.equal(results[rank][name][key], tensor), (rank, key)
    if "never" in name:  # its .grad stayed None at every step, so Adam never moved it from zero
        assert not results[0][name]["branch"].any()
    else:  # on the steps that skip it, a zero gradient instead of none would have moved it
        zeros = one_process(TRAINED[name], world_size, set_to_none=False)
        assert (results[0][name]["branch"] - zeros["branch"]).abs().max() > 1e-3


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_a_fix_ddp_stops_a_step_late_and_the_replicas_have_already_drifted(runs, world_size):
    results, _ = runs[world_size]
    for rank in range(world_size):
        assert results[rank]["no fix"] == REFUSED["no fix"][1]
        assert not results[rank]["replicas equal after the unused step"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_refuses_a_branch_that_comes_and_goes(runs, world_size):
    results, _ = runs[world_size]
    name = "static_graph, branch on odd steps"
    assert [results[rank][name] for rank in range(world_size)] == [REFUSED[name][1]] * world_size


@pytest.mark.parametrize("world_size", [2, 3])
def test_find_unused_averages_a_branch_one_rank_took_and_leaves_one_no_rank_took_alone(runs, world_size):
    results, _ = runs[world_size]
    for rank in range(world_size):
        # The ranks that skipped the branch count as zero in the average.
        torch.testing.assert_close(results[rank]["branch grad, rank 0 only"],
                                   results[rank]["rank 0's own branch grad"] / world_size, rtol=0, atol=1e-6)
        assert results[rank]["branch grad None when no rank uses it"]


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's code, without comments (ast drops them)."""
    return {node.name: ast.dump(node) for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)}


def test_what_the_branch_does_not_change_is_singlenode_cpus_code():
    lesson, reference = _functions(REPO / "unused_parameters.py"), _functions(REPO / "singlenode_cpu.py")
    assert list(lesson) == list(reference)  # the same functions, in the same order
    for name in ("make_loaders", "evaluate", "epoch_means"):
        assert lesson[name] == reference[name], name
