"""sync_batchnorm.py: synchronised statistics train exactly as one process with the global batch does,
per-rank statistics do not; the running statistics are rank 0's unless each rank keeps its own."""
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from harness import spawn
from launch import check, torchrun
from reference import sampler_order
from torch import nn

import sync_batchnorm
from data import make_datasets

SIZES = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]
RUNS = {
    "sync": SIZES,
    "sync, no buffer sync": [*SIZES, "--no_buffer_sync"],
    "local": [*SIZES, "--bn", "local"],
    "local, no buffer sync": [*SIZES, "--bn", "local", "--no_buffer_sync"],
}
FIRST_BATCH = re.compile(r"\[rank (\d)/\d\] first batch, largest difference from BatchNorm over the global "
                         r"batch of (\d+) in one process: synchronised by hand (\S+) \| per rank (\S+) \| "
                         r"the model's (\w+) (\S+)")
SPREAD = re.compile(r"running statistics of the ranks differ by up to (\S+)")


def parse(argv: list[str]):
    saved, sys.argv = sys.argv, ["sync_batchnorm.py", *argv]
    try:
        return sync_batchnorm.parse_args()
    finally:
        sys.argv = saved


def sync_batchnorm_runs(rank: int, world_size: int) -> dict:
    """Every run of RUNS in turn in one process group (weights and buffers), and what nn.SyncBatchNorm
    does with a CPU tensor in training."""
    results = {name: sync_batchnorm.train(parse(argv), rank, rank, world_size, torch.device("cpu")).state_dict()
               for name, argv in RUNS.items()}
    try:
        nn.SyncBatchNorm(4)(torch.randn(3, 4))
        results["nn.SyncBatchNorm on CPU"] = "no error"
    except ValueError as error:
        results["nn.SyncBatchNorm on CPU"] = str(error)
    return results


@pytest.fixture(scope="module")
def runs() -> dict[int, tuple[list[dict], list[str]]]:
    """{world_size: (what every rank returned, every rank's stdout)}, one process group each."""
    return {n: spawn(sync_batchnorm_runs, n, timeout=90) for n in (2, 3)}


def global_batches(args, world_size: int):
    """Each step's batch of every rank, in rank order, as DistributedSampler deals them."""
    train_set, _ = make_datasets(args.train_size, args.val_size)
    x, y = train_set.tensors
    for epoch in range(args.max_epochs):
        shards = sampler_order(len(x), world_size, args.seed, epoch)
        for start in range(0, len(shards[0]), args.batch_size):
            yield [(x[shard[start:start + args.batch_size]], y[shard[start:start + args.batch_size]])
                   for shard in shards]


def train_one_process(argv: list[str], world_size: int) -> dict:
    """One process, no torch.distributed, plain BatchNorm1d: each step, every rank's batch at once."""
    args = parse(argv)
    torch.manual_seed(args.seed)
    model = sync_batchnorm.build(args.model, nn.BatchNorm1d)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for batches in global_batches(args, world_size):
        optimizer.zero_grad(set_to_none=True)
        F.mse_loss(model(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches])).backward()
        optimizer.step()
    return model.state_dict()


def train_per_rank_statistics(argv: list[str], world_size: int, buffer_sync: bool) -> list[dict]:
    """One process, no torch.distributed, playing every rank in turn: BatchNorm over each rank's batch
    alone, the mean of the ranks' losses (what DDP's averaged gradients descend), and running statistics
    kept per rank. With buffer_sync every rank starts each step from rank 0's, as DDP's broadcast does.
    Returns each rank's final state_dict."""
    args = parse(argv)
    torch.manual_seed(args.seed)
    model = sync_batchnorm.build(args.model, nn.BatchNorm1d)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    layer = model.net[1]
    buffers = [{name: b.clone() for name, b in layer.named_buffers()} for _ in range(world_size)]
    for batches in global_batches(args, world_size):
        optimizer.zero_grad(set_to_none=True)
        losses = []
        rank_0s = buffers[0]
        for rank, (x, y) in enumerate(batches):
            for name, b in (rank_0s if buffer_sync else buffers[rank]).items():
                setattr(layer, name, b.clone())  # new tensors: autograd holds on to those the last forward used
            losses.append(F.mse_loss(model(x), y))
            buffers[rank] = {name: b.clone() for name, b in layer.named_buffers()}
        (sum(losses) / world_size).backward()
        optimizer.step()
    weights = {name: p.detach() for name, p in model.named_parameters()}
    return [weights | {f"net.1.{name}": b for name, b in buffers[rank].items()} for rank in range(world_size)]


def assert_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("world_size", [2, 3])
def test_synchronised_statistics_train_as_one_process_with_the_global_batch(runs, world_size):
    results, _ = runs[world_size]
    expected = train_one_process(SIZES, world_size)
    for name in ("sync", "sync, no buffer sync"):
        assert_close(results[0][name], expected)
        for rank in range(1, world_size):  # the same statistics everywhere, broadcast or not: bit for bit
            for key, tensor in results[0][name].items():
                assert torch.equal(results[rank][name][key], tensor), (name, rank, key)


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_rank_statistics_do_not_and_the_running_statistics_are_rank_0s(runs, world_size):
    results, _ = runs[world_size]
    one_process = train_one_process(SIZES, world_size)
    assert (results[0]["local"]["net.0.weight"] - one_process["net.0.weight"]).abs().max() > 1e-3
    for name, buffer_sync in (("local", True), ("local, no buffer sync", False)):
        expected = train_per_rank_statistics(RUNS[name], world_size, buffer_sync)
        for rank in range(world_size):
            assert_close(results[rank][name], expected[rank])
    # With the broadcast, the ranks' running statistics differ by their own last batch only; without
    # it, by everything. Training in train mode never reads them: the weights are the same either way.
    def apart(name: str) -> float:
        return (results[1][name]["net.1.running_mean"] - results[0][name]["net.1.running_mean"]).abs().max()

    assert 0 < apart("local") < apart("local, no buffer sync")
    assert torch.equal(results[0]["local"]["net.0.weight"], results[0]["local, no buffer sync"]["net.0.weight"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_prints_its_first_batch_against_one_process(runs, world_size):
    _, stdouts = runs[world_size]
    for rank, stdout in enumerate(stdouts):
        lines = FIRST_BATCH.findall(stdout)
        assert len(lines) == len(RUNS)
        for (printed_rank, size, by_hand, per_rank, layer, gap), name in zip(lines, RUNS, strict=True):
            assert int(printed_rank) == rank and int(size) == 7 * world_size
            assert float(by_hand) <= 1e-5 and float(per_rank) > 1e-2
            if name.startswith("sync"):
                assert layer == "HandSyncBatchNorm1d" and float(gap) <= 1e-5
            else:
                assert layer == "BatchNorm1d" and gap == per_rank
    spreads = [float(s) for s in SPREAD.findall(stdouts[0])]
    assert spreads[:4] == [0, 0, 0, 0] and all(s > 0 for s in spreads[4:]) and len(spreads) == 8
    assert "epoch" not in stdouts[1]


def test_nn_syncbatchnorm_refuses_a_cpu_tensor_in_training(runs):
    results, _ = runs[2]
    assert results[0]["nn.SyncBatchNorm on CPU"].startswith("SyncBatchNorm expected input tensor to be on GPU")


def test_bad_starts_are_one_line(monkeypatch, capsys):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["sync_batchnorm.py"])
    with pytest.raises(SystemExit) as stop:
        sync_batchnorm.main()
    assert (stop.value.code, capsys.readouterr().err) == (2, "error: start this script with torchrun, e.g. torchrun "
                                                             "--standalone --nproc-per-node 2 sync_batchnorm.py\n")
    with pytest.raises(SystemExit) as stop:
        parse(["--model", "linear"])
    assert stop.value.code == 2
    assert "--model linear has no hidden layer for BatchNorm to normalise: use mlp or wide" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the line that a machine without CUDA gets")
def test_nccl_without_a_gpu_is_one_line(monkeypatch, capsys):
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["sync_batchnorm.py", "--backend", "nccl"])
    with pytest.raises(SystemExit) as stop:
        sync_batchnorm.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: no CUDA GPU is visible (this torch is {torch.__version__}); on CPUs "
                                       "run sync_batchnorm.py --backend gloo instead\n")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nn_syncbatchnorm_on_gpus_matches_the_statistics_by_hand():
    stdout = check(torchrun(2, "sync_batchnorm.py", "--backend", "nccl", *SIZES, timeout=180))
    lines = FIRST_BATCH.findall(stdout)
    assert len(lines) == 2
    for _, size, by_hand, per_rank, layer, gap in lines:
        assert layer == "SyncBatchNorm" and int(size) == 14
        assert float(by_hand) <= 1e-5 and float(gap) <= 1e-5 and float(per_rank) > 1e-2
    assert [float(s) for s in SPREAD.findall(stdout)] == [0, 0]
