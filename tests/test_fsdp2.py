"""fsdp2.py: fully_shard trains what DDP trains, each rank holds its shard of the parameters, gradients
and Adam state, and the sharded checkpoint resumes bit for bit, on any number of ranks, or is refused."""
import contextlib
import hashlib
import io
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from launch import epoch_losses
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

import common
import fsdp2
import singlenode_cpu
from model import build_model

# 96 samples: 4 steps of 8 per epoch at 3 ranks. 25 validation samples: 9, 8 and 8 at 3 ranks, so
# rank 0 runs a second validation batch and the others an empty one (fsdp2.equal_forwards).
SIZES = ["--train_size", "96", "--val_size", "25", "--batch_size", "8", "--model", "wide", "--lr", "0.001"]
ARGV = [*SIZES, "--max_epochs", "2"]
BYTES_LINE = re.compile(r"\[rank (\d)/(\d)\] bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                        r"optimizer state ([\d,]+)")
STEP_TIME = re.compile(r"^step time: (\d+\.\d\d) ms \(median of (\d+) steps, rank 0\)$", re.MULTILINE)
# At 3 ranks FSDP2's weights differ from DDP's by up to 5.0e-6 after these 8 steps (measured); 10 times that.
TOLERANCE = 5e-5


def parse(script, argv: list[str]):
    saved, sys.argv = sys.argv, [f"{script.__name__}.py", *argv]
    try:
        return script.parse_args()
    finally:
        sys.argv = saved


def whole(model) -> dict:
    """The model's whole weights, gathered from every rank's shards (a collective)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def read_back(rank: int, world_size: int, folder: str, argv: list[str]) -> dict:
    """Load the checkpoint in `folder` as fsdp2.train() would, and return the whole model and Adam
    state that this world size reads from it."""
    args = parse(fsdp2, [*argv, "--checkpoint", folder])
    torch.manual_seed(args.seed + 1)  # other weights than the checkpoint's: the load must replace them all
    model = build_model(args.model)
    fsdp2.shard(model, init_device_mesh("cpu", (world_size,)), args.precision)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    checkpoints = common.ShardedCheckpoints(folder, rank, world_size)
    config = {name: vars(args).get(name) for name in common.RESUME_MUST_MATCH}
    try:
        epoch = fsdp2.resume(args, rank, world_size, model, optimizer, checkpoints, config)
    finally:
        checkpoints.close()
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return {"epoch": epoch, "model": whole(model), "optimizer": optimizer_state}


def refused(rank: int, world_size: int, folder: str) -> dict:
    """fsdp2.train() from a checkpoint that it must refuse: its exit code, stdout and stderr."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            fsdp2.train(parse(fsdp2, [*ARGV, "--checkpoint", folder]), rank, rank, world_size, torch.device("cpu"))
            code = 0
        except SystemExit as stop:
            code = stop.code
    return {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def runs(rank: int, world_size: int, folder: str, written_by_3: str) -> dict:
    """Every run in one process group, in turn: DDP, FSDP2 (exporting the whole model), FSDP2 stopped
    after an epoch and resumed. At 3 ranks the resumed checkpoint is read back; at 2, the 3-rank one
    is read back and trained on, bf16 is trained, and damaged checkpoints are refused."""
    cpu = torch.device("cpu")
    checkpoint = f"{folder}/ckpt"
    results = {"ddp": singlenode_cpu.train(parse(singlenode_cpu, ARGV), rank, rank, world_size, cpu).state_dict()}
    results["fsdp2"] = whole(fsdp2.train(parse(fsdp2, [*ARGV, "--export", f"{folder}/wide.pt"]), rank, rank,
                                         world_size, cpu))
    results["1 epoch"] = whole(fsdp2.train(parse(fsdp2, [*SIZES, "--max_epochs", "1", "--checkpoint", checkpoint]),
                                           rank, rank, world_size, cpu))
    results["resumed"] = whole(fsdp2.train(parse(fsdp2, [*ARGV, "--checkpoint", checkpoint]), rank, rank,
                                           world_size, cpu))
    if world_size == 3:
        if rank == 0:
            shutil.copytree(checkpoint, written_by_3)  # for the 2-rank runs to read
        results["read back"] = read_back(rank, world_size, checkpoint, ARGV)
        return results
    results["resharded"] = read_back(rank, world_size, written_by_3, ARGV)
    results["resharded, trained on"] = whole(fsdp2.train(
        parse(fsdp2, [*SIZES, "--max_epochs", "3", "--checkpoint", written_by_3]), rank, rank, world_size, cpu))
    results["bf16"] = whole(fsdp2.train(parse(fsdp2, [*SIZES, "--max_epochs", "1", "--precision", "bf16"]), rank,
                                        rank, world_size, cpu))
    if rank == 0:  # a byte flipped in the middle of one shard; another shard deleted
        for name in ("damaged", "missing"):
            shutil.copytree(checkpoint, f"{folder}/{name}")
        with open(f"{folder}/damaged/__1_0.distcp", "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.remove(f"{folder}/missing/__0_0.distcp")
    dist.barrier()  # the copies are made before any rank reads them
    results["refused"] = {name: refused(rank, world_size, f"{folder}/{name}") for name in ("damaged", "missing")}
    return results


def spawn_runs(world_size: int, folder: Path, written_by_3: Path):
    codes, results, stdouts, stderrs = run_ranks(runs, world_size, str(folder), str(written_by_3), timeout=120)
    assert codes == [0] * world_size, stderrs
    return results, stdouts


@pytest.fixture(scope="module")
def written_by_3(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resharding") / "ckpt"


@pytest.fixture(scope="module")
def three(tmp_path_factory, written_by_3):
    folder = tmp_path_factory.mktemp("three")
    return (*spawn_runs(3, folder, written_by_3), folder)


@pytest.fixture(scope="module")
def two(tmp_path_factory, three, written_by_3):  # after three, which writes the checkpoint that two reshards
    folder = tmp_path_factory.mktemp("two")
    return (*spawn_runs(2, folder, written_by_3), folder)


@pytest.fixture(params=[2, 3])
def run(request, two, three):
    return {2: two, 3: three}[request.param]


def test_fsdp2_trains_what_ddp_trains(run):
    """DDP all-reduces the gradients, FSDP2 reduce-scatters their average: the same mean, added up in
    another order. At 2 ranks a sum of two numbers does not depend on the order, and halving is exact,
    so the weights are equal bit for bit; at 3 the rounding differs, within TOLERANCE."""
    (results, *_), stdouts, _ = run
    world_size = len(stdouts)
    for name, tensor in results["ddp"].items():
        if world_size == 2:
            assert torch.equal(results["fsdp2"][name], tensor), name
        else:
            torch.testing.assert_close(results["fsdp2"][name], tensor, rtol=0, atol=TOLERANCE, msg=name)
    ddp, fsdp, *_ = [epoch_losses(stdout) for stdout in stdouts[0].split("done |")]
    assert sorted(ddp) == sorted(fsdp) == [0, 1]
    assert all(fsdp[epoch] == pytest.approx(ddp[epoch], rel=1e-5) for epoch in ddp)


def expected_bytes(rank: int, world_size: int) -> int:
    """The bytes of rank `rank`'s shard of the wide model's parameters, worked out here: FSDP2 gives
    rank r the r-th of torch.chunk(param, world_size, dim=0), ceil(rows / world_size) rows each but
    the last (1024 rows at 3 ranks: 342, 342 and 340), and none where the rows run out (the output
    layer's single row is rank 0's alone)."""
    total = 0
    for tensor in build_model("wide").state_dict().values():
        rows = tensor.shape[0]
        per_rank = math.ceil(rows / world_size)
        total += max(0, min(per_rank, rows - rank * per_rank)) * tensor[0].numel() * 4  # fp32
    return total


def test_each_rank_holds_its_shard_of_parameters_gradients_and_adam_state(run):
    _, stdouts, _ = run
    world_size = len(stdouts)
    for rank, stdout in enumerate(stdouts):
        lines = BYTES_LINE.findall(stdout)
        assert len(lines) == (5 if world_size == 2 else 3)  # one per fsdp2.train() run that trains
        params = expected_bytes(rank, world_size)
        # Adam: exp_avg and exp_avg_sq, each the size of the shard, and a 4-byte step count per parameter.
        expected = (str(rank), str(world_size), f"{params:,}", f"{params:,}", f"{2 * params + 8 * 4:,}")
        assert set(lines) == {expected}  # bf16 too: the shards, gradients and Adam state stay fp32
    assert sum(expected_bytes(rank, world_size) for rank in range(world_size)) == 4 * 2_121_729
    if world_size == 3:  # uneven: 342 rows, 342 and the output row, 340
        assert [expected_bytes(rank, 3) for rank in range(3)] == [2_837_228, 2_833_128, 2_816_560]
    # Rank 0 times every step but each epoch's first: 3 of the 4 steps of each of 2 epochs at 3 ranks.
    steps_per_epoch = 96 // world_size // 8
    assert int(STEP_TIME.search(stdouts[0]).group(2)) == 2 * (steps_per_epoch - 1)
    assert not any(STEP_TIME.search(stdout) for stdout in stdouts[1:])


def test_a_resumed_run_ends_bit_for_bit_as_an_uninterrupted_one(run):
    (results, *_), stdouts, folder = run
    for name, tensor in results["fsdp2"].items():
        assert torch.equal(results["resumed"][name], tensor), name
    assert "resuming from" in stdouts[0] and "1 of 2 epochs done\n" in stdouts[0]
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("ckpt")) == ["ckpt", "ckpt.lock"]
    names = sorted(p.name for p in (folder / "ckpt").iterdir())
    assert names == sorted([".metadata", "manifest.json", *[f"__{rank}_0.distcp" for rank in range(len(stdouts))]])


def test_the_export_loads_into_a_plain_model(run):
    (results, *_), _, folder = run
    model = build_model("wide")
    model.load_state_dict(torch.load(folder / "wide.pt", weights_only=True))  # strict: every key, every shape
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, results["fsdp2"][name]), name


def test_a_checkpoint_of_3_ranks_resumes_on_2(two, three, written_by_3):
    """DCP reshards: 2 ranks read back the model and Adam state that 3 ranks wrote, bit for bit, and
    train on from there."""
    (written, *_), _, _ = three
    (read, *_), stdouts, _ = two
    assert read["resharded"]["epoch"] == written["read back"]["epoch"] == 2
    for name, tensor in written["resumed"].items():  # what the 3 ranks saved is what they read back
        assert torch.equal(written["read back"]["model"][name], tensor), name
    resharded, written = read["resharded"], written["read back"]
    torch.testing.assert_close(resharded["model"], written["model"], rtol=0, atol=0)
    torch.testing.assert_close(resharded["optimizer"]["state"], written["optimizer"]["state"], rtol=0, atol=0)
    assert resharded["optimizer"]["param_groups"] == written["optimizer"]["param_groups"]
    assert (f"resuming from {written_by_3}: 2 of 3 epochs done, written by 3 ranks, read by 2 (DCP reshards; the "
            "global batch changes from 24 to 16 samples)\n") in stdouts[0]
    losses = epoch_losses(stdouts[0].split("written by 3 ranks")[1].split("done |")[0])
    assert sorted(losses) == [2] and all(math.isfinite(v) for v in losses[2])


def test_bf16_computes_in_bf16_and_keeps_fp32_shards(two):
    (results, *_), stdouts, _ = two
    differences = [(results["bf16"][name] - tensor).abs().max().item() for name, tensor in results["1 epoch"].items()]
    assert 1e-3 < max(differences) < 0.5
    assert all(tensor.dtype == torch.float32 for tensor in results["bf16"].values())


@pytest.mark.parametrize("name, line", [
    ("damaged", "cannot use checkpoint {}: its shard __1_0.distcp fails its sha256 check (damaged after it was "
                "written)"),
    ("missing", "cannot use checkpoint {}: its shard __0_0.distcp is missing (found by rank 1)"),
])
def test_a_damaged_or_missing_shard_is_refused_on_every_rank_before_training(two, name, line):
    by_rank, _, folder = two
    path = folder / name
    for rank in range(2):
        refusal = by_rank[rank]["refused"][name]
        assert refusal["code"] == 2
        assert refusal["stderr"] == f"error: {line.format(path)}\n"
        assert "bytes held" not in refusal["stdout"] and not epoch_losses(refusal["stdout"])
    # Nothing changed: the files are those of the checkpoint that was copied, less the one removed.
    copied = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (folder / "ckpt").iterdir()}
    found = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}
    changed = {n for n in copied if copied[n] != found.get(n)}
    assert changed == ({"__1_0.distcp"} if name == "damaged" else {"__0_0.distcp"})
    assert not (folder / f"{name}.tmp").exists() and not (folder / f"{name}.old").exists()


def test_a_save_cut_short_is_tidied_and_a_second_job_is_locked_out(two, tmp_path):
    """What a crash between the two renames of a save leaves (no PATH, a whole PATH.old, a PATH.tmp)
    is put back at start; a second job on the same path is refused; so are other runs' settings."""
    _, _, folder = two
    path = tmp_path / "ckpt"
    shutil.copytree(folder / "ckpt", f"{path}.old")
    shutil.copytree(folder / "ckpt", f"{path}.tmp")
    config = {name: vars(parse(fsdp2, ARGV)).get(name) for name in common.RESUME_MUST_MATCH}
    first, second = (common.ShardedCheckpoints(str(path), 0, 1) for _ in range(2))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        first.tidy()
    assert out.getvalue() == (f"put back {path}, which a save that did not finish had moved to {path}.old\n"
                              f"removed {path}.tmp, left by a save that did not finish\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.lock"]
    assert first.check(config).startswith("epoch 2 by 2 ranks, manifest sha256 ")
    second.tidy()
    assert second.check(config) == (f"error: another job is using checkpoint {path} (it holds {path}.lock): wait for "
                                    "it to finish or stop it, or pass another --checkpoint")
    first.close()
    assert first.check({**config, "lr": 0.01}) == (f"error: {path} was written with --lr 0.001, this run has --lr "
                                                   "0.01: use the same value, or another --checkpoint path to start "
                                                   "afresh")
    (path / "manifest.json").write_text("{")
    assert first.check(config) == (f"error: cannot use checkpoint {path}: its manifest.json is damaged, or not one "
                                   "that these scripts write")
    (path / "manifest.json").unlink()
    assert first.check(config) == (f"error: {path} holds no manifest.json: it is not a checkpoint of these scripts, "
                                   "or its save never finished")


def test_folders_beside_the_checkpoint_that_no_save_wrote_are_left_alone(tmp_path):
    """A PATH.tmp or PATH.old of the user's own is refused in one line, not removed or moved."""
    path = tmp_path / "mine"
    for leftover in ("mine.tmp", "mine.old"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "notes.txt").write_text("precious")
        checkpoints = common.ShardedCheckpoints(str(path), 0, 1)
        checkpoints.tidy()
        assert checkpoints.check({}) == (f"error: {tmp_path / leftover} holds notes.txt, which no save of these "
                                         "scripts writes: move it away, or pass another --checkpoint")
        checkpoints.close()
        assert (tmp_path / leftover / "notes.txt").read_text() == "precious"
        shutil.rmtree(tmp_path / leftover)


def test_an_export_inside_the_checkpoint_folder_is_refused_at_start(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["fsdp2.py", "--checkpoint", str(tmp_path / "c"), "--export",
                                      str(tmp_path / "c" / "wide.pt")])
    with pytest.raises(SystemExit) as stop:
        fsdp2.parse_args()
    assert stop.value.code == 2
    assert "is inside --checkpoint" in capsys.readouterr().err


def test_started_without_torchrun_or_without_a_gpu_it_says_so_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fsdp2.py"])
    with pytest.raises(SystemExit) as stop:
        fsdp2.main()
    assert (stop.value.code, capsys.readouterr().err) == (2, "error: start this script with torchrun, e.g. torchrun "
                                                             "--standalone --nproc-per-node 2 fsdp2.py\n")
    with pytest.raises(SystemExit):
        parse(fsdp2, ["--export", "no/such/folder/wide.pt"])
    assert "--export 'no/such/folder/wide.pt' must name a file in a writable folder" in capsys.readouterr().err
    if torch.cuda.is_available():
        return
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["fsdp2.py", "--backend", "nccl", "--precision", "bf16"])
    with pytest.raises(SystemExit) as stop:
        fsdp2.main()
    assert (stop.value.code, capsys.readouterr().err) == (2, f"error: no CUDA GPU is visible (this torch is "
                                                             f"{torch.__version__}); on CPUs run fsdp2.py --backend "
                                                             "gloo instead\n")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_gpus_with_nccl_and_bf16():
    """The GPU path: nccl, one GPU per process, bf16 compute with fp32 shards; a checkpoint and its resume."""
    from launch import check, torchrun

    ranks = min(torch.cuda.device_count(), 2)
    with tempfile.TemporaryDirectory() as folder:
        argv = ["--backend", "nccl", "--precision", "bf16", *SIZES, "--checkpoint", f"{folder}/ckpt"]
        first = check(torchrun(ranks, "fsdp2.py", *argv, "--max_epochs", "1", timeout=180))
        second = check(torchrun(ranks, "fsdp2.py", *argv, "--max_epochs", "2", timeout=180))
    for rank in range(ranks):
        params = expected_bytes(rank, ranks)  # fp32: the shards are the master weights
        assert f"[rank {rank}/{ranks}] bytes held: parameters {params:,} | gradients {params:,} | " in first
    assert sorted(epoch_losses(first)) == [0] and sorted(epoch_losses(second)) == [1]
    assert "1 of 2 epochs done" in second and STEP_TIME.search(second)
