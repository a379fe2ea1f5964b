"""Hugging Face's GPT-2 format, out of gpt/: a folder that transformers' GPT2LMHeadModel.from_pretrained loads.

    python gpt/hf.py export model.pt hf/              # a train.py --export file
    python gpt/hf.py export out/step_00005000 hf/     # a checkpoint folder, of any layout (read in one process)
    python gpt/hf.py export out hf/                   # OUT_DIR: its newest checkpoint
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf')"

It writes config.json and model.safetensors. The weights are the same numbers in other places: GPT-2 keeps q, k
and v in one projection (c_attn, q's rows first) and its Conv1D stores a weight as (in, out), a Linear's
transposed; the head stays tied to the embedding (one matrix, saved once). A vocabulary padded for speed (50304
for GPT-2's 50257) is kept, and said; --vocab_size 50257 cuts the rows no token uses. Needs transformers'
safetensors (requirements-hf.txt); train.py does not.
"""
import argparse
import json
import os
import re
import sys
import warnings
from dataclasses import asdict

import torch

from model import GPT, GPTConfig

GPT2_VOCAB = 50257  # GPT-2's tokenizer: ids 0 to 50256, 50256 its end of text


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gpt/model.py's state_dict in GPT2LMHeadModel's names and shapes (the tied head left out: it is wte)."""
    hf = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
          "transformer.ln_f.weight": state["ln_f.weight"], "transformer.ln_f.bias": state["ln_f.bias"]}
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = [f"{ours}attn.{p}" for p in "qkv"]
        hf[f"{theirs}attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).t()
        hf[f"{theirs}attn.c_attn.bias"] = torch.cat([state[f"{n}.bias"] for n in qkv])
        for mine, hers in (("attn.o", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            hf[f"{theirs}{hers}.weight"] = state[f"{ours}{mine}.weight"].t()
            hf[f"{theirs}{hers}.bias"] = state[f"{ours}{mine}.bias"]
        for norm in ("ln_1", "ln_2"):
            hf[f"{theirs}{norm}.weight"], hf[f"{theirs}{norm}.bias"] = state[f"{ours}{norm}.weight"], \
                state[f"{ours}{norm}.bias"]
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def hf_config(config: GPTConfig) -> dict:
    """config.json for GPT2LMHeadModel: GPT-2's choices where gpt/model.py makes the same (tanh GELU, LayerNorm's
    eps 1e-5, attention scaled by 1/sqrt(head_dim), tied head)."""
    text = config.vocab_size >= GPT2_VOCAB  # GPT-2's ids: its end-of-text token
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.seq_len, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": GPT2_VOCAB - 1 if text else None,
            "eos_token_id": GPT2_VOCAB - 1 if text else None, "dtype": "float32"}


def read(source: str) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """(config, whole state_dict) of a train.py --export file, or of a checkpoint folder (manifest.json and
    DCP's files, of any layout: DCP reads them in this one process into whole tensors)."""
    if os.path.isfile(source):
        model = GPT.load(source)
        return model.config, model.state_dict()
    with open(os.path.join(source, "manifest.json")) as file:
        config = GPTConfig(**json.load(file)["config"])
    import torch.distributed.checkpoint as dcp

    model = GPT(config)
    saved = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    state = {name: tensor for name, tensor in model.state_dict().items() if f"model.{name}" in saved}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=source)  # no process group: read here, whole
    model.load_state_dict(state, strict=False)  # the tied head is wte.weight, whichever name was saved
    return config, model.state_dict()


def checkpoint(source: str) -> str:
    """SOURCE itself (a file, or a checkpoint folder), or OUT_DIR's newest checkpoint folder."""
    if os.path.isfile(source) or os.path.isfile(os.path.join(source, "manifest.json")):
        return source
    steps = sorted(name for name in os.listdir(source) if re.fullmatch(r"step_\d{8}", name)
                   and os.path.isfile(os.path.join(source, name, "manifest.json")))
    if not steps:
        raise ValueError("neither a train.py --export file, nor a checkpoint folder (with its manifest.json), nor "
                         "an OUT_DIR that holds one")
    return os.path.join(source, steps[-1])


def export(source: str, dest: str, vocab_size: int | None) -> str:
    """Write DEST (config.json, model.safetensors); return the line that says what was written."""
    from safetensors.torch import save_file

    source = checkpoint(source)
    config, state = read(source)
    said = f"vocab {config.vocab_size}"
    if vocab_size is not None:
        if not 0 < vocab_size <= config.vocab_size:
            raise ValueError(f"--vocab_size {vocab_size}: the model's vocab is {config.vocab_size}")
        state["wte.weight"] = state["wte.weight"][:vocab_size]
        config = GPTConfig(**{**asdict(config), "vocab_size": vocab_size})
        said = f"vocab {vocab_size} (the first {vocab_size} of the model's {state['lm_head.weight'].shape[0]} rows)"
    elif config.vocab_size > GPT2_VOCAB:
        said += f" (GPT-2's {GPT2_VOCAB} padded: no token's id is {GPT2_VOCAB} or more; --vocab_size {GPT2_VOCAB} cuts)"
    os.makedirs(dest, exist_ok=True)
    save_file(to_hf(state, config), os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dest, "config.json"), "w") as file:
        json.dump(hf_config(config), file, indent=2)
    return f"wrote {dest} from {source}: GPT2LMHeadModel, {config.n_layer} layers, {said}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    out = commands.add_parser("export", help="a train.py --export file or a checkpoint folder to a transformers folder")
    out.add_argument("source", help="a train.py --export file, or a checkpoint folder (OUT_DIR/step_N)")
    out.add_argument("dest", help="the folder to write (config.json, model.safetensors)")
    out.add_argument("--vocab_size", type=int, help="keep the first N rows of the vocabulary (default: all)")
    args = parser.parse_args()
    try:
        import safetensors  # noqa: F401
    except ImportError:
        parser.error("hf.py needs safetensors: pip install -r requirements-hf.txt")
    try:
        print(export(args.source, args.dest, args.vocab_size))
    except OSError as error:
        sys.exit(f"error: {error.filename or args.source}: {error.strerror or error}")
    except ValueError as error:
        sys.exit(f"error: {args.source}: {error}")
    except Exception as error:  # torch.load, DCP, load_state_dict: KeyError, UnpicklingError, RuntimeError, ...
        sys.exit(f"error: {args.source}: not a model or checkpoint written by gpt/train.py ({type(error).__name__})")


if __name__ == "__main__":
    main()
