"""Where train.py's records go, from rank 0: OUT_DIR/metrics.jsonl and, with --tensorboard [DIR], TensorBoard
(through torch.utils.tensorboard). Weights & Biases is not here yet. Each record's numbers are scalars at its step:
a list (pp_wait, a stage each) as KEY/0, KEY/1, ..., a dict (pp_held) as KEY/NAME.

A resumed run logs again the steps after its checkpoint, as metrics.jsonl takes them: TensorBoard's writer starts
with purge_step (the first step logged again), so that its reader drops what the stopped run logged from there on.
"""
import argparse
import importlib.util
import os

from metrics import json_line, open_metrics

INSTALL = "pip install -r requirements-tracking.txt"


def missing(args: argparse.Namespace) -> str | None:
    """The one line for an option whose package is not installed (train.py's parse_args refuses it)."""
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        return f"--tensorboard needs the tensorboard package: {INSTALL}"
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


class Trackers:
    """Rank 0's metrics.jsonl (metrics.open_metrics) and TensorBoard writer, if asked for: write() each record,
    close() at the end."""

    def __init__(self, args: argparse.Namespace, first_step: int) -> None:
        self.jsonl, self.writer = open_metrics(args.out_dir, first_step), None
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            folder = os.path.join(args.out_dir, "tensorboard") if args.tensorboard is True else args.tensorboard
            self.writer = SummaryWriter(folder, purge_step=first_step + 1, flush_secs=10)

    def write(self, record: dict) -> None:
        self.jsonl.write(json_line(record))  # strict JSON: a value that is not finite is null
        if self.writer is not None:
            for name, value in scalars(record).items():
                self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
