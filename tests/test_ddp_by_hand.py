"""ddp_by_hand.py: the hand-written DDP trains what torch's DistributedDataParallel trains, with one
all-reduce per bucket per step, and no_sync() for accumulation."""
import copy

import pytest
import torch
import torch.distributed as dist
from conftest import ARGV
from harness import spawn
from test_train import TOLERANCE, global_batch, one_process
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from workers import train_script

import ddp_by_hand


def count_all_reduces(fn):
    """Run fn() and return how many all-reduces it started, each with its element count."""
    started, all_reduce = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        started.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    ddp_by_hand.dist.all_reduce = counting
    try:
        fn()
    finally:
        ddp_by_hand.dist.all_reduce = all_reduce
    return started


def by_hand_and_torch(rank: int, world_size: int) -> dict:
    """The training script by hand, then the class in a loop of this test's own beside torch's DDP."""
    results = {"script": train_script(rank, world_size, "ddp_by_hand", ARGV)}
    torch.manual_seed(rank)  # different on every rank: the broadcast must make them equal
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), shared)  # a tied layer
    model[2].bias.requires_grad_(False)  # and a frozen parameter
    reference = DistributedDataParallel(copy.deepcopy(model))  # its own tensors, tied and frozen alike
    mine = ddp_by_hand.DDP(model, bucket_mb=1e-5)  # a bucket per parameter
    torch.manual_seed(100 + rank)
    x = torch.randn(3, 8, 4)  # three micro-batches of this rank's own
    for wrapped in (mine, reference):
        with wrapped.no_sync():
            for micro in x[:2]:
                wrapped(micro).square().mean().backward()
        started = count_all_reduces(lambda w=wrapped: (w(x[2]).square().mean().backward(),
                                                       getattr(w, "finish_gradient_synchronization", lambda: 0)()))
        if wrapped is mine:
            results["all-reduces in the synced backward"] = started
    results["grads"] = [[None if p.grad is None else p.grad.clone() for p in w.module.parameters()]
                        for w in (mine, reference)]
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[dict], list[str]]]:
    return {n: spawn(by_hand_and_torch, n, timeout=90) for n in (2, 3)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_script_trains_what_torchs_ddp_trains(runs, ddp_runs, world_size):
    """Bit for bit at 2 ranks (a sum of two numbers has one order); at 3 the buckets are laid out in
    another order than torch's, so gloo adds the ranks' values in another order."""
    results, _ = runs[world_size]
    reference, _ = ddp_runs[world_size]
    for name, tensor in reference[0].items():
        if world_size == 2:
            assert torch.equal(results[0]["script"][name], tensor), name
        torch.testing.assert_close(results[0]["script"][name], tensor, **TOLERANCE, msg=name)
    for rank in range(1, world_size):
        assert all(torch.equal(results[rank]["script"][k], t) for k, t in results[0]["script"].items())


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulated_tied_and_frozen_gradients_are_torchs(runs, world_size):
    """Two micro-batches under no_sync(), a third outside: the class leaves in .grad what torch's DDP
    leaves (the tied weight counted once, the frozen bias without a gradient), on every rank alike, after
    one all-reduce per bucket: one per trainable parameter here, none for the frozen one."""
    results, _ = runs[world_size]
    for rank in range(world_size):
        mine, theirs = results[rank]["grads"]
        assert [g is None for g in mine] == [g is None for g in theirs] == [False, False, False, True]
        for a, b in zip(mine, theirs, strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert sorted(results[rank]["all-reduces in the synced backward"]) == [4, 16, 16]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_script_trains_what_one_process_trains_with_the_global_batch(runs, world_size):
    """To 1e-6, as for torch's DDP (tests/test_train.py): N per-rank means averaged where one process takes
    one mean of N × B losses."""
    results, _ = runs[world_size]
    expected, _ = one_process(global_batch(world_size))
    for name, tensor in expected.items():
        torch.testing.assert_close(results[0]["script"][name], tensor, **TOLERANCE, msg=name)
