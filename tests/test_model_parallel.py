"""model_parallel.py: the model cut into two stages under DDP trains, bit for bit, what singlenode_cpu.py
trains with the model whole, at 2 and 3 ranks, in one process group each."""
import sys

import pytest
import torch
from harness import spawn
from launch import epoch_losses

import model_parallel
import singlenode_cpu

ARGV = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]


def split_and_whole(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """model_parallel's train() and then singlenode_cpu's, in one process group with the same arguments: the
    final weights of each, in the order the model defines them."""
    weights = {}
    for module in (model_parallel, singlenode_cpu):
        sys.argv = [f"{module.__name__}.py", *ARGV]
        model = module.train(module.parse_args(), rank, world_size)
        weights[module.__name__] = [p.detach() for p in model.parameters()]
    return weights


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n} ranks")
def runs(request) -> tuple[int, list[dict], list[str]]:
    """(world size, every rank's weights of both runs, every rank's output of both runs)."""
    results, stdouts = spawn(split_and_whole, request.param, timeout=90)
    return request.param, results, stdouts


def test_two_stages_end_with_the_weights_of_the_model_whole(runs):
    """Bit for bit: the same layers and shards, the parameters in the same order so DDP's bucket is the same,
    and on the CPU the same arithmetic in the same order."""
    world_size, results, _ = runs
    for rank in range(world_size):
        split, whole = results[rank]["model_parallel"], results[rank]["singlenode_cpu"]
        assert [p.shape for p in split] == [p.shape for p in whole] == [(16, 20), (16,), (1, 16), (1,)]
        for index, (a, b) in enumerate(zip(split, whole, strict=True)):
            assert torch.equal(a, b), f"rank {rank}, parameter {index}"


def test_rank_0_prints_the_losses_of_the_model_whole(runs):
    _, _, stdouts = runs
    split_output, whole_output = stdouts[0].split("done |")[:2]
    printed = epoch_losses(split_output)
    assert sorted(printed) == [0, 1] and printed == epoch_losses(whole_output)
    assert printed[1][1] < printed[0][1]  # the validation loss falls
    assert all(epoch_losses(out) == {} for out in stdouts[1:]), "only rank 0 prints losses"


def test_the_two_stages_are_the_model_cut_in_order():
    net = model_parallel.build_model().net
    cpu = torch.device("cpu")
    model = model_parallel.TwoStages(net, cpu, cpu)
    assert [type(m).__name__ for m in (*model.stage0, *model.stage1)] == ["Linear", "Tanh", "Linear"]
    assert [p.data_ptr() for p in model.parameters()] == [p.data_ptr() for p in net.parameters()]  # same order
    x = torch.randn(5, 20)
    assert torch.equal(model(x), net(x))
