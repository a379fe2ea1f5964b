"""model_parallel.py: a model split in two stages under DDP trains what the same model on one device
trains under DDP, and a GPU run that lacks two GPUs per process stops with one line."""
import sys

import pytest
import torch
from harness import spawn
from launch import check, epoch_losses, torchrun

import model_parallel
import singlenode_cpu

ARGV = ["--max_epochs", "2", "--batch_size", "7", "--train_size", "301", "--val_size", "50", "--lr", "0.01"]


def split_and_whole(rank: int, world_size: int, argv: list[str]) -> dict:
    """model_parallel's train() and then singlenode_cpu's, in the same process group with the same
    arguments: the final weights of each, in the order the model defines them."""
    cpu = torch.device("cpu")
    sys.argv = ["model_parallel.py", *argv]
    split = model_parallel.train(model_parallel.parse_args(), rank, rank, world_size, (cpu, cpu))
    sys.argv = ["singlenode_cpu.py", *argv]
    # singlenode_cpu.py lets DDP lay its bucket out anew before the first step (settle_buckets, for a
    # resume that is bit for bit); model_parallel.py does not, and with 3 ranks where a gradient sits
    # in the bucket decides the order in which gloo adds up the ranks' values. The same layout here.
    # (With settle_buckets left in, 2 ranks still agree bit for bit, and 3 ranks to 3e-8: measured.)
    singlenode_cpu.settle_buckets = lambda *args: None
    whole = singlenode_cpu.train(singlenode_cpu.parse_args(), rank, rank, world_size, cpu)
    return {"split": [p.detach() for p in split.parameters()], "whole": [p.detach() for p in whole.parameters()]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n} ranks")
def runs(request):
    """(every rank's weights of both runs, rank 0's output of both runs) at 2 and 3 ranks."""
    results, stdouts = spawn(split_and_whole, request.param, ARGV, timeout=90)
    return request.param, results, stdouts


def test_two_stages_end_with_the_weights_of_the_model_on_one_device(runs):
    """Bit for bit: the same layers, the same shards, and on the CPU the same arithmetic in the
    same order; DDP puts both stages' gradients in one bucket, as it does the whole model's."""
    world_size, results, _ = runs
    for rank in range(world_size):
        split, whole = results[rank]["split"], results[rank]["whole"]
        assert [p.shape for p in split] == [p.shape for p in whole] == [(16, 20), (16,), (1, 16), (1,)]
        for index, (a, b) in enumerate(zip(split, whole, strict=True)):
            assert torch.equal(a, b), f"rank {rank}, parameter {index}"


def test_it_prints_the_losses_of_the_model_on_one_device_and_says_the_cpu_shows_the_api_only(runs):
    world_size, _, stdouts = runs
    split_output, whole_output = stdouts[0].split("[rank 0/", 2)[1:]
    assert "stage 0 on cpu, stage 1 on cpu" in split_output
    assert "both stages are on the CPU: this run shows the API only" in split_output
    printed = epoch_losses(split_output)
    assert sorted(printed) == [0, 1] and printed == epoch_losses(whole_output)
    assert printed[1][1] < printed[0][1]  # the validation loss falls
    assert all(epoch_losses(out) == {} for out in stdouts[1:]), "only rank 0 prints losses"
    for rank, out in enumerate(stdouts):
        assert f"[rank {rank}/{world_size}] stage 0 on cpu, stage 1 on cpu" in out


@pytest.mark.parametrize("gpus, procs, message", [
    (0, 1, "error: no CUDA GPU is visible (this torch is {version}); on CPUs run model_parallel.py --device cpu "
           "instead"),
    (1, 1, "error: each process holds its model on 2 GPUs: 1 process on this node needs 2 GPUs and it has 1; "
           "run with --device cpu to see the API"),
    (6, 4, "error: each process holds its model on 2 GPUs: 4 processes on this node need 8 GPUs and it has 6; "
           "use --nproc-per-node 3 or fewer"),
])
def test_too_few_gpus_for_two_per_process_is_one_line(gpus, procs, message, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(procs), "LOCAL_WORLD_SIZE": str(procs),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never used: the check comes first
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["model_parallel.py", "--device", "cuda"])
    with pytest.raises(SystemExit) as exit_info:
        model_parallel.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == message.format(version=torch.__version__) + "\n"


def test_a_model_of_one_layer_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["model_parallel.py", "--model", "linear"])
    with pytest.raises(SystemExit) as exit_info:
        model_parallel.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "model_parallel.py: error: --model linear is a single layer: there is nothing to split over two devices")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs per process")
def test_on_gpus_each_process_spans_two_of_them():
    """The whole script with nccl, as the docstring runs it: process r on GPUs 2r and 2r+1."""
    nproc = min(2, torch.cuda.device_count() // 2)
    out = check(torchrun(nproc, "model_parallel.py", "--device", "cuda", *ARGV))
    for rank in range(nproc):
        assert f"[rank {rank}/{nproc}] stage 0 on cuda:{2 * rank}, stage 1 on cuda:{2 * rank + 1}" in out
    assert "this run shows the API only" not in out
    losses = epoch_losses(out)
    assert sorted(losses) == [0, 1] and losses[1][1] < losses[0][1]
