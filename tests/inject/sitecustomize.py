"""Fault injection for the fault-tolerance tests, from outside the scripts.

Python imports `sitecustomize` at start-up from the first folder on sys.path that has one, so a
test that puts this folder on PYTHONPATH gets it loaded into every process it starts. In the one
process chosen by the environment it SIGKILLs itself at a chosen moment:

    KILL_RANK=1 KILL_AT=step:45   at that rank's 45th optimizer step
    KILL_RANK=0 KILL_AT=save:2    in its 2nd checkpoint write, after the data, before the rename
    KILL_RANK=2 KILL_AT=init:1    as it starts to join the process group (start-up, rendezvous)
    KILL_RANK=1 KILL_AT=eval:3    in its 3rd validation batch
    KILL_RANK=0 KILL_AT=time:2.5  2.5 seconds after the process started, wherever it is then
    KILL_LOCAL_RANK=1 ...         the process with that LOCAL_RANK instead (one node of several)

Under torchrun only the first attempt is hit (TORCHELASTIC_RESTART_COUNT=0), so a restart can
finish the job. Lists separated by commas name one moment per attempt, the first for attempt 0:

    KILL_RANK=2,1,0 KILL_AT=init:1,eval:2,save:1   three kills, then a fourth attempt that finishes

The rank comes from RANK (torchrun) or from the spawn index (mp.spawn).

    SLOW_SAVE=8                   every checkpoint write of every process takes 8 s longer
    SLOW_STEP=0.25                every optimizer step of every process takes 0.25 s longer (a run a test can
                                  signal mid-way in few steps)
"""
import os

_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if _attempt < len(os.environ.get("KILL_AT", "").split(",")) and "KILL_AT" in os.environ:
    import multiprocessing
    import signal
    import threading

    _kind, _count = os.environ["KILL_AT"].split(",")[_attempt].split(":")
    _kill_rank = os.environ.get("KILL_RANK", "").split(",")[_attempt] if "KILL_RANK" in os.environ else None
    _calls = [0]

    def _this_rank() -> str:
        if "RANK" in os.environ:
            return os.environ["RANK"]
        identity = multiprocessing.current_process()._identity  # (i,) in the i-th spawned child
        return str(identity[0] - 1) if identity else "parent"

    def _die() -> None:
        print(f"[inject] SIGKILL rank {_this_rank()} at {_kind} {_count}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _chosen() -> bool:
        if "KILL_LOCAL_RANK" in os.environ:
            return os.environ.get("LOCAL_RANK") == os.environ["KILL_LOCAL_RANK"]
        return _this_rank() == _kill_rank

    def _count_and_maybe_die() -> None:
        if _chosen():
            _calls[0] += 1
            if _calls[0] == int(_count):
                _die()

    if _kind == "time":
        if _chosen():
            threading.Thread(target=lambda: (threading.Event().wait(float(_count)), _die()), daemon=True).start()
    elif _kind == "save":
        _replace = os.replace

        def replace(source, destination, **kwargs) -> None:
            if str(source).endswith(".tmp"):  # a checkpoint written in full, not yet renamed into place
                _count_and_maybe_die()
            _replace(source, destination, **kwargs)

        os.replace = replace
    else:
        import torch
        import torch.distributed
        import torch.nn.functional

        if _kind == "step":
            _step = torch.optim.Adam.step

            def step(self, *args, **kwargs):
                _count_and_maybe_die()
                return _step(self, *args, **kwargs)

            torch.optim.Adam.step = step
        elif _kind == "init":
            _init = torch.distributed.init_process_group

            def init_process_group(*args, **kwargs):
                _count_and_maybe_die()
                return _init(*args, **kwargs)

            torch.distributed.init_process_group = init_process_group
        elif _kind == "eval":
            _mse_loss = torch.nn.functional.mse_loss

            def mse_loss(*args, **kwargs):
                if kwargs.get("reduction") == "sum":  # only evaluate() sums
                    _count_and_maybe_die()
                return _mse_loss(*args, **kwargs)

            torch.nn.functional.mse_loss = mse_loss

if "SLOW_SAVE" in os.environ:
    import time

    _replace_fast = os.replace

    def replace_slowly(source, destination, **kwargs) -> None:
        if str(source).endswith(".tmp"):  # the checkpoint is written: the rename waits
            print(f"[inject] a checkpoint write that takes {os.environ['SLOW_SAVE']} s longer", flush=True)
            time.sleep(float(os.environ["SLOW_SAVE"]))
        _replace_fast(source, destination, **kwargs)

    os.replace = replace_slowly

if "SLOW_STEP" in os.environ:
    import time

    import torch

    _step_fast = torch.optim.Adam.step  # gpt/'s AdamW's too

    def step_slowly(self, *args, **kwargs):
        time.sleep(float(os.environ["SLOW_STEP"]))
        return _step_fast(self, *args, **kwargs)

    torch.optim.Adam.step = step_slowly
