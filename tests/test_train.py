"""The DDP lesson: singlenode_cpu.py at N ranks of batch B trains what single_process.py trains with
a batch of N × B, and `diff single_process.py singlenode_cpu.py` holds only the lines that do it."""
import ast
import contextlib
import difflib
import io
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ARGV, WORLD_SIZES
from harness import spawn
from launch import REPO, check, epoch_losses, run
from reference import sampler_order
from workers import train_script

import single_process
import singlenode_cpu

# The ranks' batches together are the global batch, but DDP averages N per-rank means where one process
# takes one mean of N × B losses: the same numbers added in another order, so float32 rounds them apart.
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def parse(module, argv: list[str]):
    saved, sys.argv = sys.argv, [f"{module.__name__}.py", *argv]
    try:
        return module.parse_args()
    finally:
        sys.argv = saved


def global_batch(world_size: int, argv: list[str] = ARGV) -> list[str]:
    argv = list(argv)
    argv[argv.index("--batch_size") + 1] = str(world_size * int(argv[argv.index("--batch_size") + 1]))
    return argv


def one_process(argv: list[str]) -> tuple[dict, str]:
    """single_process.py's train() in this process: (final weights, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        model = single_process.train(parse(single_process, argv))
    return model.state_dict(), out.getvalue()


@pytest.mark.quick
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_n_ranks_train_what_one_process_trains_with_an_n_times_larger_batch(ddp_runs, world_size):
    weights, stdouts = ddp_runs[world_size]
    expected, printed = one_process(global_batch(world_size))
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[0][name], tensor, **TOLERANCE, msg=name)
    losses, expected_losses = epoch_losses(stdouts[0]), epoch_losses(printed)
    assert sorted(losses) == [0, 1, 2]
    for epoch, pair in expected_losses.items():
        assert losses[epoch] == pytest.approx(pair, abs=2e-6)
    assert all(epoch_losses(out) == {} for out in stdouts[1:]), "only rank 0 prints losses"
    for rank, out in enumerate(stdouts):
        assert f"[rank {rank}/{world_size}] " in out


@pytest.mark.quick
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_rank_ends_with_identical_weights(ddp_runs, world_size):
    weights, _ = ddp_runs[world_size]
    for rank in range(1, world_size):
        for name, tensor in weights[0].items():
            assert torch.equal(weights[rank][name], tensor), f"rank {rank} differs in {name}"


def train_without_all_reduce(rank: int, world_size: int, argv: list[str]) -> dict:
    """singlenode_cpu's train() with DDP's gradient all-reduce replaced by nothing: each rank steps
    on its own gradient."""
    ddp = singlenode_cpu.DDP

    def no_all_reduce(model):
        wrapped = ddp(model)
        wrapped.register_comm_hook(None, lambda _, bucket: _done(bucket.buffer()))  # this rank's own, as is
        return wrapped

    singlenode_cpu.DDP = no_all_reduce
    return train_script(rank, world_size, "singlenode_cpu", argv)


def _done(tensor: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(tensor)
    return future


@pytest.mark.quick
def test_the_proof_fails_without_the_all_reduce():
    weights, _ = spawn(train_without_all_reduce, 2, ARGV, timeout=90)
    expected, _ = one_process(global_batch(2))
    with pytest.raises(AssertionError):
        for name, tensor in expected.items():
            torch.testing.assert_close(weights[0][name], tensor, **TOLERANCE, msg=name)


@pytest.mark.quick
def test_the_ranks_batches_together_are_the_single_process_batch():
    """DistributedSampler gives rank r the samples r, r + N, r + 2N, ... of one permutation of seed +
    epoch: the ranks' i-th batches together are the i-th slice of N × B of single_process.py's order."""
    world_size, batch = 3, 7
    args = parse(singlenode_cpu, ["--train_size", "300", "--batch_size", str(batch)])
    loaders = [singlenode_cpu.make_loaders(args, rank, world_size)[0] for rank in range(world_size)]
    shuffle = torch.Generator()
    single, _ = single_process.make_loaders(args, shuffle)
    for epoch in range(2):
        shuffle.manual_seed(args.seed + epoch)
        order = list(single.sampler)
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        shards = [list(loader.sampler) for loader in loaders]
        for i in range(0, len(shards[0]), batch):
            together = sorted(index for shard in shards for index in shard[i:i + batch])
            assert together == sorted(order[i * world_size:(i + batch) * world_size])


def test_the_sampler_pads_uneven_shards_and_reshuffles_each_epoch():
    args = parse(singlenode_cpu, ["--train_size", "301"])
    world_size = 3
    loaders = [singlenode_cpu.make_loaders(args, rank, world_size)[0] for rank in range(world_size)]
    orders = []
    for epoch in range(2):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)
        shards = [list(loader.sampler) for loader in loaders]
        assert {len(shard) for shard in shards} == {101}  # 301 padded to 303: equal steps on every rank
        assert set().union(*shards) == set(range(301))
        assert shards == sampler_order(301, world_size, args.seed, epoch)
        orders.append(shards)
    assert orders[0] != orders[1]


def test_validation_counts_each_sample_once():
    args = parse(singlenode_cpu, ["--val_size", "50"])
    seen = [i for rank in range(4) for i in singlenode_cpu.make_loaders(args, rank, 4)[1].dataset.indices]
    assert sorted(seen) == list(range(50))


def test_a_resumed_run_ends_as_an_uninterrupted_one(ddp_runs, tmp_path):
    """Stop after epoch 0, start again with the same --checkpoint: every epoch printed once across the two
    runs, and the weights of the uninterrupted run. Bit for bit at 2 ranks; at 3 and more DDP's buckets,
    laid out anew after a process's first backward, change the order in which gloo adds the ranks'
    gradients in the epoch after the restart (gpt/ keeps them fixed: bit for bit at any size)."""
    for world_size in WORLD_SIZES:
        checkpoint = str(tmp_path / f"ckpt{world_size}.pt")
        first_argv = [*ARGV, "--checkpoint", checkpoint]
        first_argv[first_argv.index("--max_epochs") + 1] = "1"
        _, first = spawn(train_script, world_size, "singlenode_cpu", first_argv, timeout=90)
        saved = torch.load(checkpoint, weights_only=True)
        assert sorted(saved) == ["epoch", "model", "optimizer"] and saved["epoch"] == 1  # the next epoch to run
        weights, second = spawn(train_script, world_size, "singlenode_cpu", [*ARGV, "--checkpoint", checkpoint],
                                timeout=90)
        assert "resuming from" in second[0] and "1 of 3 epochs done" in second[0]
        assert sorted(epoch_losses(first[0])) == [0] and sorted(epoch_losses(second[0])) == [1, 2]
        uninterrupted, _ = ddp_runs[world_size]
        for name, tensor in uninterrupted[0].items():
            if world_size == 2:
                assert torch.equal(weights[0][name], tensor), name
            torch.testing.assert_close(weights[0][name], tensor, **TOLERANCE, msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt2.pt", "ckpt3.pt"]  # no temporary file left


@pytest.mark.quick
def test_single_process_resumes_bit_for_bit(tmp_path):
    checkpoint = str(tmp_path / "ckpt.pt")
    whole, _ = one_process(ARGV)
    stopped = [*ARGV, "--checkpoint", checkpoint]
    stopped[stopped.index("--max_epochs") + 1] = "2"
    one_process(stopped)
    resumed, printed = one_process([*ARGV, "--checkpoint", checkpoint])
    assert "resuming from" in printed and sorted(epoch_losses(printed)) == [2]
    assert all(torch.equal(resumed[name], tensor) for name, tensor in whole.items())


def _body(path: Path) -> list[str]:
    """The script's lines after its docstring."""
    lines = path.read_text().splitlines()
    return lines[ast.parse(path.read_text()).body[0].end_lineno:]


def changed_lines(before: str, after: str) -> int:
    """Lines that `diff before after` shows, added or removed, docstrings left out."""
    diff = difflib.unified_diff(_body(REPO / before), _body(REPO / after), lineterm="", n=0)
    return sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))


@pytest.mark.quick
@pytest.mark.parametrize("before, after, most", [
    ("single_process.py", "singlenode_cpu.py", 80),  # the DDP lesson: about 40 lines in, 30 out
    ("singlenode_cpu.py", "singlenode_gpu.py", 80),  # the device, and fp16's GradScaler
    ("singlenode_cpu.py", "mp_spawn.py", 35),  # the launch
    ("singlenode_cpu.py", "start_with_torchrun.py", 20),  # the launchers' variables
    ("singlenode_cpu.py", "deepspeed_zero.py", 135),  # the engine, its config, checkpoints and bytes
])
def test_each_launch_lesson_is_a_short_diff_of_its_neighbour(before, after, most):
    assert 0 < changed_lines(before, after) <= most


def _functions(path: Path) -> dict[str, str]:
    """Each top-level function's code, without docstrings or comments (ast drops comments)."""
    tree = ast.parse(path.read_text())
    return {node.name: ast.dump(node) for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.quick
@pytest.mark.parametrize("script", ["mp_spawn.py", "start_with_torchrun.py"])
def test_the_training_code_is_the_same_in_every_cpu_launch(script):
    flagship, other = _functions(REPO / "singlenode_cpu.py"), _functions(REPO / script)
    for name in ["make_loaders", "train_one_epoch", "evaluate", "epoch_means", "train"]:
        assert other[name] == flagship[name], f"{script}: {name} differs from singlenode_cpu.py"


def test_no_gloo_thread_outlives_destroy_process_group():
    """The cause of an abort at exit ("terminate called without an active exception", one run in a few
    of singlenode_cpu.py without its import of torch.distributed.nn): imported after the group exists
    (Adam's construction imports it), its functions' defaults hold the group after destroy_process_group,
    and gloo's threads run on into interpreter shutdown. With the import first, the process is left with
    the threads it had before the group (within 5 s: one that is ending may still be listed under load)."""
    code = textwrap.dedent("""
        import faulthandler, os
        faulthandler.dump_traceback_later(45, exit=True)  # a hang says where
        import singlenode_cpu
        import torch, torch.distributed as dist
        def threads(): return len(os.listdir("/proc/self/task"))
        before = threads()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model = singlenode_cpu.DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        during = threads()
        del model, optimizer  # first: deleted after destroy_process_group, DDP's reducer drops the group's
        # last reference holding the GIL (pybind's Reducer binding keeps it; the group's own lets go), and the
        # group's destructor waits for gloo's threads, one of which may wait for the GIL: a hang, seen 3 times
        dist.destroy_process_group()
        import time  # a thread that is ending may still be listed for a moment on a loaded machine
        deadline = time.monotonic() + 5
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        print(before, during, threads())
    """)
    before, during, after = map(int, check(run([sys.executable, "-c", code], timeout=60)).split())
    assert during > before  # gloo's threads ran
    assert after == before


PARALLELISM = ["tensor_parallel.py", "pipeline_parallel.py", "mesh_2d.py", "expert_parallel.py"]
LESSONS = {"single_process.py": 150, "singlenode_cpu.py": 130, "singlenode_gpu.py": 150, "mp_spawn.py": 150,
           "start_with_torchrun.py": 150, "grad_accumulation.py": 150, "uneven_inputs.py": 150,
           "unused_parameters.py": 150, "sync_batchnorm.py": 150, "model_parallel.py": 150, "debug_hang.py": 150,
           "zero_optimizer.py": 150, "fsdp2.py": 150, "deepspeed_zero.py": 185, "ddp_by_hand.py": 200,
           "zero_by_hand.py": 312,
           "tensor_parallel.py": 200, "mesh_2d.py": 150, "expert_parallel.py": 200,
           "pipeline_parallel.py": 300,  # GPipe, 1F1B and zero bubble: issue 37's rule, a neighbour lesson past 300
           "context_parallel.py": 250,  # ring attention and Ulysses side by side
           "comm_intro.py": 300,
           "comm_collectives.py": 300,
           "bench_comm.py": 300, "bench_ddp.py": 300, "bench_memory.py": 300, "bench_by_hand.py": 300,
           "bench_pipeline.py": 150}


@pytest.mark.quick
@pytest.mark.parametrize("script", LESSONS)
def test_each_lesson_is_short_and_standalone(script):
    """A lesson imports torch, numpy, the standard library, data.py and model.py, and nothing else of the
    project (the benchmarks: benchtools.py too, bench_comm.py comm_collectives.py's ring, bench_ddp.py
    matplotlib, the optional extra that draws its trace)."""
    path = REPO / script
    assert len(path.read_text().splitlines()) <= LESSONS[script]
    allowed = {"torch", "numpy", "data", "model", *sys.stdlib_module_names}
    if script.startswith("bench"):
        allowed |= {"benchtools", "comm_collectives", "matplotlib"}
    if script in PARALLELISM:  # past data parallelism: the GPT of the real job, and pipeline's optional picture
        allowed |= {"gpt", "matplotlib"}
    if script == "bench_by_hand.py":  # it races the two by-hand lessons against torch's classes
        allowed |= {"ddp_by_hand", "zero_by_hand"}
    if script == "deepspeed_zero.py":  # the optional extra it teaches
        allowed |= {"deepspeed"}
    for node in ast.walk(ast.parse(path.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) else []
        for name in names:
            assert name.split(".")[0] in allowed, f"{script} imports {name}"
