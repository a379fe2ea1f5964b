"""Hugging Face's GPT-2 format, out of gpt/: a folder that transformers' GPT2LMHeadModel.from_pretrained loads.

    python gpt/hf.py export model.pt hf/              # a train.py --export file
    python gpt/hf.py export out/step_00005000 hf/     # a checkpoint folder, of any layout (read in one process)
    python gpt/hf.py export out hf/                   # OUT_DIR: its newest checkpoint
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf')"

It writes config.json and model.safetensors. The weights are the same numbers in other places: GPT-2 keeps q, k
and v in one projection (c_attn, q's rows first) and its Conv1D stores a weight as (in, out), a Linear's
transposed; the head stays tied to the embedding (one matrix, saved once). A vocabulary padded for speed (50304
for GPT-2's 50257) is kept, and said; --vocab_size 50257 cuts the rows no token uses. A model trained on
gpt/prepare.py's shards carries the record of their tokenizer: its tokenizer.json and tokenizer_config.json are
written beside (AutoTokenizer loads the folder). Needs transformers' safetensors, and transformers and tokenizers
for a tokenizer (requirements-hf.txt); train.py does not.
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


def pairs(n_layer: int):
    """(gpt/'s name, GPT2LMHeadModel's name without `transformer.`, whether GPT-2's Conv1D keeps it transposed) of
    every weight but q, k and v, which GPT-2 keeps as one c_attn (q's rows first)."""
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        yield name, name, False
    for i in range(n_layer):
        for mine, hers in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.o", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                           ("mlp.proj", "mlp.c_proj")):
            yield f"blocks.{i}.{mine}.weight", f"h.{i}.{hers}.weight", not mine.startswith("ln")
            yield f"blocks.{i}.{mine}.bias", f"h.{i}.{hers}.bias", False


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gpt/model.py's state_dict in GPT2LMHeadModel's names and shapes (the tied head left out: it is wte)."""
    hf = {f"transformer.{theirs}": state[ours].t() if transposed else state[ours]
          for ours, theirs, transposed in pairs(config.n_layer)}
    for i in range(config.n_layer):
        qkv = [f"blocks.{i}.attn.{p}" for p in "qkv"]
        hf[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).t()
        hf[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[f"{n}.bias"] for n in qkv])
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def check(folder: str, config: GPTConfig) -> list[str]:
    """The weight files of a Hugging Face GPT-2 folder that fits `config`, the run's model (the same layers, heads
    and width; as many positions or more; a vocabulary as large or smaller), from its config.json alone; else a
    ValueError, one line."""
    try:
        with open(os.path.join(folder, "config.json")) as file:
            theirs = json.load(file)
    except OSError as error:
        raise ValueError(f"--init_from {folder}: {error.strerror or error}: not a Hugging Face model folder") from None
    if theirs.get("model_type") != "gpt2":
        raise ValueError(f"--init_from {folder}: a {theirs.get('model_type')!r} model (config.json), not GPT-2's")
    for name in ("n_layer", "n_head", "n_embd"):
        if theirs.get(name) != getattr(config, name):
            raise ValueError(f"--init_from {folder}: its {name} is {theirs.get(name)}, --model's "
                             f"{getattr(config, name)}")
    if theirs.get("activation_function", "gelu_new") != "gelu_new" or not theirs.get("tie_word_embeddings", True):
        raise ValueError(f"--init_from {folder}: GPT-2 with another activation or an untied head, which gpt/ lacks")
    if theirs.get("n_positions", 0) < config.seq_len or theirs.get("vocab_size", 0) > config.vocab_size:
        raise ValueError(f"--init_from {folder}: {theirs.get('n_positions')} positions and vocab "
                         f"{theirs.get('vocab_size')}, where the run needs {config.seq_len} positions or more "
                         f"(--seq_len) and a vocab of {config.vocab_size} or less")
    index = os.path.join(folder, "model.safetensors.index.json")
    files = [os.path.join(folder, "model.safetensors")]
    if os.path.isfile(index):
        with open(index) as file:
            files = [os.path.join(folder, name) for name in sorted(set(json.load(file)["weight_map"].values()))]
    if all(os.path.isfile(path) for path in files):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ValueError("--init_from of a safetensors folder needs safetensors: pip install -r "
                             "requirements-hf.txt") from None
        return files
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        return [os.path.join(folder, "pytorch_model.bin")]
    raise ValueError(f"--init_from {folder}: neither model.safetensors nor pytorch_model.bin")


def from_hf(folder: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 folder's weights (config.json; model.safetensors, its index of shards, or
    pytorch_model.bin) as gpt/model.py's state_dict for `config`, the run's model (see check): the first seq_len
    positions; a vocabulary padded with rows that are the mean of the others (transformers'
    resize_token_embeddings draws new rows around that mean): each padding id's logit is the mean of the others',
    so they take little of the softmax's mass."""
    weights = {}
    for path in check(folder, config):
        if path.endswith(".bin"):
            weights.update(torch.load(path, map_location="cpu", weights_only=True))  # tensors only, no code
        else:
            from safetensors.torch import load_file

            weights.update(load_file(path))
    weights = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
    try:
        state = {ours: weights[theirs].t() if transposed else weights[theirs]
                 for ours, theirs, transposed in pairs(config.n_layer)}
        for i in range(config.n_layer):
            for proj, weight, bias in zip("qkv", weights[f"h.{i}.attn.c_attn.weight"].t().chunk(3),
                                          weights[f"h.{i}.attn.c_attn.bias"].chunk(3), strict=True):
                state[f"blocks.{i}.attn.{proj}.weight"], state[f"blocks.{i}.attn.{proj}.bias"] = weight, bias
    except KeyError as error:
        raise ValueError(f"--init_from {folder}: its weights lack {error.args[0]}") from None
    state["wpe.weight"] = state["wpe.weight"][:config.seq_len]  # the positions the run uses
    wte = state["wte.weight"]
    if len(wte) < config.vocab_size:
        padding = wte.float().mean(0, keepdim=True).to(wte.dtype).expand(config.vocab_size - len(wte), -1)
        state["wte.weight"] = torch.cat([wte, padding])
    state["lm_head.weight"] = state["wte.weight"]
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in GPT(config).state_dict().items()}
    for name, tensor in state.items():
        if tensor.shape != shapes[name]:
            raise ValueError(f"--init_from {folder}: {name} is {tuple(tensor.shape)}, the model's "
                             f"{tuple(shapes[name])}")
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def hf_config(config: GPTConfig, eot: int | None = None) -> dict:
    """config.json for GPT2LMHeadModel: GPT-2's choices where gpt/model.py makes the same (tanh GELU, LayerNorm's
    eps 1e-5, attention scaled by 1/sqrt(head_dim), tied head). `eot`: the end-of-text id of prepare.py's
    tokenizer, else GPT-2's where the vocab is GPT-2's size or more."""
    eot = eot if eot is not None else GPT2_VOCAB - 1 if config.vocab_size >= GPT2_VOCAB else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.seq_len, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32"}


def read(source: str) -> tuple[GPTConfig, dict[str, torch.Tensor], dict | None]:
    """(config, whole state_dict, gpt/prepare.py's tokenizer record or None) of a train.py --export file, or of a
    checkpoint folder (manifest.json and DCP's files, of any layout: DCP reads them in this one process)."""
    if os.path.isfile(source):
        model = GPT.load(source)
        return model.config, model.state_dict(), model.tokenizer
    with open(os.path.join(source, "manifest.json")) as file:
        manifest = json.load(file)
    config, tokenizer = GPTConfig(**manifest["config"]), manifest.get("tokenizer")
    import torch.distributed.checkpoint as dcp

    model = GPT(config)
    saved = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    state = {name: tensor for name, tensor in model.state_dict().items() if f"model.{name}" in saved}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=source)  # no process group: read here, whole
    model.load_state_dict(state, strict=False)  # the tied head is wte.weight, whichever name was saved
    return config, model.state_dict(), tokenizer


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
    config, state, tokenizer = read(source)
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
        json.dump(hf_config(config, tokenizer and tokenizer["eot"]), file, indent=2)
    said += tokenizer_files(tokenizer, dest, config.seq_len)
    return f"wrote {dest} from {source}: GPT2LMHeadModel, {config.n_layer} layers, {said}"


def tokenizer_files(tokenizer: dict | None, dest: str, positions: int) -> str:
    """Where the model's shards came from gpt/prepare.py: the tokenizer's tokenizer.json (a tiktoken encoding's
    made into one) and a tokenizer_config.json naming its end-of-text token, which AutoTokenizer.from_pretrained
    reads. What is written, said."""
    if tokenizer is None:
        return ""
    try:
        import tokenizers

        text = tokenizer["json"] if tokenizer["kind"] == "tokenizers" else from_tiktoken(tokenizer["name"])
    except ImportError as error:  # one line, as the other extras say it
        raise ValueError(f"its tokenizer needs {error.name}: pip install -r requirements-hf.txt") from None
    eot = tokenizers.Tokenizer.from_str(text).id_to_token(tokenizer["eot"])
    with open(os.path.join(dest, "tokenizer.json"), "w", encoding="utf-8") as file:
        file.write(text)
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as file:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot,
                   "model_max_length": positions}, file, indent=2)
    return f"; tokenizer.json ({os.path.basename(tokenizer['name'])}, end of text {eot!r})"


def from_tiktoken(name: str) -> str:
    """A tiktoken encoding as a tokenizer.json: transformers' TikTokenConverter (the same regex, then byte-level
    BPE with merges read from the ranks) given the ranks in memory. Ids no token has (tiktoken's gaps before its
    special tokens) are held by placeholders, so that each special token keeps its id."""
    import tiktoken
    from tokenizers import AddedToken, Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = tiktoken.get_encoding(name)
    converter = TikTokenConverter(pattern=encoding._pat_str)
    converter.load_tiktoken_bpe = lambda _: encoding._mergeable_ranks
    tokenizer = converter.converted()
    special = sorted((i, token) for token, i in encoding._special_tokens.items())
    for i, token in special:
        if tokenizer.get_vocab_size(with_added_tokens=True) < i:  # the gap: placeholders no text maps to
            tokenizer.add_tokens([AddedToken(f"<|unused_{j}|>", special=True) for j in
                                  range(tokenizer.get_vocab_size(with_added_tokens=True), i)])
        tokenizer.add_special_tokens([AddedToken(token, normalized=False, special=True)])
    assert all(tokenizer.token_to_id(token) == i for i, token in special), name
    return Tokenizer.to_str(tokenizer)


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
