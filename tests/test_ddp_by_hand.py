"""ddp_by_hand.py: the hand-written DDP trains what torch's DistributedDataParallel trains, with one
all-reduce per bucket per step, and no_sync() for accumulation."""
import copy
import time

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
from model import build_model


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


ACCUMULATE = [*ARGV, "--grad_accum", "3"]
SMALL_BUCKETS = ["--bucket_mb", "0.0001"]  # 104 bytes: the MLP's gradients in 2 buckets (below)


def by_hand_and_torch(rank: int, world_size: int) -> dict:
    """The training script by hand, with and without accumulation, beside torch's DDP (singlenode_cpu.py, and
    grad_accumulation.py for the same micro-batches); then the class in a loop of this test's own."""
    results = {"script": train_script(rank, world_size, "ddp_by_hand", ARGV)}
    results["all-reduces"] = count_all_reduces(lambda: results.update(accumulated=train_script(
        rank, world_size, "ddp_by_hand", [*ACCUMULATE, *SMALL_BUCKETS])))
    results["torch accumulated"] = train_script(rank, world_size, "grad_accumulation",
                                                [*ARGV, "--accum_steps", "3"])
    if world_size == 4:  # conftest's ddp_runs holds 2 and 3 ranks
        results["torch"] = train_script(rank, world_size, "singlenode_cpu", ARGV)
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
            started = count_all_reduces(lambda w=wrapped: [w(micro).square().mean().backward() for micro in x[:2]])
        if wrapped is mine:
            results["all-reduces under no_sync"] = started
        started = count_all_reduces(lambda w=wrapped: (w(x[2]).square().mean().backward(),
                                                       getattr(w, "finish_gradient_synchronization", lambda: 0)()))
        if wrapped is mine:
            results["all-reduces in the synced backward"] = started
    results["grads"] = [[None if p.grad is None else p.grad.clone() for p in w.module.parameters()]
                        for w in (mine, reference)]
    results["launches"] = launches_during_backward()
    results["misuse"] = misuse()
    results["unused on rank 0"] = unused_on_some_ranks(rank)
    return results


class Branch(nn.Module):
    """Two layers, the second used only where skip is False: on rank 0 it is not."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        return self.a(x) if skip else self.b(self.a(x))


def unused_on_some_ranks(rank: int) -> list[list[torch.Tensor]]:
    """Three steps in which rank 0 skips layer b and the others do not, with a bucket per parameter: by hand
    and torch's DDP(find_unused_parameters=True), the gradients after each step."""
    torch.manual_seed(0)
    model, grads = Branch(), []
    for wrapped in (ddp_by_hand.DDP(copy.deepcopy(model), bucket_mb=1e-5),
                    DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=1e-5, find_unused_parameters=True)):
        torch.manual_seed(10 + rank)
        for _ in range(3):
            wrapped.module.zero_grad()
            wrapped(torch.randn(8, 4), skip=rank == 0).square().mean().backward()
            getattr(wrapped, "finish_gradient_synchronization", lambda: None)()
        grads.append([p.grad.clone() for p in wrapped.module.parameters()])
    return grads


def misuse() -> list[str]:
    """The two mistakes that torch's DDP catches or makes impossible, each a RuntimeError here too: a second
    backward in one step outside no_sync(), and a forward before the last backward's buckets were waited for."""
    model, x, errors = ddp_by_hand.DDP(build_model(), bucket_mb=1e-5), torch.randn(4, 20), []
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    for mistake in (lambda: loss.backward(), lambda: model(x)):
        try:
            mistake()
        except RuntimeError as error:
            errors.append(str(error))
    model.finish_gradient_synchronization()
    model(x)  # and after the wait, all is well again
    return errors


def launches_during_backward() -> list[tuple[list[float], float, float]]:
    """Three steps of the MLP at 10-byte buckets: for each, when each all-reduce was started, when backward
    returned, and when finish_gradient_synchronization() returned."""
    model, steps = ddp_by_hand.DDP(build_model(), bucket_mb=1e-5), []
    all_reduce = dist.all_reduce

    def timed(tensor, *args, **kwargs):
        steps[-1][0].append(time.perf_counter())
        return all_reduce(tensor, *args, **kwargs)

    ddp_by_hand.dist.all_reduce = timed
    try:
        for _ in range(3):
            steps.append(([], 0.0, 0.0))
            model(torch.randn(8, 20)).square().mean().backward()
            backward_end = time.perf_counter()
            model.finish_gradient_synchronization()
            steps[-1] = (steps[-1][0], backward_end, time.perf_counter())
    finally:
        ddp_by_hand.dist.all_reduce = all_reduce
    return steps


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[dict], list[str]]]:
    return {n: spawn(by_hand_and_torch, n, timeout=90) for n in (2, 3, 4)}


def torch_ddp(runs, ddp_runs, world_size: int) -> dict:
    return runs[world_size][0][0]["torch"] if world_size == 4 else ddp_runs[world_size][0][0]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_script_trains_what_torchs_ddp_trains(runs, ddp_runs, world_size, accumulate):
    """Bit for bit at 2 ranks (a sum of two numbers has one order); at 3 and 4, to 1e-6: the buckets are laid
    out in another order than torch's, so gloo adds the ranks' values in another order. With --grad_accum 3,
    against grad_accumulation.py's torch DDP with the same micro-batches under no_sync()."""
    results, _ = runs[world_size]
    key, reference = ("accumulated", results[0]["torch accumulated"]) if accumulate else \
        ("script", torch_ddp(runs, ddp_runs, world_size))
    for name, tensor in reference.items():
        if world_size == 2:
            assert torch.equal(results[0][key][name], tensor), name
        torch.testing.assert_close(results[0][key][name], tensor, **TOLERANCE, msg=name)
    for rank in range(1, world_size):
        assert all(torch.equal(results[rank][key][k], t) for k, t in results[0][key].items())


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_one_all_reduce_per_bucket_per_step_and_none_under_no_sync(runs, world_size):
    """--bucket_mb 0.0001 (104 bytes) over the MLP's gradients in the order backward makes them: the output
    layer's bias and weight (4 + 64 bytes), then the hidden bias (64), which fills the bucket past 104, then
    the hidden weight (1,280): 2 buckets, closed as torch closes them, once full. With --grad_accum 3, the 2
    micro-batches under no_sync() all-reduce nothing: 2 all-reduces per step, plus one per epoch for the
    losses. In the test's own loop, the two backward passes under no_sync() none."""
    results, _ = runs[world_size]
    steps = -(-300 // world_size // 7)  # ARGV: 300 samples, 7 per batch
    assert len(results[0]["all-reduces"]) == 3 * (2 * steps + 1)
    assert results[0]["all-reduces under no_sync"] == []


@pytest.mark.parametrize("world_size", [2, 3, 4])
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


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("accumulate", [False, True])
def test_the_script_trains_what_one_process_trains_with_the_global_batch(runs, world_size, accumulate):
    """To 1e-6, as for torch's DDP (tests/test_train.py): N per-rank means averaged where one process takes
    one mean of N × B losses; with accumulation, of k micro-batch means weighed by their share."""
    results, _ = runs[world_size]
    expected, _ = one_process(global_batch(world_size))
    for name, tensor in expected.items():
        torch.testing.assert_close(results[0]["accumulated" if accumulate else "script"][name], tensor,
                                   **TOLERANCE, msg=name)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_in_each_step_every_bucket_is_sent_before_backward_ends(runs, world_size):
    """The MLP at 10-byte buckets, 3 of them (the 4-byte output bias shares one with the output weight): in
    each of three steps, all 3 all-reduces start inside backward (each from the hook of its bucket's last
    gradient), none in finish_gradient_synchronization(), which only waits. Launched there instead, nothing
    would overlap backward. When gloo then runs them is the profiler's to show: tests/test_bench_by_hand.py."""
    results, _ = runs[world_size]
    for rank in range(world_size):
        for starts, backward_end, _ in results[rank]["launches"]:
            assert len(starts) == 3 and max(starts) < backward_end


@pytest.mark.parametrize("world_size", [2])
def test_a_second_backward_or_a_forgotten_wait_is_an_error_not_a_wrong_gradient(runs, world_size):
    """Without the checks, the second backward's gradients were lost (its bucket had left) and a forgotten
    finish_gradient_synchronization() let each rank step on its own gradient: silently wrong either way."""
    results, _ = runs[world_size]
    for rank in range(world_size):
        second, early = results[rank]["misuse"]
        assert "second backward in one step" in second and "no_sync()" in second
        assert "call finish_gradient_synchronization()" in early


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_layer_that_some_ranks_skip_gets_torchs_gradients(runs, world_size):
    """Rank 0 never uses layer b: its buckets leave from finish_gradient_synchronization() there, mid-backward
    elsewhere. The buckets still start in the same order on every rank, and every rank cuts them from rank 0's
    order, so the averages are torch's DDP(find_unused_parameters=True)'s. Red with a bucket launched as soon
    as it fills (ranks then add different buckets together) or planned from each rank's own order."""
    results, _ = runs[world_size]
    for rank in range(world_size):
        mine, theirs = results[rank]["unused on rank 0"]
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
