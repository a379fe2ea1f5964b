"""gpt/train.sbatch itself, run by bash as Slurm would run it, on two "nodes" of this machine: stand-ins
for srun (which starts the command once per node, here, and ends the step when one fails, as
--kill-on-bad-exit=1 asks), scontrol and `hostname --ip-address` come first on PATH. Each node's
torchrun agent starts one worker (gloo, CPU); the head address is an address of this machine that
is not loopback, as the script demands (no such address: the tests that train skip)."""
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch import BIN, REPO, Group, descendants, run

SBATCH = REPO / "gpt" / "train.sbatch"
# The tiny model on synthetic data, in place of the script's GPT-2: arguments after the script come last.
TINY = ["--model", "tiny", "--data", "synthetic", "--seq_len", "32", "--batch_size", "2", "--grad_accum", "3",
        "--precision", "fp32", "--warmup_steps", "4", "--val_tokens", "512", "--log_every", "1", "--eval_every",
        "1000", "--timeout", "60"]

SRUN = r"""#!/bin/bash
# srun on one machine: the command once per node, all here; --kill-on-bad-exit=1 kills the other tasks
# when one fails. Each start is logged to $STANDIN_LOG, with the tasks' pids.
nodes=$SLURM_NNODES kill_on_bad_exit=0
while [[ $1 == -* ]]; do
    case $1 in
        --nodes=*) nodes=${1#*=} ;;
        --kill-on-bad-exit=1) kill_on_bad_exit=1 ;;
        --ntasks=*|--nodelist=*) ;;
        *) echo "stand-in srun: $1 is not handled" >&2; exit 2 ;;
    esac
    shift
done
pids=()
for ((node = 0; node < nodes; node++)); do
    SLURMD_NODENAME=node$node SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
    pids+=($!)
done
echo "srun nodes=$nodes kill_on_bad_exit=$kill_on_bad_exit pids=${pids[*]}" >> "$STANDIN_LOG"
status=0
for ((left = nodes; left > 0; left--)); do
    wait -n
    code=$?
    if ((code != 0 && status == 0)); then
        status=$code
        ((kill_on_bad_exit)) && kill -KILL "${pids[@]}" 2>/dev/null
    fi
done
exit $status
"""
SCONTROL = r"""#!/bin/bash
[[ "$1 $2" == "show hostnames" ]] || { echo "stand-in scontrol: $* is not handled" >&2; exit 2; }
for ((node = 0; node < SLURM_NNODES; node++)); do echo "node$node"; done
"""
HOSTNAME = r"""#!/bin/bash
# The head node's address as a real node reports it; anything else is the real hostname's.
if [[ ${1:-} == --ip-address ]]; then echo "$STANDIN_HEAD_ADDR"; else exec /usr/bin/hostname "$@"; fi
"""


def this_machines_address() -> tuple[str, str] | None:
    """(address, interface) of an IPv4 address of this machine that is not loopback, or None."""
    if shutil.which("ip") is None:  # the script needs it too
        return None
    lines = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"], capture_output=True, text=True,
                           timeout=10).stdout.splitlines()
    if not lines:
        return None
    fields = lines[0].split()  # 2: eth0    inet 192.0.2.2/24 brd ...
    return fields[3].split("/")[0], fields[1]


def free_job_id() -> str:
    """A job id whose port (the script's 20000 + id % 10000) is free here now."""
    for _ in range(100):
        job_id = random.randrange(10**6, 10**7)
        with socket.socket() as sock:
            try:
                sock.bind(("", 20000 + job_id % 10000))
            except OSError:
                continue
            return str(job_id)
    raise AssertionError("no free port in 20000-29999")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """(environment, submit folder, (address, interface)) for the script: the folder holds gpt/ (a link to
    this repository's), as a user's submit folder does, and gets out/gpt2 and flight_recorder/."""
    found = this_machines_address()
    if found is None:
        pytest.skip("no IPv4 address but loopback here (or no `ip`): the script refuses loopback for the head node")
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("hostname", HOSTNAME)):
        (stand_ins / name).write_text(text)
        (stand_ins / name).chmod(0o755)
    submit = tmp_path / "submit"
    submit.mkdir()
    (submit / "gpt").symlink_to(REPO / "gpt")
    env = {"PATH": f"{stand_ins}:{BIN}:{os.environ['PATH']}", "STANDIN_LOG": str(tmp_path / "standin.log"),
           "STANDIN_HEAD_ADDR": found[0], "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[0-1]",
           "SLURM_CPUS_PER_TASK": "2", "GPUS_PER_NODE": "1",
           # The script asks for --compile (for GPT-2 on GPUs): here it would only cost time.
           "TORCH_COMPILE_DISABLE": "1"}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.delenv(name, raising=False)  # unset, so that the script sets and exports them
    return env, submit, found


def sbatch(env: dict, submit: Path, *argv: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """The script as Slurm runs it on the first node: bash, in the submit folder, a new job id each time."""
    return run(["bash", str(SBATCH), *argv], env={**env, "SLURM_JOB_ID": free_job_id()}, cwd=submit,
               timeout=timeout)


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode().split("=", 1) for pair in pairs if b"=" in pair)


def test_slurms_signal_saves_the_step_in_flight_and_the_resubmitted_job_resumes(cluster, tmp_path):
    """--signal=TERM@300 signals the job's steps: the srun'd tasks, torchrun itself (the script execs it),
    which passes it on to its workers. Every rank stops after the same step and saves it; the same
    script, submitted again, resumes there. The workers got each line's variable, with this node's
    interface, and srun was asked to end the step when one node fails."""
    env, submit, (address, interface) = cluster
    job_id = free_job_id()
    group = Group(tmp_path)
    group.start(["env", "-C", str(submit), "bash", str(SBATCH), *TINY, "--max_steps", "400", "--save_every", "1000"],
                env={**env, "SLURM_JOB_ID": job_id})
    try:
        group.wait_for(0, "step 5/", timeout=90)
        log = Path(env["STANDIN_LOG"]).read_text()
        assert re.search(r"srun nodes=2 kill_on_bad_exit=1 ", log), log
        tasks = [int(pid) for pid in log.split("pids=")[-1].split()]
        for task in tasks:
            command = Path(f"/proc/{task}/cmdline").read_text()
            assert "torchrun" in command and f"--local-addr\0{address}\0" in command  # exec'd: the task is torchrun
            workers = [pid for pid in descendants(task) if "train.py" in Path(f"/proc/{pid}/cmdline").read_text()]
            assert len(workers) == 1
            seen = environ(workers[0])
            assert {name: seen.get(name) for name in (
                "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCHINDUCTOR_COMPILE_THREADS", "SRUN_CPUS_PER_TASK",
                "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
            )} == {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}",
                   "TORCHINDUCTOR_COMPILE_THREADS": "2", "SRUN_CPUS_PER_TASK": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": f"{submit}/flight_recorder/{job_id}/rank_",
                   "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        assert (submit / "flight_recorder" / job_id).is_dir()
        for task in tasks:
            os.kill(task, signal.SIGTERM)
        signalled = time.monotonic()
        codes = group.wait(timeout=60)
    finally:
        group.kill()
    assert time.monotonic() - signalled < 30 and codes != [0]  # saved, and not taken for a finished run
    out = group.stdout(0)
    stopped = re.search(r"stopped by SIGTERM after step (\d+): saved (\S+);", out)
    assert stopped, out[-2000:] + group.stderr(0)[-3000:]
    step = int(stopped[1])
    last_logged = max(int(s) for s in re.findall(r"^step (\d+)/\d+ \| loss", out, re.MULTILINE))
    assert step == last_logged >= 5  # the step in flight, not an older one
    assert (submit / "out" / "gpt2" / f"step_{step:08d}" / "manifest.json").is_file()
    again = sbatch(env, submit, *TINY, "--max_steps", str(step + 3), "--save_every", "1000")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"resuming from out/gpt2/step_{step:08d}: step {step} of {step + 3}" in again.stdout
    assert f"step {step + 3} | val_loss" in again.stdout and "exported to gpt2.pt" in again.stdout


@pytest.mark.parametrize(("change", "said"), [
    ({"STANDIN_HEAD_ADDR": "127.0.1.1"}, "error: node0 resolves to '127.0.1.1', which the other nodes cannot reach"),
    ({"GLOO_SOCKET_IFNAME": "lo"}, ": lo is a loopback interface, which the other nodes cannot reach"),
    ({"NCCL_SOCKET_IFNAME": "=lo"}, ": lo is a loopback interface, which the other nodes cannot reach"),
], ids=["head node on loopback", "GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME==lo"])
def test_an_address_the_other_nodes_cannot_reach_is_refused(cluster, change, said):
    env, submit, _ = cluster
    result = sbatch({**env, **change}, submit, *TINY, timeout=30)
    assert result.returncode != 0 and said in result.stderr, result.stderr
    assert "torchrun" not in result.stderr  # refused before any agent started


def test_the_scripts_train_py_arguments_are_train_py_options():
    """The arguments that the script gives train.py, whatever the machine (the tests above run them only
    where there is an address that is not loopback)."""
    text = SBATCH.read_text().replace("\\\n", " ")
    argv = shlex.split(re.search(r" gpt/train\.py (.*?) \"\$@\"", text)[1])
    check = "import sys; sys.path.insert(0, 'gpt'); import train; train.parse_args(sys.argv[1:])"
    result = run([sys.executable, "-c", check, *argv], timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", ["gpt/train.sbatch", "multinode.sbatch"])
def test_a_long_node_list_leaves_the_head_node_found(script, tmp_path):
    """The scripts' line that picks the head node, run under their `set -euo pipefail` with an scontrol that lists
    200,000 nodes: `head -n 1` would close the pipe while scontrol still writes (SIGPIPE, and pipefail ends the
    job); the whole list read, the first node is the head."""
    line = next(text for text in (REPO / script).read_text().splitlines() if text.startswith("head_node="))
    (tmp_path / "scontrol").write_text("#!/bin/bash\nseq -f 'node%g' 0 199999\n")
    (tmp_path / "scontrol").chmod(0o755)
    result = subprocess.run(["bash", "-c", f"set -euo pipefail; {line}; echo $head_node"], capture_output=True,
                            text=True, timeout=30, env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                                                        "SLURM_JOB_NODELIST": "node[0-199999]"})
    assert (result.returncode, result.stdout) == (0, "node0\n"), result.stderr
