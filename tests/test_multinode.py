"""gpt/train.py on two hosts on one machine: Linux network namespaces joined by a veth pair, each
running a torchrun agent with 2 workers, gloo between them over the veth. Without root (no namespaces),
the same two agents share 127.0.0.1 instead."""
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid

import numpy as np
import pytest
from launch import REPO, TORCHRUN, Group
from test_gpt_checkpoints import ARGV, TRAIN, assert_bitwise, launch, split

INJECT = {"PYTHONPATH": str(REPO / "tests" / "inject")}
# On several nodes torchrun's shared store cannot keep restarts apart (the agents do not agree on the
# attempt's number), and gpt/train.py refuses --max-restarts there without this, as gpt/train.sbatch sets.
RESTARTABLE_ON_SEVERAL_NODES = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoHosts:
    """Two places to run a torchrun agent, and a way to make one of them vanish."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        self.names = [f"ddp{tag}a", f"ddp{tag}b"]
        self.links = [f"v{tag}a", f"v{tag}b"]
        # A private range that exists only inside the two namespaces.
        self.addresses = ["10.213.7.1", "10.213.7.2"]
        self.netns = os.geteuid() == 0 and shutil.which("ip") is not None and self._create()
        if not self.netns:
            self.addresses = ["127.0.0.1", "127.0.0.1"]

    def _create(self) -> bool:
        a, b = self.names
        steps = [
            ["ip", "netns", "add", a], ["ip", "netns", "add", b],
            ["ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]],
            ["ip", "link", "set", self.links[0], "netns", a], ["ip", "link", "set", self.links[1], "netns", b],
            ["ip", "-n", a, "addr", "add", "10.213.7.1/24", "dev", self.links[0]],
            ["ip", "-n", b, "addr", "add", "10.213.7.2/24", "dev", self.links[1]],
            ["ip", "-n", a, "link", "set", "lo", "up"], ["ip", "-n", b, "link", "set", "lo", "up"],
            ["ip", "-n", a, "link", "set", self.links[0], "up"], ["ip", "-n", b, "link", "set", self.links[1], "up"],
        ]
        for step in steps:
            if subprocess.run(step, capture_output=True).returncode != 0:
                self.destroy()
                return False
        return True

    def command(self, host: int, argv: list[str]) -> list[str]:
        if not self.netns:
            return argv
        # gloo would otherwise pick the interface that the machine's hostname resolves to.
        return ["ip", "netns", "exec", self.names[host], "env", f"GLOO_SOCKET_IFNAME={self.links[host]}", *argv]

    def vanish(self, host: int, group: Group) -> None:
        """Host `host` drops off the network and every process on it dies."""
        if self.netns:
            # Link down first, so that no connection reset reaches the other host: it can only notice
            # the loss when its --timeout runs out, as when a real machine loses power.
            subprocess.run(["ip", "-n", self.names[host], "link", "set", self.links[host], "down"], check=True)
            pids = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True).stdout
            for pid in pids.split():
                os.kill(int(pid), signal.SIGKILL)
        else:
            from launch import kill_tree
            kill_tree(group.procs[host].pid)

    def destroy(self) -> None:
        for name in self.names:
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
            for pid in pids.split():
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def hosts():
    two = TwoHosts()
    yield two
    if two.netns:
        two.destroy()


def test_two_hosts_restart_after_a_killed_worker_and_train_what_one_host_trains(hosts, tmp_path):
    """gpt/train.sbatch's launch on two nodes: a worker on the second host dies at step 10, both agents
    restart their workers, and the job ends with the weights of one host with 4 workers, bit for bit."""
    if not hosts.netns:
        print("no network namespaces here (needs root and iproute2): both agents on 127.0.0.1")
    reference = tmp_path / "one_host"
    reference.mkdir()
    assert launch(4, reference).codes == [0] * 4
    port = free_port()
    group = Group(tmp_path)
    for host in range(2):
        kill = {"KILL_LOCAL_RANK": "1", "KILL_AT": "step:10"} if host == 1 else {}
        group.start(hosts.command(host, [
            TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts.addresses[0]}:{port}", "--rdzv-id", "test-job",
            # The namespaces share one hostname, so say which agent hosts the rendezvous store and
            # which address each one is reachable at (real machines work these out themselves).
            "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", hosts.addresses[host],
            TRAIN, *ARGV, *split(4), "--out_dir", str(tmp_path / "out"), "--export", str(tmp_path / "model.pt"),
        ]), env={**RESTARTABLE_ON_SEVERAL_NODES, **INJECT, **kill})
    codes = group.wait(timeout=180)
    assert codes == [0, 0], group.stderr(0) + group.stderr(1)
    assert "[inject] SIGKILL rank" in group.stdout(1)
    assert "resuming from" in group.stdout(0) + group.stdout(1)
    assert_bitwise(tmp_path / "model.pt", reference / "model.pt")


def test_losing_a_host_stops_the_other_within_the_timeout(hosts, tmp_path):
    port = free_port()
    group = Group(tmp_path)
    for host in range(2):
        group.start(hosts.command(host, [
            TORCHRUN, "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(host),
            "--master-addr", hosts.addresses[0], "--master-port", str(port),
            TRAIN, *ARGV, *split(4), "--max_steps", "100000", "--timeout", "5", "--out_dir", str(tmp_path / "out"),
        ]))
    group.wait_for(0, "step 2/", timeout=90)  # global rank 0 runs on node 0
    hosts.vanish(1, group)
    lost = time.monotonic()
    group.procs[0].wait(timeout=5 + 30)
    assert group.procs[0].returncode != 0
    assert time.monotonic() - lost < 5 + 15  # --timeout, plus the agent's shutdown of its workers
    stderr = group.stderr(0)
    assert "Timed out" in stderr or "Connection reset by peer" in stderr or "Connection closed by peer" in stderr
    group.wait(timeout=10)  # nothing of either host is left running


@pytest.mark.parametrize("damage", ["no data", "other data", "a damaged shard"])
def test_what_one_host_finds_in_its_data_stops_both_hosts_with_its_cause(damage, hosts, tmp_path):
    """Two hosts, a worker each, the same command with `--data data`, a folder of each host's own (as a mount is):
    host 1's is missing, holds another train.bin, or a truncated shard. Host 1's rank says the cause once, naming
    itself; host 0's rank says it stopped for it; both exit non-zero at once, OUT_DIR never made; and each
    torchrun's summary names the cause, not a closed connection."""
    ids = (np.arange(6000) % 256).astype(np.uint16)
    for host in range(2):
        folder = tmp_path / f"host{host}" / "data"
        folder.mkdir(parents=True)
        if host == 1 and damage == "no data":
            folder.rmdir()
        elif damage == "a damaged shard":  # llm.c's shards; host 1's train shard cut short
            for name, part in (("x_train_000.bin", ids[:3000]), ("x_val_000.bin", ids[3000:])):
                header = np.zeros(256, np.int32)
                header[:3] = 20240520, 1, len(part)
                data = header.tobytes() + part.tobytes()
                (folder / name).write_bytes(data[:-10] if host and "train" in name else data)
        else:
            ids[:5000 if host and damage == "other data" else 6000].tofile(folder / "train.bin")
            ids.tofile(folder / "val.bin")
    port = free_port()
    group = Group(tmp_path)
    for host in range(2):
        group.start(hosts.command(host, [
            TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(host),
            "--master-addr", hosts.addresses[0], "--master-port", str(port), str(REPO / TRAIN),
            "--data", "data", "--vocab_size", "256", "--seq_len", "32", "--timeout", "30",
            "--out_dir", str(tmp_path / "out"),
        ]), cwd=tmp_path / f"host{host}")
    assert group.wait(timeout=90) == [1, 1], group.stderr(0) + group.stderr(1)
    cause = {"no data": "--data data: no such file (give synthetic, a text file, or a folder with nanoGPT's "
                        "train.bin and val.bin or llm.c's shards)",
             "other data": "--data data: train.bin holds 10,000 bytes, where rank 0's holds 12,000",
             "a damaged shard": "--data data/x_train_000.bin: truncated: its header says 3000 tokens (7024 bytes with "
                                "it), the file has 7014 bytes"}[damage]
    who = f"rank 1 on {socket.gethostname()} (node 1)"
    said = [[line for line in group.stderr(host).splitlines() if line.startswith(("error: ", "stopped: "))]
            for host in range(2)]
    assert said == [[f"stopped: {who} found an error"], [f"error: {cause} (found by {who})"]]
    assert f"traceback : stopped: {who} found an error: {cause}" in group.stderr(0)  # torchrun's summary
    assert f"traceback : error: {cause} (found by {who})" in group.stderr(1)
    assert "Connection closed" not in group.stderr(0) + group.stderr(1)
    assert not (tmp_path / "out").exists()
