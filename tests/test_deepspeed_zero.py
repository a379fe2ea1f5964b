"""deepspeed_zero.py: every ZeRO stage of DeepSpeed, offloaded or not, trains what one process trains; each rank
holds the bytes of its partitions; DeepSpeed's checkpoint resumes bit for bit, and its consolidated weights
load into a plain model."""
import math
import os
import re
import shutil
import sys

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks, spawn, torchrun_in_process
from launch import BIN, REPO, check, epoch_losses, run
from test_train import global_batch, one_process

import deepspeed_zero
from model import build_model

# 96 samples: 6 steps of 8 a rank per epoch at 2 ranks, 4 at 3; 25 validation samples shard 13/12 and 9/8/8.
SIZES = ["--train_size", "96", "--val_size", "25", "--batch_size", "8", "--lr", "0.01"]
ARGV = [*SIZES, "--max_epochs", "3"]
RUNS = [(0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]  # stage 3 last
BYTES_LINE = re.compile(r"^\[rank (\d)/(\d)\] stage (\d) bytes held: parameters ([\d,]+) \| gradients ([\d,]+) \| "
                        r"optimizer state ([\d,]+)$", re.MULTILINE)
# DeepSpeed sums the N ranks' gradients of their own means, then divides by N; one process takes one mean over
# the global batch: the same numbers added in another order, which float32 rounds apart by an ulp or so, and
# Adam's division by the root of the second moment amplifies in the early steps. Measured after 3 epochs of 6
# or 4 steps: at most 2.4e-7 (every stage, offloaded or not). Not bitwise for that order alone.
TOLERANCE = {"rtol": 0, "atol": 2e-6}


def parse(argv: list[str]):
    sys.argv = ["deepspeed_zero.py", *argv]
    return deepspeed_zero.parse_args()


def whole_weights(engine) -> dict[str, torch.Tensor]:
    """The engine's whole weights: under stage 3 each rank holds a partition, gathered here (a collective)."""
    params = list(engine.module.parameters())
    with deepspeed_zero.deepspeed.zero.GatheredParameters(params, enabled=hasattr(params[0], "ds_tensor")):
        return {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}


def train(rank: int, world_size: int, argv: list[str]) -> dict[str, torch.Tensor]:
    os.environ["LOCAL_RANK"] = str(rank)  # which DeepSpeed asserts is set, as torchrun sets it
    return whole_weights(deepspeed_zero.train(parse(argv), rank, world_size))


def every_run(rank: int, world_size: int, folder: str) -> dict:
    """Each stage, offloaded or not, whole, then stopped after one epoch and resumed: in one process group.
    Stage 3 last: it replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's
    memory_efficient_linear), whose gradients round differently, so a later run would differ by an ulp
    (single_process.py's reference runs in the test process, which never starts DeepSpeed)."""
    results = {}
    for stage, offload in RUNS:
        flags = ["--stage", str(stage), *["--offload"] * offload]
        results[stage, offload] = train(rank, world_size, [*ARGV, *flags])
        argv = [*SIZES, *flags, "--checkpoint", f"{folder}/stage{stage}{'offload' * offload}"]
        train(rank, world_size, [*argv, "--max_epochs", "1"])
        results["resumed", stage, offload] = train(rank, world_size, [*argv, "--max_epochs", "3"])
    from deepspeed.comm import comm  # DeepSpeed's backend: whether it built (or loaded) its shared-memory op
    return results | {"shm op": comm.cdb.shm_comm_op is not None}


@pytest.fixture(scope="module", params=[2, 3])
def runs(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"deepspeed{request.param}")
    return (*spawn(every_run, request.param, str(folder), timeout=300), folder)


def test_every_stage_trains_what_single_process_trains_on_the_global_batch(runs):
    results, stdouts, _ = runs
    expected, printed = one_process(global_batch(len(results), ARGV))
    for stage, offload in RUNS:
        for rank, result in enumerate(results):
            for name, tensor in expected.items():
                msg = f"stage {stage} offload {offload} rank {rank} {name}"
                torch.testing.assert_close(result[stage, offload][name], tensor, **TOLERANCE, msg=msg)
    first = epoch_losses(stdouts[0].split("done |")[0])  # the first run's epochs: stage 0
    assert sorted(first) == [0, 1, 2]
    for epoch, pair in epoch_losses(printed).items():
        assert first[epoch] == pytest.approx(pair, abs=2e-6)
    assert all(epoch_losses(stdout) == {} for stdout in stdouts[1:])  # rank 0 alone prints them
    assert not any(result["shm op"] for result in results)  # no C++ op compiled at start-up


def test_a_resumed_run_ends_bit_for_bit_as_an_uninterrupted_one(runs):
    results, _, _ = runs
    for stage, offload in RUNS:
        for result in results:
            for name, tensor in result[stage, offload].items():
                assert torch.equal(result["resumed", stage, offload][name], tensor), (stage, offload, name)


def test_the_consolidated_weights_are_the_engines_and_load_into_a_plain_model(runs):
    results, _, folder = runs
    for stage, offload in RUNS:
        state = torch.load(folder / f"stage{stage}{'offload' * offload}" / "model.pt", weights_only=True)
        model = build_model("mlp")
        model.load_state_dict(state)  # strict: every name of the plain model, no "module." prefix
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, results[0]["resumed", stage, offload][name]), (stage, offload, name)


def expected_bytes(stage: int, world_size: int) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) of one rank, worked out here for the mlp's 4 tensors. Stages 1
    and 2 flatten every tensor into one, padded to a multiple of 2 × ranks, and cut it into equal partitions;
    stage 3 cuts each tensor into ceil(numel / ranks) elements a rank (padded: the last rank's too)."""
    sizes = [t.numel() for t in build_model("mlp").state_dict().values()]
    total = sum(sizes)
    if stage == 0:  # everything whole; Adam's step is one float32 per tensor
        return 4 * total, 4 * total, 8 * total + 4 * len(sizes)
    if stage == 3:
        partition = sum(math.ceil(n / world_size) for n in sizes)
        return 4 * partition, 4 * partition, 12 * partition + 4
    partition = math.ceil(total / (2 * world_size)) * 2
    return 4 * total, 4 * partition, 12 * partition + 4  # fp32 partition + 2 moments + one step


def test_each_rank_prints_the_bytes_of_its_partitions(runs):
    _, stdouts, _ = runs
    world_size = len(stdouts)
    for rank, stdout in enumerate(stdouts):
        lines = BYTES_LINE.findall(stdout)
        stages = [stage for stage, _ in RUNS for _ in ("whole", "stopped", "resumed")]  # one line per training
        for line, stage in zip(lines, stages, strict=True):
            assert line[:3] == (str(rank), str(world_size), str(stage))
            assert tuple(int(n.replace(",", "")) for n in line[3:]) == expected_bytes(stage, world_size), line


def without_averaging(rank: int, world_size: int) -> dict:
    """Stages 1, 2 and 3 with the collectives that sum the ranks' gradients (all-reduce, reduce-scatter) doing
    nothing: each rank then steps on its own gradients."""
    for name in ("all_reduce", "reduce_scatter_tensor"):
        setattr(dist, name, lambda *args, **kwargs: None)
    return {stage: train(rank, world_size, [*ARGV, "--stage", str(stage)]) for stage in (1, 2, 3)}


def test_the_proof_fails_without_the_gradients_reduction():
    results, _ = spawn(without_averaging, 2, timeout=120)
    expected, _ = one_process(global_batch(2, ARGV))
    for stage in (1, 2, 3):
        worst = max((results[0][stage][name] - tensor).abs().max().item() for name, tensor in expected.items())
        assert worst > 100 * TOLERANCE["atol"], (stage, worst)


def test_a_foreign_or_missing_checkpoint_is_one_line_and_nothing_is_lost(tmp_path):
    def resume(folder, *argv) -> str:
        launch = torchrun_in_process(1, "deepspeed_zero.py", *SIZES, "--max_epochs", "2", "--checkpoint", str(folder),
                                     *argv, timeout=60)
        assert launch.codes == [1], launch.stderr
        errors = [line for line in launch.stderr.splitlines() if "error:" in line]
        assert len(errors) == 1 and "Traceback" not in launch.stderr, launch.stderr
        return errors[0]

    written = tmp_path / "written"
    launch = torchrun_in_process(1, "deepspeed_zero.py", *SIZES, "--max_epochs", "1", "--checkpoint", str(written),
                                 "--stage", "2", timeout=60)
    assert launch.codes == [0], launch.stderr
    before = {path: path.read_bytes() for path in written.rglob("*") if path.is_file()}
    assert "holds no checkpoint of a stage3-1ranks-mlp run" in resume(written, "--stage", "3")  # another layout
    assert "holds no checkpoint of a stage2-1ranks-wide run" in resume(written, "--stage", "2", "--model", "wide")
    assert {path: path.read_bytes() for path in written.rglob("*") if path.is_file()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "ckpt.pt").write_bytes(b"singlenode_cpu.py's file")
    assert "(latest: none)" in resume(foreign, "--stage", "2")  # a folder DeepSpeed did not write
    assert "(latest: none)" in resume(foreign / "ckpt.pt", "--stage", "2")  # a file, not a folder
    (written / "model.pt").unlink()  # a run killed after its last save: a run with nothing left to do exports it
    launch = torchrun_in_process(1, "deepspeed_zero.py", *SIZES, "--max_epochs", "1", "--checkpoint", str(written),
                                 "--stage", "2", timeout=60)
    assert launch.codes == [0] and (written / "model.pt").read_bytes() == before[written / "model.pt"], launch.stderr
    partition = next(written.glob("epoch1-*/zero_pp_rank_0_*"))
    partition.write_bytes(before[partition][:1000])  # cut short
    assert f"{written}/epoch1-stage2-1ranks-mlp does not load: " in resume(written, "--stage", "2")
    shutil.rmtree(written / (written / "latest").read_text())
    assert "holds no checkpoint of a stage2-1ranks-mlp run" in resume(written, "--stage", "2")  # its tag deleted


def test_without_deepspeed_the_script_says_how_to_install_it_in_one_line():
    code = "import runpy, sys; sys.modules['deepspeed'] = None; sys.argv[0] = 'deepspeed_zero.py'; " \
           "runpy.run_path('deepspeed_zero.py', run_name='__main__')"
    result = run([sys.executable, "-c", code], timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == "error: DeepSpeed is not installed: pip install -r requirements-deepspeed.txt"


def test_deepspeeds_own_launcher_runs_the_documented_command(tmp_path):
    """The docstring's second command, at test sizes: the deepspeed launcher starts the ranks (no torchrun)."""
    result = check(run([str(BIN / "deepspeed"), "--num_gpus", "2", "--no_local_rank", str(REPO / "deepspeed_zero.py"),
                        "--stage", "2", "--offload", *ARGV], cwd=tmp_path, timeout=120))
    _, printed = one_process(global_batch(2, ARGV))
    expected = {epoch: pytest.approx(pair, abs=2e-6) for epoch, pair in epoch_losses(printed).items()}
    assert epoch_losses(result) == expected and len(expected) == 3


def die_in_the_second_save(rank: int, world_size: int, folder: str) -> None:
    """Two epochs with a checkpoint; in the second save, rank 1 writes half its partition and dies, as a
    killed worker would: rank 0 then fails at the save's closing barrier."""
    engine_module = deepspeed_zero.deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine
    save = engine_module.TorchCheckpointEngine.save

    def dying_save(self, state_dict, path):
        if rank == 1 and "epoch2" in path and "optim_states" in path:
            save(self, state_dict, path)
            with open(path, "r+b") as file:
                file.truncate(os.path.getsize(path) // 2)
            os._exit(1)
        return save(self, state_dict, path)

    engine_module.TorchCheckpointEngine.save = dying_save
    train(rank, world_size, [*SIZES, "--stage", "2", "--max_epochs", "2", "--checkpoint", folder])


def test_a_rank_dying_mid_save_leaves_the_checkpoint_before_it_to_resume(tmp_path):
    """DeepSpeed's own "latest" names the new tag before the other ranks have written theirs; the script's
    is written after the save's barrier, so the half-written epoch 2 is never named."""
    folder = tmp_path / "ckpt"
    codes, _, _, _ = run_ranks(die_in_the_second_save, 2, str(folder), timeout=120)
    assert codes[1] == 1 and codes[0] != 0  # rank 0 saw its peer go
    assert (folder / "latest").read_text() == "epoch1-stage2-2ranks-mlp"
    assert (folder / "epoch2-stage2-2ranks-mlp").is_dir()  # the broken tag is there, not named
    _, stdouts = spawn(train, 2, [*SIZES, "--stage", "2", "--max_epochs", "2", "--checkpoint", str(folder)],
                       timeout=120)
    assert "resuming from" in stdouts[0] and "1 of 2 epochs done" in stdouts[0]
