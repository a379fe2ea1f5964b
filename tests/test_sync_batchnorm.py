"""sync_batchnorm.py: synchronised statistics train exactly what one process trains with plain BatchNorm
over the global batch; per-rank statistics train what each rank normalising alone trains, with rank 0's
running statistics copied to every rank before each forward. At 2 and 3 ranks, one process group each."""
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import spawn
from reference import sampler_order
from torch import nn

import sync_batchnorm
from data import make_datasets
from model import build_model

# 301 samples: every rank's shard is padded by the sampler, and 7 per batch leaves a short last batch.
ARGV = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
RUNS = {"sync": ARGV, "local": [*ARGV, "--bn", "local"]}
SPREAD = re.compile(r"running statistics of the ranks differ by up to (\S+)")


def parse(argv: list[str]):
    saved, sys.argv = sys.argv, ["sync_batchnorm.py", *argv]
    try:
        return sync_batchnorm.parse_args()
    finally:
        sys.argv = saved


def both_runs(rank: int, world_size: int) -> dict:
    """Each run of RUNS in turn (every weight and buffer), then what nn.SyncBatchNorm does with a CPU
    tensor in training."""
    results = {name: sync_batchnorm.train(parse(argv), rank, world_size).state_dict() for name, argv in RUNS.items()}
    try:
        nn.SyncBatchNorm(4)(torch.randn(3, 4))
        results["nn.SyncBatchNorm on CPU"] = "no error"
    except ValueError as error:
        results["nn.SyncBatchNorm on CPU"] = str(error)
    return results


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n} ranks")
def runs(request) -> tuple[int, list[dict], list[str]]:
    """(world size, what every rank returned, every rank's stdout)."""
    results, stdouts = spawn(both_runs, request.param, timeout=90)
    return request.param, results, stdouts


def build(norm: type[nn.Module], seed: int) -> nn.Module:
    """The script's model: model.py's MLP, no bias before the BatchNorm inserted after its first Linear."""
    torch.manual_seed(seed)
    model = build_model()
    model.net[0].bias = None
    model.net.insert(1, norm(model.net[0].out_features))
    return model


def global_batches(args, world_size: int):
    """Each step's batch of every rank, in rank order, as DistributedSampler deals them."""
    x, y = make_datasets(args.train_size, args.val_size)[0].tensors
    for epoch in range(args.max_epochs):
        shards = sampler_order(len(x), world_size, args.seed, epoch)
        for start in range(0, len(shards[0]), args.batch_size):
            yield [(x[shard[start:start + args.batch_size]], y[shard[start:start + args.batch_size]])
                   for shard in shards]


def one_process(world_size: int) -> dict:
    """No torch.distributed, plain BatchNorm1d: each step, every rank's batch at once."""
    args = parse(ARGV)
    model = build(nn.BatchNorm1d, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for batches in global_batches(args, world_size):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches])).backward()
        optimizer.step()
    return model.state_dict()


def one_process_playing_each_rank(world_size: int) -> list[dict]:
    """No torch.distributed: each step, every rank's batch through plain BatchNorm1d alone, each rank starting
    from rank 0's running statistics (DDP's copy before the forward), and the mean of the ranks' losses (what
    DDP's averaged gradients descend). Returns each rank's final state_dict."""
    args = parse(ARGV)
    model = build(nn.BatchNorm1d, args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    layer = model.net[1]
    buffers = [{name: b.clone() for name, b in layer.named_buffers()} for _ in range(world_size)]
    for batches in global_batches(args, world_size):
        optimizer.zero_grad(set_to_none=True)
        rank_0s, losses = buffers[0], []
        for rank, (x, y) in enumerate(batches):
            for name, b in rank_0s.items():
                setattr(layer, name, b.clone())  # new tensors: autograd holds on to those the last forward used
            losses.append(F.mse_loss(model(x), y))
            buffers[rank] = {name: b.clone() for name, b in layer.named_buffers()}
        (sum(losses) / world_size).backward()
        optimizer.step()
    weights = {name: p.detach() for name, p in model.named_parameters()}
    return [weights | {f"net.1.{name}": b for name, b in buffers[rank].items()} for rank in range(world_size)]


def assert_close(actual: dict, expected: dict) -> None:
    """To 1e-5, not bit for bit: the script's variance comes from all-reduced sums of squares, which round
    otherwise than BatchNorm's own over the concatenated batch (and the ranks' sums add in another order)."""
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=1e-5, msg=key)


def test_synchronised_statistics_train_as_one_process_with_the_global_batch(runs):
    world_size, results, _ = runs
    assert_close(results[0]["sync"], one_process(world_size))
    for rank in range(1, world_size):  # the same statistics on every rank, bit for bit
        for key, tensor in results[0]["sync"].items():
            assert torch.equal(results[rank]["sync"][key], tensor), (rank, key)


def test_per_rank_statistics_train_as_each_rank_alone_from_rank_0s_running_statistics(runs):
    world_size, results, _ = runs
    expected = one_process_playing_each_rank(world_size)
    for rank in range(world_size):
        assert_close(results[rank]["local"], expected[rank])
    # Not what the global batch trains, and the ranks' running statistics end apart by their own last batch.
    assert (results[0]["local"]["net.0.weight"] - one_process(world_size)["net.0.weight"]).abs().max() > 1e-3
    assert not torch.equal(results[1]["local"]["net.1.running_mean"], results[0]["local"]["net.1.running_mean"])


def test_rank_0_prints_how_far_apart_the_running_statistics_are(runs):
    world_size, results, stdouts = runs
    spreads = [float(s) for s in SPREAD.findall(stdouts[0])]
    assert spreads[:2] == [0, 0] and len(spreads) == 4 and all(s > 0 for s in spreads[2:])
    last = torch.stack([torch.cat([r["local"]["net.1.running_mean"], r["local"]["net.1.running_var"]])
                        for r in results])
    assert spreads[3] == pytest.approx((last.max(0).values - last.min(0).values).max().item(), rel=0.05)
    assert all("epoch 0 |" not in stdout for stdout in stdouts[1:])  # rank 0 alone prints


def test_nn_syncbatchnorm_refuses_a_cpu_tensor_in_training(runs):
    _, results, _ = runs
    assert results[0]["nn.SyncBatchNorm on CPU"].startswith("SyncBatchNorm expected input tensor to be on GPU")
