"""A learner's mistakes get one clear line on stderr and a non-zero exit, not a traceback: a script
started without torchrun, a typo'd or out-of-range option, more ranks than the data allows. (The
real job's bad input, bad files and signals: tests/test_gpt*.py.)"""
import contextlib
import importlib
import io
import sys
import types
from pathlib import Path

import pytest
import torch
from launch import REPO, python, torchrun

LAUNCH_LESSONS = ["single_process.py", "singlenode_cpu.py", "singlenode_gpu.py", "mp_spawn.py",
                  "start_with_torchrun.py"]
# Every script at the root that trains (the benchmarks and the communication lessons have their own tests).
TRAINING_LESSONS = sorted(path.name for path in REPO.glob("*.py")
                          if "def main(" in path.read_text() and "--batch_size" in path.read_text()
                          and not path.name.startswith("bench"))


def run_main(script: str | types.ModuleType, *argv: str, env: dict | None = None) -> tuple[int, str, str]:
    """Run script.main() in this process (script: a root script's name, or the module), as `python script.py
    argv` would, and return (exit code, stdout, stderr): much cheaper than a new process. As Python does at
    exit, a SystemExit that carries a message prints it on stderr and exits 1."""
    module = importlib.import_module(script.removesuffix(".py")) if isinstance(script, str) else script
    script = script if isinstance(script, str) else Path(module.__file__).name
    saved_argv, sys.argv = sys.argv, [script, *argv]
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                module.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            if isinstance(exc.code, str):
                err.write(exc.code + "\n")
        finally:
            sys.argv = saved_argv
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code != 0
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], stderr


TORCHRUN = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "5", "LOCAL_WORLD_SIZE": "5", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "1"}  # what torchrun sets in rank 0 of 5; nothing listens at the port
ONE = {"RANK": "0", "WORLD_SIZE": "1"}  # what torchrun sets, where the mistake is found before any rendezvous
MISTAKES = {
    # name: (script and arguments, environment, text of the one error line)
    "started with python": (["singlenode_cpu.py"], {}, "error: start this script with torchrun --standalone"),
    "the GPU lesson started with python": (["singlenode_gpu.py"], {}, "error: start this script with torchrun"),
    "more ranks than training samples": (["singlenode_cpu.py", "--train_size", "4"], TORCHRUN,
                                         "error: 5 ranks but 4 training samples: each needs one"),
    "more processes than training samples": (["mp_spawn.py", "--nprocs", "3", "--train_size", "2"], {},
                                             "error: 3 ranks but 2 training samples: each needs one"),
    "mp_spawn.py started with torchrun": (["mp_spawn.py"], TORCHRUN, "error: mp_spawn.py starts its own processes: "
                                                                     "run it with python, not torchrun"),
    "a typo'd option": (["singlenode_cpu.py", "--epochs", "3"], {}, "error: unrecognized arguments: --epochs 3"),
    "a batch of none": (["single_process.py", "--batch_size", "0"], {},
                        "error: --batch_size must be above 0 and below 1e7, got 0"),
    "negative epochs": (["mp_spawn.py", "--max_epochs", "-3"], {},
                        "error: --max_epochs must be above 0 and below 1e7, got -3"),
    "a learning rate that is not a number": (["start_with_torchrun.py", "--lr", "fast"], {},
                                             "error: argument --lr: invalid float value: 'fast'"),
    "a learning rate of nan": (["singlenode_cpu.py", "--lr", "nan"], {},
                               "error: --lr must be above 0 and below 1e7, got nan"),
    "an infinite learning rate": (["single_process.py", "--lr", "inf"], {},
                                  "error: --lr must be above 0 and below 1e7, got inf"),
    "no training samples": (["singlenode_gpu.py", "--train_size", "0"], {},
                            "error: --train_size must be above 0 and below 1e7, got 0"),
    "a negative clipping norm": (["singlenode_gpu.py", "--clip_grad_norm", "-1"], {},
                                 "error: --clip_grad_norm must be above 0 and below 1e7, got -1.0"),
    "fp16 on the CPU lesson": (["singlenode_cpu.py", "--precision", "fp16"], {},
                               "error: unrecognized arguments: --precision fp16"),
    # The lessons past the basics, each with its own options.
    "accumulation started with python": (["grad_accumulation.py"], {},
                                         "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "no micro-batches": (["grad_accumulation.py", "--accum_steps", "0"], ONE,
                         "error: --accum_steps must be above 0 and below 1e7, got 0"),
    "more micro-batches than samples": (["grad_accumulation.py", "--accum_steps", "8", "--batch_size", "7"], ONE,
                                        "error: --accum_steps 8 is more than --batch_size 7"),
    "uneven inputs started with python": (["uneven_inputs.py"], {},
                                          "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "too few samples for the uneven files": (["uneven_inputs.py", "--train_size", "5"], {**ONE, "WORLD_SIZE": "3"},
                                             "error: 3 ranks but 5 training samples: files of 1 to 3 parts need 6"),
    "unused parameters started with python": (["unused_parameters.py"], {},
                                              "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "an unknown fix": (["unused_parameters.py", "--fix", "ignore"], ONE, "error: argument --fix: invalid choice"),
    "an unknown branch": (["unused_parameters.py", "--branch", "sometimes"], ONE,
                          "error: argument --branch: invalid choice: 'sometimes'"),
    "BatchNorm started with python": (["sync_batchnorm.py"], {},
                                      "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "a last batch of one sample": (["sync_batchnorm.py", "--train_size", "65"], ONE,  # 65 = 2 × 32 + 1
                                   "error: a batch of 1 sample has no BatchNorm statistics"),
    "a rank's last batch of one sample": (["sync_batchnorm.py", "--train_size", "130", "--batch_size", "4"],
                                          {**ONE, "WORLD_SIZE": "2"},  # 65 per rank = 16 × 4 + 1
                                          "error: a batch of 1 sample has no BatchNorm statistics"),
    "a batch of one sample": (["sync_batchnorm.py", "--batch_size", "1"], {**ONE, "WORLD_SIZE": "2"},
                              "error: a batch of 1 sample has no BatchNorm statistics"),
    "an unknown BatchNorm": (["sync_batchnorm.py", "--bn", "global"], {}, "error: argument --bn: invalid choice"),
    "two stages started with python": (["model_parallel.py"], {},
                                       "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "two stages, more ranks than samples": (["model_parallel.py", "--train_size", "2"], {**ONE, "WORLD_SIZE": "3"},
                                            "error: 3 ranks but 2 training samples: each needs one"),
    "a hang started with python": (["debug_hang.py"], {},
                                   "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "no timeout": (["debug_hang.py", "--timeout", "0"], {}, "error: --timeout must be above 0 and below 1e7, got 0.0"),
    "a timeout of nan": (["debug_hang.py", "--timeout", "nan"], {}, "error: --timeout must be above 0 and below 1e7"),
    "a timeout that is not a number": (["debug_hang.py", "--timeout", "soon"], {},
                                       "error: argument --timeout: invalid float value: 'soon'"),
    "DeepSpeed started with python": (["deepspeed_zero.py"], {},
                                      "error: start this script with torchrun --standalone --nproc-per-node 2"),
    "a ZeRO stage out of range": (["deepspeed_zero.py", "--stage", "4"], ONE,
                                  "error: argument --stage: invalid choice: 4 (choose from 0, 1, 2, 3)"),
    "offload without ZeRO": (["deepspeed_zero.py", "--stage", "0", "--offload"], ONE,
                             "error: --offload moves ZeRO's optimizer partition: it needs --stage 1, 2 or 3"),
}


@pytest.mark.quick
@pytest.mark.parametrize("name", MISTAKES)
def test_a_learners_mistake_is_one_line(name):
    (script, *argv), env, message = MISTAKES[name]
    code, _, stderr = run_main(script, *argv, env=env)
    assert_one_line(code, stderr, message)


@pytest.mark.quick
@pytest.mark.parametrize("script", TRAINING_LESSONS)
def test_every_training_lesson_refuses_a_typo_and_a_batch_of_none_in_one_line(script):
    code, _, stderr = run_main(script, "--batch_sise", "32")
    assert_one_line(code, stderr, "unrecognized arguments: --batch_sise 32")
    code, _, stderr = run_main(script, "--batch_size", "0")
    assert_one_line(code, stderr, "--batch_size")


def test_started_with_python_the_flagship_says_how_to_launch_in_one_line():
    result = python("singlenode_cpu.py")
    assert_one_line(result.returncode, result.stderr,
                    "error: start this script with torchrun --standalone --nproc-per-node 4 singlenode_cpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the line that a machine without CUDA gets")
def test_the_gpu_lesson_on_a_machine_without_a_gpu_is_one_line_per_rank():
    result = torchrun(2, "singlenode_gpu.py")
    assert result.returncode != 0 and 'singlenode_gpu.py", line' not in result.stderr  # torchrun's own report only
    # Each rank's line is one write, but Python writes a SystemExit's newline apart: two lines can share one.
    # torchrun stops the other workers once one fails, so a rank still importing torch may end before its line
    # (seen once in CI on a loaded machine): at most one line per rank, and at least one in all.
    counts = [result.stderr.count(f"error: local rank {rank} but 0 GPUs: one process per GPU") for rank in range(2)]
    assert max(counts) == 1, counts


def test_no_script_loads_a_checkpoint_without_weights_only():
    """torch.load without weights_only=True unpickles whatever the file holds, code included."""
    for path in [*REPO.glob("*.py"), *REPO.glob("gpt/*.py")]:
        for line in path.read_text().splitlines():
            if "torch.load(" in line:
                assert "weights_only=True" in line, f"{Path(path).name}: {line.strip()}"
