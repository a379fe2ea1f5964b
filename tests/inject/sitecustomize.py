"""Fault injection for the fault-tolerance tests, from outside the scripts.

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one, so a
test that puts this folder on PYTHONPATH gets it loaded into every process it starts. In the one
process chosen by the environment it SIGKILLs itself at a chosen moment:

    KILL_RANK=1 KILL_AT=step:45   at that rank's 45th optimizer step
    KILL_RANK=0 KILL_AT=save:2    in its 2nd checkpoint write, after the data, before the rename

Under torchrun only the first attempt is hit (TORCHELASTIC_RESTART_COUNT=0), so a restart can
finish the job. The rank comes from RANK (torchrun) or from the spawn index (mp.spawn).
"""
import os

if "KILL_AT" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    import multiprocessing
    import signal

    _kind, _count = os.environ["KILL_AT"].split(":")
    _calls = [0]

    def _this_rank() -> str:
        if "RANK" in os.environ:
            return os.environ["RANK"]
        identity = multiprocessing.current_process()._identity  # (i,) in the i-th spawned child
        return str(identity[0] - 1) if identity else "parent"

    def _count_and_maybe_die() -> None:
        if _this_rank() == os.environ["KILL_RANK"]:
            _calls[0] += 1
            if _calls[0] == int(_count):
                print(f"[inject] SIGKILL rank {_this_rank()} at {_kind} {_count}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    if _kind == "step":
        import torch

        _step = torch.optim.Adam.step

        def step(self, *args, **kwargs):
            _count_and_maybe_die()
            return _step(self, *args, **kwargs)

        torch.optim.Adam.step = step
    elif _kind == "save":
        _fsync = os.fsync

        def fsync(fd: int) -> None:
            _count_and_maybe_die()
            _fsync(fd)

        os.fsync = fsync
