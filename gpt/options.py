"""train.py's options (parser), and in a TOML file: `--config FILE.toml` reads them (a key per option, named as the
option without its --: `max_steps = 300`, `compile = true`), and the command line's options win over the file's;
each run writes the options it resolved to OUT_DIR/config.toml, which `--config` reads back to run it again. Paths
in the file are read from where train.py runs, as on the command line. Python's own tomllib reads; the writer is
the few lines below (train.py's values are strings, numbers and true).
"""
import argparse
import difflib
import json
import math
import os
import tomllib

import checks
import context
import pipeline
from model import CONFIGS
from parallelize import DTYPES


def steps_range(text: str) -> tuple[int, int]:
    """--profile's A:B: the first and last step to trace, 1 <= A <= B."""
    first, _, last = text.partition(":")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"{text!r} is not A:B with 1 <= A <= B (steps, e.g. 10:12)")
    return int(first), int(last)


class Help(argparse.RawTextHelpFormatter):
    """--help as written, each option's default added where it has one and its help names none (argparse's
    ArgumentDefaultsHelpFormatter's hook, without its "default: None" and "default: False")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in action.help or any(action.default is no for no in (None, False, argparse.SUPPRESS)):
            return action.help
        return action.help + " (default: %(default)s)"


def parser(description: str) -> argparse.ArgumentParser:
    """train.py's options (its parse_args checks their values together)."""
    p = checks.Parser(description=description, formatter_class=Help)
    p.add_argument("--config", metavar="FILE.toml", help="options from a TOML file (gpt/options.py), a key an "
                                                         "option: the command line's win")
    p.add_argument("--model", choices=CONFIGS, help="the model's family and shape (gpt/model.py CONFIGS; default: "
                                                    "tiny, or --init_from's)")
    p.add_argument("--data", default="synthetic", help="synthetic, a text file, or a folder of shards:\n"
                                                       "nanoGPT's train.bin and val.bin, or llm.c's NAME_train_N.bin "
                                                       "and NAME_val_N.bin")
    p.add_argument("--data_dtype", choices=["uint16", "uint32"], help="the width of raw .bin ids, which have no "
                                                                      "header (default: uint16);\nllm.c's shards "
                                                                      "say theirs")
    p.add_argument("--vocab_size", type=int, help="token ids below this (default: 64 synthetic, 256 text, 50304 DIR;\n"
                                                  "prepare.py's shards: its tokenizer's, rounded up to 64)")
    p.add_argument("--parallel", choices=["ddp", "fsdp", "hsdp"], default="ddp",
                   help="ddp: a replica per rank (at one rank, the model alone: no DDP);\n"
                        "fsdp: every block sharded over all ranks;\n"
                        "hsdp: sharded within groups of --shard_size ranks, replicated across them")
    p.add_argument("--shard_size", type=int, help="hsdp: data-parallel ranks per shard group, a tp or cp group "
                                                    "counting once\n(default: a node's ranks / (--tp × --cp))")
    p.add_argument("--tp", type=int, default=1, help="fsdp, hsdp: tensor parallel over groups of this many "
                                                      "neighbouring ranks,\nwhich read the same batch (1: none)")
    p.add_argument("--pp", type=int, default=1, help="fsdp, hsdp: pipeline parallel over this many ranks (far "
                                                      "apart), which read the same\nbatch in --grad_accum "
                                                      "micro-batches (1F1B: at least --pp of them; 1: none)")
    p.add_argument("--ep", type=int, default=1, help="fsdp, hsdp: expert parallel over groups of this many data-"
                                                      "parallel ranks,\neach holding n_expert / ep experts (1: none)")
    p.add_argument("--cp", type=int, default=1, help="fsdp, hsdp: context parallel: each sequence split over groups "
                                                      "of this many ranks,\nwhich read the same batch and shard the "
                                                      "weights with FSDP's (1: none)")
    p.add_argument("--cp_method", choices=context.METHODS,
                   help="--cp's attention: allgather (the default), each rank's k and v gathered from the others;\n"
                        "ulysses, "
                        "all-to-alls that trade the sequence split for a head split;\nring, k and v passed from "
                        "rank to rank")
    p.add_argument("--pp_schedule", choices=pipeline.SCHEDULES,
                   help="--pp's schedule, torch.distributed.pipelining's (default: 1F1B); Interleaved1F1B,\n"
                        "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV hold two stages per rank")
    p.add_argument("--max_steps", type=int, default=300, help="optimizer steps in the whole run")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per rank per micro-step (a tp group, a cp "
                                                              "group or a pipeline counting once)")
    p.add_argument("--grad_accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate, after warmup")
    p.add_argument("--min_lr", type=float, help="the learning rate at the end of the cosine (default: lr / 10)")
    p.add_argument("--warmup_steps", type=int, default=20, help="steps of linear warmup from 0 to --lr")
    p.add_argument("--weight_decay", type=float, default=0.1, help="AdamW's, on matrices only")
    p.add_argument("--grad_clip", type=float, default=1.0, help="clip the gradient's global norm to this; 0: never")
    p.add_argument("--precision", choices=DTYPES, default="fp32", help="the compute dtype; weights stay fp32")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile each block, and the head with its loss (under --pp the blocks only;\nnot "
                        "under the schedules that split a backward in two)")
    p.add_argument("--activation_checkpoint", choices=["none", "full", "selective"], default="none",
                   help="per block: keep only its input for backward and run it again there (full), or keep\n"
                        "the matrix products' and attention's results and recompute the rest (selective)")
    p.add_argument("--seed", type=int, default=0, help="the initial weights and the order of the batches")
    p.add_argument("--init_from", metavar="DIR", help="start from a Hugging Face folder's model: GPT-2, Llama or "
                   "Qwen3, its shape\nfrom its config.json (gpt/hf.py; a checkpoint in OUT_DIR comes first)")
    p.add_argument("--log_every", type=int, default=10, help="steps per log line (1: every step)")
    p.add_argument("--eval_every", type=int, default=100, help="steps between evaluations (and at the end)")
    p.add_argument("--val_tokens", type=int, default=32768, help="tokens evaluated, at most what the val split "
                                                                  "holds")
    p.add_argument("--out_dir", default="out", help="metrics.jsonl and checkpoints; a run resumes from the "
                                                    "newest checkpoint here")
    p.add_argument("--save_every", type=int, default=100, help="steps between checkpoints in OUT_DIR (0: only at "
                                                               "the end)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept; older ones are deleted")
    p.add_argument("--export", help="write the whole model here at the end, for GPT.load (gpt/model.py)")
    p.add_argument("--peak_tflops", type=float, help="the GPU's peak, for MFU (default: from its name)")
    p.add_argument("--timeout", type=float, help="seconds a collective may wait (default: torch's, 10 min on\n"
                                                       "nccl, 30 min on gloo); also the saves' and the stop's waits "
                                                       "(default: 30 min)")
    p.add_argument("--profile", type=steps_range, metavar="A:B", help="write a torch.profiler trace of steps A to B "
                                                                      "per rank to OUT_DIR/profile (Perfetto opens it)")
    p.add_argument("--tensorboard", nargs="?", const=True, metavar="DIR", help="also log every record's numbers to "
                   "TensorBoard, in DIR (default: OUT_DIR/tensorboard;\ntensorboard --logdir shows them)")
    p.add_argument("--wandb", metavar="PROJECT", help="also log them to this Weights & Biases project, the options "
                   "as its config;\na resume continues the run (its id in OUT_DIR/wandb_id); WANDB_MODE=offline: "
                   "no network")
    return p


def with_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """argv with the options of its --config file (if it names one) before it: argparse takes an option's last
    value, so the command line's win. A file that cannot be read, is not TOML, or holds a key that is no option or a
    value of the wrong type: parser.error's one line, naming the file and the key or line."""
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--config", action="append")
    paths = known.parse_known_args(argv)[0].config
    if paths is None:
        return argv
    if len(paths) > 1:
        parser.error(f"--config given {len(paths)} times ({', '.join(paths)}): give one file")
    path = paths[0]
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as error:
        parser.error(f"--config {path}: {error.strerror or error}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        parser.error(f"--config {path}: not TOML: {error}")
    actions = {action.dest: action for action in parser._actions if action.option_strings}
    words = []
    for key, value in table.items():
        action = actions.get(key)
        if action is None or key in ("config", "help"):
            close = difflib.get_close_matches(key, [a for a in actions if a not in ("config", "help")], n=1)
            parser.error(f"--config {path}: {key!r} is not an option of {parser.prog}"
                         + (f" (did you mean {close[0]!r}?)" if close else ""))
        words += as_words(parser, path, key, value, action)
    return words + argv


def as_words(parser: argparse.ArgumentParser, path: str, key: str, value, action: argparse.Action) -> list[str]:
    """A key's value as the command line would give it, once its TOML type is the option's."""
    if action.nargs == 0:  # a switch (store_true): true, or false for its default
        expected, ok = "true or false", isinstance(value, bool)
    elif action.type is int:
        expected, ok = "an integer", isinstance(value, int) and not isinstance(value, bool)
    elif action.type is float:
        expected, ok = "a number", isinstance(value, int | float) and not isinstance(value, bool)
    else:  # a string: a name among choices, a path, "A:B"; --tensorboard's true too
        expected, ok = "a string", isinstance(value, str) or (action.nargs == "?" and isinstance(value, bool))
    if ok and action.choices is not None and value not in action.choices:
        expected, ok = f"one of {', '.join(map(str, action.choices))}", False
    if not ok:
        parser.error(f"--config {path}: {key} = {json.dumps(value, default=str)}: {key} takes {expected}")
    if action.nargs == "?" and isinstance(value, bool):  # --tensorboard, with no folder after it; false: off
        return [action.option_strings[0]] if value else []
    if isinstance(action, argparse.BooleanOptionalAction):  # --compile or --no-compile
        return [f"--{'' if value else 'no-'}{key}"]
    if action.nargs == 0:
        return [action.option_strings[0]] if value else []
    return [f"{action.option_strings[0]}={value}"]  # one word: a value such as "-x" is not taken for an option


def save(args: argparse.Namespace, parser: argparse.ArgumentParser, path: str) -> None:
    """The options of a run as a TOML file that --config reads back (written, then renamed over the old one)."""
    with open(path + ".tmp", "w", encoding="utf-8") as file:
        file.write(written(args, parser))
    os.replace(path + ".tmp", path)


def values(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict:
    """The options of a run by name: every option with a value (not None, not a switch left off), --config itself
    aside; --profile's A:B as written."""
    out = {}
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("config", "help") or value is None or value is False:
            continue
        out[action.dest] = ":".join(map(str, value)) if isinstance(value, tuple) else value
    return out


def written(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The options of a run (values) as TOML."""
    lines = ["# gpt/train.py's options for this run: gpt/train.py --config FILE runs it again"]
    for name, value in values(args, parser).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{name} {value} has no TOML form train.py reads back")  # refused by the parser
        lines.append(f"{name} = {json.dumps(value, ensure_ascii=False)}")  # JSON's are TOML's too
    return "\n".join(lines) + "\n"
