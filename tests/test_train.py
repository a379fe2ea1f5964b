"""The training loop: DDP over N ranks equals one process with an N-times larger batch."""
import ast
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ARGV, WORLD_SIZES
from harness import spawn
from launch import REPO, check, epoch_losses, run
from reference import sampler_order, train_reference
from workers import bucket_layouts, train_script

import singlenode_cpu


def parse(argv: list[str]):
    sys_argv, sys.argv = sys.argv, ["singlenode_cpu.py", *argv]
    try:
        return singlenode_cpu.parse_args()
    finally:
        sys.argv = sys_argv


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_equals_single_process_with_the_global_batch(ddp_runs, world_size):
    weights, _ = ddp_runs[world_size]
    expected, _ = train_reference(parse(ARGV), world_size)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_ends_with_identical_weights(ddp_runs, world_size):
    weights, _ = ddp_runs[world_size]
    for rank in range(1, world_size):
        for name, tensor in weights[0].items():
            assert torch.equal(weights[rank][name], tensor), f"rank {rank} differs in {name}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_printed_losses_equal_a_single_process_recomputation(ddp_runs, world_size):
    _, stdouts = ddp_runs[world_size]
    _, expected = train_reference(parse(ARGV), world_size)
    printed = epoch_losses(stdouts[0])
    assert sorted(printed) == list(range(3))
    for epoch, (train_loss, val_loss) in enumerate(expected):
        assert printed[epoch] == pytest.approx((train_loss, val_loss), abs=2e-6)
    assert all(epoch_losses(out) == {} for out in stdouts[1:]), "only rank 0 prints losses"
    # Every rank announces itself once, naming its rank and device.
    for rank, out in enumerate(stdouts):
        assert f"[rank {rank}/{world_size}] device cpu" in out


def test_sampler_shards_cover_the_data_and_reshuffle_each_epoch():
    args = parse(["--train_size", "301"])
    world_size = 3
    loaders = [singlenode_cpu.make_loaders(args, rank, world_size)[0] for rank in range(world_size)]
    orders = []
    for epoch in range(2):
        shards = []
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
            shards.append(list(loader.sampler))
        assert {len(shard) for shard in shards} == {101}  # 301 padded to 303: equal steps on every rank
        assert set().union(*shards) == set(range(301))
        assert shards == sampler_order(301, world_size, args.seed, epoch)
        orders.append(shards)
    assert orders[0] != orders[1]


def test_validation_counts_each_sample_once():
    args = parse(["--val_size", "50"])
    seen = [i for rank in range(4) for i in singlenode_cpu.make_loaders(args, rank, 4)[1].dataset.indices]
    assert sorted(seen) == list(range(50))


def test_resume_continues_exactly_and_runs_no_epoch_twice(ddp_runs, tmp_path):
    """Stop after epoch 0, start again with the same --checkpoint: bit for bit the weights of the
    uninterrupted 3-epoch run, and every epoch printed exactly once across the two runs. At 3 ranks
    this holds only because every step uses the same gradient buckets (settle_buckets); at 2 the
    stop-and-rerun of test_fault_tolerance shows it."""
    world_size = 3
    checkpoint = str(tmp_path / "ckpt.pt")
    first_argv = [*ARGV, "--checkpoint", checkpoint]
    first_argv[first_argv.index("--max_epochs") + 1] = "1"
    _, first = spawn(train_script, world_size, "singlenode_cpu", first_argv, timeout=90)
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 1  # the next epoch to run, not the one just finished
    weights, second = spawn(train_script, world_size, "singlenode_cpu", [*ARGV, "--checkpoint", checkpoint],
                            timeout=90)
    assert "resuming from" in second[0] and "1 of 3 epochs done" in second[0]
    assert sorted(epoch_losses(first[0])) == [0]
    assert sorted(epoch_losses(second[0])) == [1, 2]
    uninterrupted, _ = ddp_runs[world_size]
    for name, tensor in uninterrupted[0].items():
        assert torch.equal(weights[0][name], tensor), name
    assert torch.load(checkpoint, weights_only=True)["epoch"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no lock or temporary file left


def test_ddp_lays_its_bucket_out_anew_after_the_first_backward():
    """Why a resumed run needs settle_buckets: DDP's first backward sends the gradients in the
    order the model defines its parameters, every later one in the order they became ready."""
    (passes,), _ = spawn(bucket_layouts, 1, 3, timeout=60)
    defined = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert passes[0] == [defined]
    assert passes[1] == passes[2] == [defined[::-1]]


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's code, without docstrings or comments (ast drops comments)."""
    tree = ast.parse(path.read_text())
    return {node.name: ast.dump(node) for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("script", ["mp_spawn.py", "start_with_torchrun.py"])
def test_the_training_code_is_the_same_in_every_cpu_script(script):
    """The scripts differ only in how they launch: the training functions are copies, kept identical."""
    flagship = _functions(REPO / "singlenode_cpu.py")
    other = _functions(REPO / script)
    for name in ["make_loaders", "train_one_epoch", "evaluate", "epoch_means", "resume", "settle_buckets", "train"]:
        assert other[name] == flagship[name], f"{script}: {name} differs from singlenode_cpu.py"


def test_no_gloo_thread_outlives_destroy_process_group():
    """The cause of an abort at exit ("terminate called without an active exception", about one
    run in a dozen under load): a group kept alive after destroy_process_group, whose gloo threads
    ran on into interpreter shutdown. A script's module and DDP, an optimizer step, destroy: the
    process is left with the threads it had before the group."""
    code = textwrap.dedent("""
        import os
        import singlenode_cpu
        import torch, torch.distributed as dist
        def threads(): return len(os.listdir("/proc/self/task"))
        before = threads()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = singlenode_cpu.DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.Adam(model.parameters())  # its first step imports torch._dynamo
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        during = threads()
        dist.destroy_process_group()
        del model, optimizer
        print(before, during, threads())
    """)
    before, during, after = map(int, check(run([sys.executable, "-c", code], timeout=60)).split())
    assert during > before  # gloo's threads ran
    assert after == before
