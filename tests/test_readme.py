"""The commands of the README and docs/, and the README's sample output, are the ones that work."""
import ast
import re
import shlex
import sys
from pathlib import Path

import pytest
from docs_blocks import Output, by_rank, check_output, documented
from launch import DONE_LINE, REPO, check, epoch_losses, run

README = (REPO / "README.md").read_text()
DOCS = "\n".join(path.read_text() for path in sorted((REPO / "docs").glob("*.md")))
SCRIPTS = ["single_process", "singlenode_cpu", "singlenode_gpu", "mp_spawn", "start_with_torchrun", "bench_ddp",
           "grad_accumulation", "uneven_inputs", "unused_parameters", "sync_batchnorm", "model_parallel", "debug_hang",
           "zero_optimizer", "fsdp2", "bench_memory", "bench_comm", "comm_intro", "comm_collectives", "ddp_by_hand",
           "zero_by_hand", "bench_by_hand", "tensor_parallel", "pipeline_parallel", "mesh_2d", "context_parallel",
           "expert_parallel", "fault_tolerance", "bench_fault_tolerance", "bench_pipeline"]


def quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return block.strip().splitlines()


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    setup_and_train, setup_and_test = quick_start()
    assert "--nproc-per-node 8 singlenode_cpu.py" in setup_and_train
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert setup_and_test in ci_lines


@pytest.mark.skipif(Path(sys.prefix) != REPO / ".venv", reason="runs the setup as written only inside the repo's .venv")
def test_quick_start_trains_within_ten_percent_of_the_floor():
    result = run(quick_start()[0], shell=True, timeout=240)
    stdout = check(result)
    assert sorted(epoch_losses(stdout)) == list(range(10))
    val_loss, floor = map(float, DONE_LINE.search(stdout).groups())
    assert val_loss <= 1.1 * floor
    # The README's sample output is this run's output, compared as tests/test_docs_output.py compares.
    command = documented("torchrun --standalone --nproc-per-node 8 singlenode_cpu.py")
    streams = tuple(map(tuple, by_rank(result.stdout) + by_rank(result.stderr)))
    check_output(command, Output((result.returncode,), streams, REPO), "README.md")


def readme_commands() -> list[list[str]]:
    """Every command line in the README and in docs/ that runs one of the training scripts."""
    commands = []
    for line in re.findall(r"(?:^|\$ |`)(?:[A-Z_]+=\S+ )*((?:torchrun|python) [^`\n]*)", README + DOCS, re.MULTILINE):
        words = shlex.split(line.split("  #")[0])
        script = next((w for w in words if w.removesuffix(".py") in SCRIPTS), None)
        if script:
            commands.append(words[words.index(script):])
    return commands


def sbatch_command() -> list[str]:
    text = (REPO / "multinode.sbatch").read_text()
    return shlex.split(text.split("singlenode_gpu.py", 1)[1].splitlines()[0].replace('"$PWD/ckpt.pt"', "ckpt.pt"))


def test_the_slurm_script_gives_torchrun_its_cpus_and_a_port_below_the_ephemeral_range():
    text = (REPO / "multinode.sbatch").read_text()
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in text
    port_line = next(line for line in text.splitlines() if line.startswith("port="))
    for job_id in (0, 1, 9999, 10000, 123456789, 2**31 - 1):
        port = run(["bash", "-c", f"SLURM_JOB_ID={job_id}; {port_line}; echo $port"]).stdout
        assert 1024 <= int(port) < 32768, (job_id, port)


def test_the_slurm_script_is_valid_bash_and_passes_options_the_script_accepts(monkeypatch):
    assert run(["bash", "-n", str(REPO / "multinode.sbatch")]).returncode == 0
    monkeypatch.setattr(sys, "argv", ["singlenode_gpu.py", *sbatch_command()])
    args = __import__("singlenode_gpu").parse_args()
    assert args.checkpoint == "ckpt.pt"


@pytest.mark.parametrize("command", readme_commands(), ids=" ".join)
def test_every_readme_command_names_a_script_and_options_it_accepts(command, monkeypatch):
    script, *argv = command
    module = __import__(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    module.parse_args()  # argparse exits with status 2 on an unknown option


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_to_a_page_or_section_of_the_docs_leads_somewhere():
    pages = {path.relative_to(REPO).as_posix(): re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
             for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}  # code blocks hold no headings
    anchors = {name: {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)} for name, text in pages.items()}
    for name, text in pages.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            page = (REPO / Path(name).parent / file).resolve().relative_to(REPO.resolve()).as_posix() if file else name
            assert (REPO / page).exists(), f"{name}: {target} names no file"
            if anchor:
                assert anchor in anchors.get(page, set()), f"{name}: {target} names no section of {page}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_lesson_names_its_docs_page_in_its_opening_comment_and_the_page_names_it(script):
    docstring = ast.get_docstring(ast.parse((REPO / f"{script}.py").read_text()))
    pages = re.findall(r"docs/\w+\.md", docstring)
    assert pages, f"{script}.py's opening comment names no page of docs/"
    for page in pages:
        assert f"{script}.py" in (REPO / page).read_text(), f"{page} does not mention {script}.py"
