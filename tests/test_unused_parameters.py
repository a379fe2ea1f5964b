"""unused_parameters.py: both fixes train exactly as one process does; without a fix DDP stops, one
step too late; static_graph refuses a branch that comes and goes."""
import contextlib
import io
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import spawn
from reference import sampler_order

import unused_parameters
from data import make_datasets
from model import build_model

SIZES = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
TRAINED = {  # name: arguments; each must end with the weights of one process trained on the global batch
    "find_unused, branch on 1 step in 2": [*SIZES, "--fix", "find_unused"],
    "find_unused, branch never used": [*SIZES, "--fix", "find_unused", "--branch_every", "0"],
    "static_graph, branch never used": [*SIZES, "--fix", "static_graph", "--branch_every", "0"],
}
REFUSED = {  # name: arguments; each must stop with one line
    "no fix": [*SIZES, "--fix", "none"],
    "static_graph, branch on 1 step in 2": [*SIZES, "--fix", "static_graph"],
}


def parse(argv: list[str]):
    saved, sys.argv = sys.argv, ["unused_parameters.py", *argv]
    try:
        return unused_parameters.parse_args()
    finally:
        sys.argv = saved


def what_ddp_does(rank: int, world_size: int) -> dict:
    """Plain DDP and DDP(find_unused_parameters=True), one step at a time, on data of each rank's own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    found = {}
    data = torch.randn(5, 20, generator=torch.Generator().manual_seed(rank))  # (batch, features), rank's own

    # Plain DDP, a step without the branch: backward returns, and the optimizer steps, without error.
    torch.manual_seed(0)
    model = DDP(unused_parameters.WithBranch(build_model("mlp")))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(data, use_branch=False).sum().backward()
    optimizer.step()
    weights = [torch.empty_like(model.module.body.net[0].weight) for _ in range(world_size)]
    dist.all_gather(weights, model.module.body.net[0].weight.detach())
    found["replicas equal after the unused step"] = all(torch.equal(w, weights[0]) for w in weights)

    # find_unused_parameters=True: a branch taken by rank 0 only, then by no rank.
    torch.manual_seed(0)
    model = DDP(unused_parameters.WithBranch(build_model("mlp")), find_unused_parameters=True)
    model(data, use_branch=rank == 0).sum().backward()
    found["branch grad, rank 0 only"] = model.module.branch.weight.grad.clone()
    torch.manual_seed(0)
    alone = unused_parameters.WithBranch(build_model("mlp"))  # rank 0's gradient, in this process
    alone(torch.randn(5, 20, generator=torch.Generator().manual_seed(0))).sum().backward()
    found["rank 0's own branch grad"] = alone.branch.weight.grad
    model.zero_grad(set_to_none=True)
    model(data, use_branch=False).sum().backward()
    found["branch grad None when no rank uses it"] = model.module.branch.weight.grad is None
    return found


def unused_parameters_runs(rank: int, world_size: int) -> dict:
    """Every run of TRAINED and REFUSED in turn in one process group, then what_ddp_does."""
    results = {}
    for name, argv in TRAINED.items():
        results[name] = unused_parameters.train(parse(argv), rank, rank, world_size, torch.device("cpu")).state_dict()
    results |= what_ddp_does(rank, world_size)
    for name, argv in REFUSED.items():  # last: a refused run leaves its DDP wrapper broken
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            try:
                unused_parameters.train(parse(argv), rank, rank, world_size, torch.device("cpu"))
                results[name] = (0, "")
            except SystemExit as stop:
                results[name] = (stop.code, stderr.getvalue())
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[dict], list[str]]]:
    """{world_size: (what every rank returned, every rank's stdout)}, one process group each."""
    return {n: spawn(unused_parameters_runs, n, timeout=90) for n in (2, 3)}


def train_reference(argv: list[str], world_size: int) -> dict:
    """One process, no torch.distributed: each step takes every rank's batch at once, and the branch
    on the same steps as the script. A step that skips it leaves its .grad None, so Adam skips it."""
    args = parse(argv)
    train_set, _ = make_datasets(args.train_size, args.val_size)
    x, y = train_set.tensors
    torch.manual_seed(args.seed)
    model = unused_parameters.WithBranch(build_model(args.model))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = 0
    for epoch in range(args.max_epochs):
        shards = sampler_order(len(x), world_size, args.seed, epoch)
        for start in range(0, len(shards[0]), args.batch_size):
            batch = [i for shard in shards for i in shard[start:start + args.batch_size]]
            optimizer.zero_grad(set_to_none=True)
            use_branch = unused_parameters.uses_branch(step, args.branch_every)
            F.mse_loss(model(x[batch], use_branch=use_branch), y[batch]).backward()
            optimizer.step()
            step += 1
    return model.state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", TRAINED)
def test_each_fix_trains_as_one_process_with_the_global_batch(runs, world_size, name):
    results, _ = runs[world_size]
    expected = train_reference(TRAINED[name], world_size)
    for key, tensor in expected.items():
        torch.testing.assert_close(results[0][name][key], tensor, rtol=0, atol=1e-5, msg=key)
    for rank in range(1, world_size):
        for key, tensor in results[0][name].items():
            assert torch.equal(results[rank][name][key], tensor), (rank, key)
    if "never" in name:  # its .grad stayed None at every step, so Adam never moved it from zero
        assert not results[0][name]["branch.weight"].any()


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_a_fix_ddp_stops_a_step_late_and_the_replicas_have_already_drifted(runs, world_size):
    results, _ = runs[world_size]
    for rank in range(world_size):
        code, stderr = results[rank]["no fix"]
        assert code == 1 and len(stderr.strip().splitlines()) == 1
        assert stderr.startswith("error: DDP stopped step 1: Expected to have finished reduction in the prior "
                                 "iteration before starting a new one. Step 0 gave no gradient to parameters 4 5 "
                                 "(branch.weight, branch.bias)")
        assert "Use --fix find_unused" in stderr
        assert not results[rank]["replicas equal after the unused step"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_static_graph_refuses_a_branch_that_comes_and_goes(runs, world_size):
    results, _ = runs[world_size]
    for rank in range(world_size):
        code, stderr = results[rank]["static_graph, branch on 1 step in 2"]
        assert code == 1 and len(stderr.strip().splitlines()) == 1
        assert stderr.startswith("error: DDP stopped step 1: Your training graph has changed in this iteration")
        assert stderr.strip().endswith("static_graph=True needs the same parameters unused at every step: "
                                       "use --fix find_unused")


@pytest.mark.parametrize("world_size", [2, 3])
def test_find_unused_averages_a_branch_one_rank_took_and_leaves_one_no_rank_took_alone(runs, world_size):
    results, _ = runs[world_size]
    for rank in range(world_size):
        # The ranks that skipped the branch count as zero in the average.
        torch.testing.assert_close(results[rank]["branch grad, rank 0 only"],
                                   results[rank]["rank 0's own branch grad"] / world_size, rtol=0, atol=1e-6)
        assert results[rank]["branch grad None when no rank uses it"]


def test_rank_0_prints_the_fix_the_losses_and_the_time_per_step(runs):
    _, stdouts = runs[2]
    assert ("--fix find_unused: DDP(model, find_unused_parameters=True, static_graph=False) | the branch joins the "
            "forward on 1 step in 2") in stdouts[0]
    assert ("--fix static_graph: DDP(model, find_unused_parameters=False, static_graph=True) | the branch joins the "
            "forward on no step") in stdouts[0]
    assert stdouts[0].count(" ms/step on rank 0\n") == 2 * len(TRAINED)
    assert stdouts[0].count("done | val_loss:") == len(TRAINED)
    assert "epoch" not in stdouts[1]


def test_started_without_torchrun_it_says_how_to_launch(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["unused_parameters.py"])
    with pytest.raises(SystemExit) as stop:
        unused_parameters.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: start this script with torchrun, e.g. torchrun --standalone "
                                       "--nproc-per-node 2 unused_parameters.py\n")
