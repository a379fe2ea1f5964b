"""fault_tolerance.py: torchft's replicas equal one process when none fails; a replica killed at a chosen step
(as it starts, or between its quorum and its all-reduce) and started again heals from a peer, while the others
never stop stepping, and all end with the same weights, bit for bit; DiLoCo all-reduces on its outer steps only,
and its replicas are equal after each; bad input is one line, and nothing is left running.

Every run goes through launch.run, which fails a test that leaves any process behind."""
import argparse
import os
import re
import socket
import sys
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from launch import REPO, python

sys.path.insert(0, str(REPO))
import fault_tolerance  # noqa: E402
from data import make_datasets  # noqa: E402
from model import build_model  # noqa: E402

LINE = re.compile(r"^replica (\d+) step (\d+): (\d+) of \d+ replicas, all-reduces (\d+), (committed|not committed)"
                  r"(, healed from a peer)?, loss [\d.]+, weights (-?[\d.]+)$", re.MULTILINE)
DILOCO = re.compile(r"^replica (\d+) step (\d+): all-reduces (\d+)(?:, outer step (\d+) over (\d+) replicas)?, "
                    r"loss [\d.]+, weights (-?[\d.]+)$", re.MULTILINE)


def steps(out: str) -> dict[int, list[tuple]]:
    """Each replica's printed steps, in order: (step, replicas, all-reduces, committed, healed, weights' sum)."""
    printed = defaultdict(list)
    for r, step, n, reduces, committed, healed, weights in LINE.findall(out):
        printed[int(r)].append((int(step), int(n), int(reduces), committed == "committed", bool(healed),
                                float(weights)))
    return printed


def run(tmp_path, *argv: str) -> str:
    result = python("fault_tolerance.py", "--out_dir", str(tmp_path), *argv, timeout=120)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def final_weights(tmp_path, replicas: int) -> list[dict]:
    return [torch.load(tmp_path / f"replica_{r}.pt", weights_only=True) for r in range(replicas)]


def one_process(replicas: int, n: int, batch_size: int = 32) -> torch.nn.Module:
    """The same model, Adam and steps in one process, each step's batch the replicas' shares together."""
    args = fault_tolerance.argparse.Namespace(seed=0, batch_size=batch_size * replicas)
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.005)
    train_set, _ = make_datasets(4096, 1)
    for step in range(n):
        x, y = fault_tolerance.batch(train_set, step, 0, args)  # replica r's share: rows r·B to (r + 1)·B
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return model


def test_with_no_failure_three_replicas_train_what_one_process_trains(tmp_path):
    """3 replicas, 6 steps of 3 × 32 samples: every step committed by all 3 with one all-reduce, and the final
    weights equal one process's on the 96 samples, to 1e-6: the mean of three means of 32 is rounded otherwise
    than one mean of 96, so not bit for bit."""
    printed = steps(run(tmp_path, "--replicas", "3", "--steps", "6", "--step_time", "0"))
    for r in range(3):
        assert [s[:4] for s in printed[r]] == [(step, 3, 1, True) for step in range(6)]
    reference = one_process(3, 6).state_dict()
    for weights in final_weights(tmp_path, 3):
        for name, tensor in weights.items():
            torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6)


# (2 replicas, killed as step 8 starts, passed too, before the suite's budget; docs/fault_tolerance.md's run, rerun
# by tests/test_docs_output.py, kills one of 2 so)
@pytest.mark.parametrize(("replicas", "kill"), [(3, "2:8:mid")])
def test_a_killed_replica_heals_from_a_peer_while_the_others_never_stop(tmp_path, replicas, kill):
    """One replica SIGKILLed at step 8, as the step starts (2 replicas) or between its quorum and its all-reduce
    (3), and started again: the others commit every step from 0 to the last once, in order, a step with the
    dead one's all-reduce failing not committed and run again without it; the one that came back heals at a
    later step (its first, printed so), and from there prints the others' weights each step; all end equal,
    bit for bit."""
    # 0.4 s a step, asleep: the 51 steps after the kill last 20 s or more, time for the dead replica's restart
    # (torch's import, torchft's quorum) on a loaded machine; at 0.1 s, and twice at 0.25 s under a suite run
    # beside other jobs (2026-12-04), the others finished first.
    out = run(tmp_path, "--replicas", str(replicas), "--steps", "60", "--kill", kill, "--step_time", "0.4")
    printed = steps(out)
    dead = int(kill.split(":")[0])
    for r in range(replicas):
        committed = [s[0] for s in printed[r] if s[3]]
        if r != dead:  # no gap, no step twice; else the replica's lines, and every line that is no step's
            assert committed == list(range(60)), "\n".join(
                line for line in out.splitlines() if line.startswith(f"replica {r} ") or not LINE.match(line))
            assert min(s[1] for s in printed[r]) == replicas - 1 and printed[r][-1][1] == replicas
            failed = [s[0] for s in printed[r] if not s[3]]
            assert failed == ([8] if kill.endswith("mid") else []), failed
    before, after = [s for s in printed[dead] if not s[4]][:8], printed[dead][8:]
    assert [s[0] for s in before] == list(range(8))
    healed = after[0]
    assert healed[4] and healed[0] > 8 and all(not s[4] for s in after[1:])  # healed once, at a later step
    survivor = {s[0]: s[5] for s in printed[(dead + 1) % replicas] if s[3]}
    assert [s[5] for s in after] == [survivor[s[0]] for s in after]  # the others' weights, from its first step
    weights = final_weights(tmp_path, replicas)
    assert all(torch.equal(w[name], weights[0][name]) for w in weights for name in w)


def test_diloco_all_reduces_on_its_outer_steps_only_and_its_replicas_agree_after_each(tmp_path):
    """3 replicas, 6 steps, --diloco 3: no all-reduce on the 4 inner steps; on steps 2 and 5 one per parameter
    tensor (the MLP's 4) and every replica's weights the same; apart between them (each its own data)."""
    out = run(tmp_path, "--replicas", "3", "--steps", "6", "--diloco", "3", "--step_time", "0")
    printed = defaultdict(dict)
    for r, step, reduces, outer, n, weights in DILOCO.findall(out):
        printed[int(step)][int(r)] = (int(reduces), outer, n, float(weights))
    tensors = len(list(build_model().parameters()))
    for step in range(6):
        assert sorted(printed[step]) == [0, 1, 2]
        synced = step % 3 == 2
        assert {v[:3] for v in printed[step].values()} == ({(tensors, str(step // 3 + 1), "3")} if synced
                                                           else {(0, "", "")})
        assert (len({v[3] for v in printed[step].values()}) == 1) == synced
    weights = final_weights(tmp_path, 3)
    assert all(torch.equal(w[name], weights[0][name]) for w in weights for name in w)


def free_port_held() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    return held


@pytest.mark.parametrize("case", ["no lighthouse", "port taken", "replica out of range", "no torchft", "bad kill",
                                  "no out_dir", "out_dir in use"])
def test_bad_input_is_one_line_and_nothing_is_left_running(case, tmp_path, monkeypatch, capsys):
    held = free_port_held()
    port = held.getsockname()[1]
    argv, said = {
        "no lighthouse": (["--replica_id", "0", "--lighthouse", "http://127.0.0.1:1"],
                          "error: replica 0: failed to connect to http://127.0.0.1:1 within timeout of 5s"),
        "port taken": (["--lighthouse_port", str(port)],
                       f"error: the lighthouse cannot listen on 127.0.0.1:{port}: Address already in use"),
        "replica out of range": (["--replicas", "2", "--replica_id", "2", "--lighthouse", "http://127.0.0.1:1"],
                                 "--replica_id 2 is out of range: --replicas 2 are 0 to 1"),
        "no torchft": ([], "error: torchft is not installed: pip install -r requirements-torchft.txt"),
        "bad kill": (["--kill", "1"], "--kill must be R:S or R:S:mid, R below 2, S from 1 to 59"),
        "no out_dir": (["--out_dir", "/nonexistent/folder"], "--out_dir /nonexistent/folder is not a folder"),
        "out_dir in use": (["--out_dir", str(tmp_path)], f"error: --out_dir {tmp_path} is in use by another launcher "
                                                         f"(it holds {tmp_path}/lock)"),
    }[case]
    lock = os.open(tmp_path / "lock", os.O_RDWR | os.O_CREAT)  # a first launcher's, held as it holds it
    os.lockf(lock, os.F_LOCK, 0)
    if case in ("replica out of range", "bad kill", "no out_dir"):  # argparse's: in this process, the same code
        with pytest.raises(SystemExit) as exit, monkeypatch.context() as patch:
            patch.setattr(sys, "argv", ["fault_tolerance.py", *argv])
            fault_tolerance.parse_args()
        result = argparse.Namespace(returncode=exit.value.code, stderr=capsys.readouterr().err)
    elif case == "no torchft":
        code = "import runpy, sys; sys.modules['torchft'] = None; sys.argv[0] = 'fault_tolerance.py'; " \
               "runpy.run_path('fault_tolerance.py', run_name='__main__')"
        result = python("-c", code, timeout=60)
    else:
        result = python("fault_tolerance.py", *argv, timeout=60)
    held.close()
    os.close(lock)
    lines = [line for line in result.stderr.splitlines() if not line.startswith(("usage:", " "))]
    assert result.returncode != 0 and len(lines) == 1 and said in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]  # no replica's file
