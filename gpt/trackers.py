"""Where train.py's records go, from rank 0: OUT_DIR/metrics.jsonl and, if asked for, TensorBoard (--tensorboard
[DIR], through torch.utils.tensorboard) and Weights & Biases (--wandb PROJECT; WANDB_MODE=offline: no network).
Each record's numbers are scalars at its step: a list (pp_wait, a stage each) as KEY/0, KEY/1, ..., a dict
(pp_held) as KEY/NAME.

A resumed run logs again the steps after its checkpoint, as metrics.jsonl takes them: TensorBoard's writer starts
with purge_step (the first step logged again), so that its reader drops what the stopped run logged from there on.
A W&B run's history only grows (its steps only rise), so the resumed run continues the same run (its id in
OUT_DIR/wandb_id) from the step after the last one the stopped run logged: those in between keep the stopped run's
values there.
"""
import argparse
import contextlib
import importlib.util
import json
import os

from metrics import json_line, open_metrics

INSTALL = "pip install -r requirements-tracking.txt"


def missing(args: argparse.Namespace) -> str | None:
    """The one line for an option whose package is not installed (train.py's parse_args refuses it)."""
    for option, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(args, option) and importlib.util.find_spec(package) is None:
            return f"--{option} needs the {package} package: {INSTALL}"
    return None


def scalars(record: dict) -> dict[str, float]:
    """A record's numbers by name, its lists and dicts spread out, its step and anything not a number left out (an
    inf or nan, such as a skipped fp16 step's gradient norm, is kept: TensorBoard draws it)."""
    out = {}
    for key, value in record.items():
        parts = enumerate(value) if isinstance(value, list) else value.items() if isinstance(value, dict) else None
        for name, number in [(key, value)] if parts is None else [(f"{key}/{k}", v) for k, v in parts]:
            if key != "step" and isinstance(number, int | float) and not isinstance(number, bool):
                out[name] = number
    return out


def last_step(path: str) -> int:
    """The last step metrics.jsonl holds (0 for none): read before open_metrics cuts it back to a checkpoint's."""
    step = 0
    if os.path.exists(path):
        with open(path) as file:
            for line in file:
                try:
                    step = max(step, json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    pass  # a line cut short by a crash
    return step


class Trackers:
    """Rank 0's metrics.jsonl (metrics.open_metrics), TensorBoard writer and W&B run, if asked for: write() each
    record, close() at the end. `options`: the run's resolved options, W&B's config."""

    def __init__(self, args: argparse.Namespace, first_step: int, options: dict) -> None:
        self.writer, self.wandb, self.wandb_past = None, None, 0
        if args.wandb:  # first: it is what may fail (no API key, no network), and then nothing is written
            import wandb
            path = os.path.join(args.out_dir, "wandb_id")
            resumed = os.path.exists(path)
            if resumed:  # a W&B run resumed: it holds the stopped run's steps, as metrics.jsonl does before the cut
                with open(path) as file:
                    run_id = file.read().strip()
                self.wandb_past = last_step(os.path.join(args.out_dir, "metrics.jsonl"))
            else:
                run_id = os.urandom(4).hex()  # W&B's ids: 8 of a-z and 0-9
            try:
                self.wandb = wandb.init(project=args.wandb, id=run_id, resume="allow", config=options,
                                        dir=args.out_dir)
            except Exception as error:  # train.py's rank 0 says it for every rank, in one line
                with contextlib.suppress(Exception):
                    wandb.teardown()  # its wandb-core process ended too
                said = " ".join(str(error).split())  # one line (pydantic's errors, of a bad setting, are several)
                raise ValueError(f"--wandb {args.wandb}: {type(error).__name__}: {said} (WANDB_MODE=offline logs "
                                 "with no network; `wandb sync` uploads later)") from None
            if not resumed:
                with open(path + ".tmp", "w") as file:
                    file.write(run_id + "\n")
                os.replace(path + ".tmp", path)
        self.jsonl = open_metrics(args.out_dir, first_step)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            folder = os.path.join(args.out_dir, "tensorboard") if args.tensorboard is True else args.tensorboard
            self.writer = SummaryWriter(folder, purge_step=first_step + 1, flush_secs=10)

    def write(self, record: dict) -> None:
        self.jsonl.write(json_line(record))  # strict JSON: a value that is not finite is null
        if self.writer is not None:
            for name, value in scalars(record).items():
                self.writer.add_scalar(name, value, record["step"])
        if self.wandb is not None and record["step"] > self.wandb_past:
            try:
                self.wandb.log(scalars(record), step=record["step"])
            except Exception as error:  # its wandb-core process ended (a signal to every process, as Slurm's)
                print(f"W&B stopped at step {record['step']} ({type(error).__name__}: {error}): metrics.jsonl goes "
                      "on", flush=True)
                self.close_wandb(1)

    def close_wandb(self, code: int) -> None:
        """The W&B run finished (failed, for a code that is not 0), and its wandb-core process ended."""
        import wandb
        run, self.wandb = self.wandb, None
        for end in (lambda: run.finish(exit_code=code), wandb.teardown):  # each, even if the other fails
            with contextlib.suppress(Exception):  # its core gone already: nothing more to finish
                end()

    def close(self, failed: bool = False) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.close_wandb(1 if failed else 0)
