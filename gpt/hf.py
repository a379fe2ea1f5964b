"""Hugging Face's formats in and out of gpt/: a folder that transformers' GPT2LMHeadModel, LlamaForCausalLM,
Qwen3ForCausalLM or (a mixture of experts) Qwen3MoeForCausalLM loads with from_pretrained (out), and train.py
--init_from's reading of one (in).

    python gpt/hf.py export model.pt hf/              # a train.py --export file
    python gpt/hf.py export out/step_00005000 hf/     # a checkpoint folder, of any layout (read in one process)
    python gpt/hf.py export out hf/                   # OUT_DIR: its newest checkpoint
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf')"

It writes config.json and model.safetensors. The weights are the same numbers in other places: GPT-2 keeps q, k
and v in one projection (c_attn, q's rows first) and its Conv1D stores a weight as (in, out), a Linear's
transposed; the head stays tied to the embedding (one matrix, saved once). The Llama family (hf.py's LLAMA table) is
one name for one name: Linear for Linear, and the rotary layout is transformers' (rotate-half) in both, so
nothing is permuted; a model with QK-norm is a Qwen3, one without a Llama. A vocabulary padded for speed (50304
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
from dataclasses import asdict, fields

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


# The Llama family's names in transformers (LlamaForCausalLM, Qwen3ForCausalLM): gpt/'s per block, and the rest.
LLAMA = {"ln_1": "input_layernorm", "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
         "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm",
         "attn.k_norm": "self_attn.k_norm", "ln_2": "post_attention_layernorm", "mlp.gate": "mlp.gate_proj",
         "mlp.fc": "mlp.up_proj", "mlp.proj": "mlp.down_proj"}


# A mixture of experts' (Qwen3MoeForCausalLM's, as its folders hold them: one Linear per expert, which transformers
# 5 stacks on loading): the router, and expert e's rows of each projection.
EXPERTS = {"router": "gate", "experts.gate": "experts.{e}.gate_proj", "experts.fc": "experts.{e}.up_proj",
           "experts.proj": "experts.{e}.down_proj"}


def llama_names(config: GPTConfig) -> dict[str, tuple[str, int | None]]:
    """{transformers' name: (gpt/'s name, None; or, for an expert's weight, the expert's row in gpt/'s)} of every
    weight of a Llama-family model (a tied head left out: it is wte)."""
    names = {"model.embed_tokens.weight": ("wte.weight", None), "model.norm.weight": ("ln_f.weight", None)}
    if not config.tie_head:
        names["lm_head.weight"] = ("lm_head.weight", None)
    for i in range(config.n_layer):
        moe = config.n_expert and i >= config.first_dense
        names.update({f"model.layers.{i}.{theirs}.weight": (f"blocks.{i}.{ours}.weight", None)
                      for ours, theirs in LLAMA.items()
                      if (config.qk_norm or not ours.endswith("_norm")) and not (moe and ours.startswith("mlp."))})
        for ours, theirs in EXPERTS.items() if moe else ():
            for e in range(config.n_expert) if "{e}" in theirs else [None]:
                names[f"model.layers.{i}.mlp.{theirs.format(e=e)}.weight"] = (
                    f"blocks.{i}.mlp.{ours}" + (".weight" if e is None else ""), e)
    return names


def to_hf(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """gpt/model.py's state_dict in GPT2LMHeadModel's, LlamaForCausalLM's, Qwen3ForCausalLM's or Qwen3MoeForCausalLM's
    names and shapes (a tied head left out: it is wte; DeepSeek's expert biases too, which Qwen3-MoE lacks)."""
    if config.family == "llama":
        return {theirs: (state[ours] if e is None else state[ours][e]).contiguous()
                for theirs, (ours, e) in llama_names(config).items()}
    hf = {f"transformer.{theirs}": state[ours].t() if transposed else state[ours]
          for ours, theirs, transposed in pairs(config.n_layer)}
    for i in range(config.n_layer):
        qkv = [f"blocks.{i}.attn.{p}" for p in "qkv"]
        hf[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).t()
        hf[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[f"{n}.bias"] for n in qkv])
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def read_config(folder: str) -> dict:
    """The folder's config.json, or a ValueError (one line)."""
    try:
        with open(os.path.join(folder, "config.json")) as file:
            theirs = json.load(file)
        if not isinstance(theirs, dict):
            raise ValueError
        return theirs
    except OSError as error:
        raise ValueError(f"--init_from {folder}: {error.strerror or error}: not a Hugging Face model folder") from None
    except ValueError:
        raise ValueError(f"--init_from {folder}: its config.json is not a JSON object") from None


def shape(folder: str) -> dict:
    """GPTConfig's fields (all but vocab_size and seq_len, which are the run's) of the model in a Hugging Face folder,
    from its config.json: GPT-2, Llama or Qwen3, whatever its size; what gpt/ does not hold (another activation, a
    bias, another rope type, sliding-window attention) is a ValueError, one line, naming it."""
    theirs = read_config(folder)
    kind = theirs.get("model_type")
    if kind not in ("gpt2", "llama", "qwen3", "qwen3_moe"):
        raise ValueError(f"--init_from {folder}: a {kind!r} model (config.json): gpt/ reads gpt2, llama, qwen3 and "
                         "qwen3_moe")
    if theirs.get("quantization_config"):
        raise ValueError(f"--init_from {folder}: a quantized model (config.json's quantization_config): gpt/ reads "
                         "float weights")

    def refuse(what: str):
        raise ValueError(f"--init_from {folder}: a {kind} model with {what} (config.json), which gpt/ lacks")

    def get(name: str, kind: type = int, default=KeyError, where: dict | None = None):
        """config.json's `name` (of `where`, a part of it), a positive int, a positive number, or a bool."""
        where = theirs if where is None else where
        if name not in where and default is KeyError:
            raise ValueError(f"--init_from {folder}: its config.json lacks {name}")
        value = where.get(name, default)
        good = isinstance(value, bool) if kind is bool else (isinstance(value, int | float) and not isinstance(
            value, bool) and (kind is float or isinstance(value, int)) and value > 0)
        if not good and not (value is None and default is None):
            raise ValueError(f"--init_from {folder}: its config.json's {name} is {value!r}, not "
                             f"{'true or false' if kind is bool else 'a number' if kind is float else 'an integer'}"
                             f"{'' if kind is bool else ' above 0'}")
        return value

    found = gpt2_or_llama(theirs, kind, refuse, get)
    try:
        GPTConfig(1, 1, **found)  # what the dataclass itself refuses: heads that do not divide, an odd head_dim
    except ValueError as error:
        raise ValueError(f"--init_from {folder}: {error}") from None
    return found


def gpt2_or_llama(theirs: dict, kind: str, refuse, get) -> dict:
    """shape()'s fields from config.json's: `get` reads one, checked; `refuse` says what gpt/ lacks."""
    if kind == "gpt2":
        if theirs.get("activation_function", "gelu_new") != "gelu_new" or not get("tie_word_embeddings", bool, True):
            refuse("another activation or an untied head")
        if theirs.get("n_inner") not in (None, 4 * get("n_embd")):
            refuse(f"n_inner {theirs['n_inner']}")
        for flag, gpt2s in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                            ("reorder_and_upcast_attn", False)):
            if get(flag, bool, gpt2s) != gpt2s:  # attention scaled otherwise than by 1 / sqrt(head_dim)
                refuse(f"{flag} {not gpt2s}")
        return {"n_layer": get("n_layer"), "n_head": get("n_head"), "n_embd": get("n_embd"),
                "norm_eps": get("layer_norm_epsilon", float, 1e-5)}
    rope = theirs.get("rope_parameters") or {**(theirs.get("rope_scaling") or {}), "rope_theta":
                                             theirs.get("rope_theta", 10_000.0)}  # transformers 5's, or before
    if not isinstance(rope, dict):
        refuse(f"rope_parameters {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    for what, bad in (("attention_bias", theirs.get("attention_bias")), ("mlp_bias", theirs.get("mlp_bias")),
                      (f"hidden_act {theirs.get('hidden_act')!r}", theirs.get("hidden_act", "silu") != "silu"),
                      (f"rope_type {rope_type!r}", rope_type not in ("default", "llama3")),
                      ("sliding-window attention", theirs.get("use_sliding_window") or any(
                          layer != "full_attention" for layer in theirs.get("layer_types") or []))):
        if bad:
            refuse(what)
    scaling = tuple(get(name, kind, where=rope) for name, kind in (
        ("factor", float), ("low_freq_factor", float), ("high_freq_factor", float),
        ("original_max_position_embeddings", int))) if rope_type == "llama3" else None
    found = {"family": "llama", "n_layer": get("num_hidden_layers"), "n_head": get("num_attention_heads"),
             "n_embd": get("hidden_size"), "n_kv_head": get("num_key_value_heads", int, None),
             "head_dim": get("head_dim", int, None), "ffn_hidden": get("intermediate_size"),
             "norm_eps": get("rms_norm_eps", float, 1e-6), "rope_theta": float(get("rope_theta", float, where=rope)),
             "rope_llama3": scaling, "qk_norm": kind.startswith("qwen3"),
             "tie_head": get("tie_word_embeddings", bool, False)}
    if kind == "qwen3_moe":  # Qwen3-MoE's router: softmax, top-k, renormalised with norm_topk_prob
        dense = theirs.get("mlp_only_layers") or []
        coef = theirs.get("router_aux_loss_coef") or 0.0
        if not isinstance(dense, list) or isinstance(coef, bool) or not isinstance(coef, int | float) or coef < 0:
            refuse(f"mlp_only_layers {dense!r} and router_aux_loss_coef {coef!r} (a list of blocks, a number "
                   "0 or more)")
        if get("decoder_sparse_step", int, 1) != 1 or dense != list(range(len(dense))):
            refuse(f"dense blocks other than the first (mlp_only_layers {dense}, decoder_sparse_step "
                   f"{theirs.get('decoder_sparse_step')})")
        experts = "num_experts" if "num_experts" in theirs else "num_local_experts"  # transformers 5 saves the latter
        found.update(n_expert=get(experts), top_k=get("num_experts_per_tok"),
                     expert_hidden=get("moe_intermediate_size"), norm_topk=get("norm_topk_prob", bool, False),
                     first_dense=len(dense),
                     aux_loss_coef=float(coef))
    return found


def check(folder: str, config: GPTConfig, model: str | None = None) -> list[str]:
    """The weight files of a Hugging Face folder whose model is `config`, the run's (shape()'s, unless --model
    names another: refused, naming the first field that differs), with a vocabulary as large or smaller (and, for
    GPT-2, as many positions or more), from its config.json alone; else a ValueError, one line."""
    theirs = read_config(folder)
    expected = GPTConfig(config.vocab_size, config.seq_len, **shape(folder))
    for field in fields(GPTConfig):
        if getattr(config, field.name) != getattr(expected, field.name):
            raise ValueError(f"--init_from {folder}: its {field.name} is {getattr(expected, field.name)}, --model "
                             f"{model}'s {getattr(config, field.name)}")
    if config.family == "gpt2" and (theirs.get("n_positions", 0) < config.seq_len
                                    or theirs.get("vocab_size", 0) > config.vocab_size):
        raise ValueError(f"--init_from {folder}: {theirs.get('n_positions')} positions and vocab "
                         f"{theirs.get('vocab_size')}, where the run needs {config.seq_len} positions or more "
                         f"(--seq_len) and a vocab of {config.vocab_size} or less")
    if theirs.get("vocab_size", 0) > config.vocab_size:  # rotary positions: any --seq_len
        raise ValueError(f"--init_from {folder}: its vocab is {theirs.get('vocab_size')}, and the run's "
                         f"{config.vocab_size} (the data's: --vocab_size, for a folder of shards)")
    files = weight_files(folder)
    if files[0].endswith(".safetensors"):  # each file's header (names, shapes), not its tensors
        held = headers(folder, files)
        wanted = llama_names(config) if config.family == "llama" else [
            f"{theirs}" for _, theirs, _ in pairs(config.n_layer)] + [
            f"h.{i}.attn.c_attn.{w}" for i in range(config.n_layer) for w in ("weight", "bias")]
        prefix = "" if config.family == "llama" or any(k.startswith("h.") for k in held) else "transformer."
        lacking = [name for name in wanted if prefix + name not in held]
        if lacking:
            raise ValueError(f"--init_from {folder}: its weights lack {prefix + lacking[0]}")
        if config.family == "llama":  # one name for one name, the same shape (the vocabulary's rows: as many or fewer)
            with torch.device("meta"):
                ours = GPT(config).state_dict()
            for theirs, (mine, e) in llama_names(config).items():
                size = ours[mine].shape if e is None else ours[mine].shape[1:]  # an expert's: its row of gpt/'s
                rows_ok = mine in ("wte.weight", "lm_head.weight") and held[theirs][0] <= size[0]
                if list(held[theirs]) != list(size) and not (rows_ok and list(held[theirs][1:]) == list(size[1:])):
                    raise ValueError(f"--init_from {folder}: {theirs} is {tuple(held[theirs])}, where its config.json "
                                     f"makes it {tuple(size)}")
    return files


def weight_files(folder: str) -> list[str]:
    """The files transformers reads, in its order: model.safetensors, else the shards its index names, else
    pytorch_model.bin; a missing shard or a damaged index is a ValueError, one line."""
    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single) or os.path.isfile(index):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ValueError("--init_from of a safetensors folder needs safetensors: pip install -r "
                             "requirements-hf.txt") from None
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        try:
            with open(index) as file:
                names = sorted(set(json.load(file)["weight_map"].values()))
            files = [os.path.join(folder, name) for name in names]
        except (ValueError, KeyError, TypeError, AttributeError):  # not JSON, no weight_map of file names
            raise ValueError(f"--init_from {folder}: its model.safetensors.index.json is damaged (not JSON with a "
                             "weight_map of file names)") from None
        missing = [name for name, path in zip(names, files, strict=True) if not os.path.isfile(path)]
        if missing or not files:
            raise ValueError(f"--init_from {folder}: its index names {missing[0] if missing else 'no file'}, which "
                             "is not there")
        return files
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
        return [os.path.join(folder, "pytorch_model.bin")]
    raise ValueError(f"--init_from {folder}: neither model.safetensors nor pytorch_model.bin")


def headers(folder: str, files: list[str]) -> dict[str, list[int]]:
    """{name: shape} of the tensors in safetensors files' headers (their data not read); a file that is not one, or
    a tensor that is not of floats (an integer or 8-bit one: quantized): ValueError."""
    from safetensors import safe_open

    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as file:
                for name in file.keys():
                    held = file.get_slice(name)
                    shapes[name], dtype = held.get_shape(), held.get_dtype()
                    if dtype not in ("F32", "F16", "BF16", "F64"):
                        raise ValueError(f"{name} is {dtype}, not floats (quantized?)")
        except Exception as error:  # safetensors' own SafetensorError, OSError; the dtype above
            raise ValueError(f"--init_from {folder}: {os.path.basename(path)} is not a safetensors file of float "
                             f"weights that can be read ({str(error).splitlines()[0][:100]})") from None
    return shapes


def from_hf(folder: str, config: GPTConfig) -> dict[str, torch.Tensor]:
    """A Hugging Face folder's weights (config.json; model.safetensors, its index of shards, or pytorch_model.bin)
    as gpt/model.py's state_dict for `config`, the run's model (see check): GPT-2's first seq_len positions; a
    vocabulary padded with rows that are the mean of the others (transformers' resize_token_embeddings draws new
    rows around that mean), in the embedding and an untied head: each padding id's logit is the mean of the
    others', so they take little of the softmax's mass."""
    weights = {}
    for path in check(folder, config):
        try:
            if path.endswith(".bin"):
                weights.update(torch.load(path, map_location="cpu", weights_only=True))  # tensors only, no code
            else:
                from safetensors.torch import load_file

                weights.update(load_file(path))
        except Exception as error:  # a damaged file: UnpicklingError, EOFError, SafetensorError, RuntimeError
            raise ValueError(f"--init_from {folder}: {os.path.basename(path)} cannot be read ({type(error).__name__}: "
                             f"{(str(error).splitlines() or [''])[0][:100]})") from None
    try:
        if config.family == "llama":
            state, experts = {}, {}
            for theirs, (ours, e) in llama_names(config).items():
                if e is None:
                    state[ours] = weights[theirs]
                else:  # expert e's matrix, a row of gpt/'s
                    experts.setdefault(ours, []).append(weights[theirs])
            state.update({ours: torch.stack(rows) for ours, rows in experts.items()})
        else:
            weights = {name.removeprefix("transformer."): tensor for name, tensor in weights.items()}
            state = {ours: weights[theirs].t() if transposed else weights[theirs]
                     for ours, theirs, transposed in pairs(config.n_layer)}
            for i in range(config.n_layer):
                for proj, weight, bias in zip("qkv", weights[f"h.{i}.attn.c_attn.weight"].t().chunk(3),
                                              weights[f"h.{i}.attn.c_attn.bias"].chunk(3), strict=True):
                    state[f"blocks.{i}.attn.{proj}.weight"], state[f"blocks.{i}.attn.{proj}.bias"] = weight, bias
            state["wpe.weight"] = state["wpe.weight"][:config.seq_len]  # the positions the run uses
    except KeyError as error:
        raise ValueError(f"--init_from {folder}: its weights lack {error.args[0]}") from None
    for name in ("wte.weight", "lm_head.weight"):
        rows = state.get(name)
        if rows is not None and len(rows) < config.vocab_size:
            padding = rows.float().mean(0, keepdim=True).to(rows.dtype).expand(config.vocab_size - len(rows), -1)
            state[name] = torch.cat([rows, padding])
    if config.tie_head:
        state["lm_head.weight"] = state["wte.weight"]
    with torch.device("meta"):
        shapes = {name: tensor.shape for name, tensor in GPT(config).state_dict().items()}
    for name, tensor in state.items():
        if tensor.shape != shapes[name]:
            raise ValueError(f"--init_from {folder}: {name} is {tuple(tensor.shape)}, the model's "
                             f"{tuple(shapes[name])}")
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def hf_config(config: GPTConfig, eot: int | None = None, bos: int | None = None) -> dict:
    """config.json for GPT2LMHeadModel: GPT-2's choices where gpt/model.py makes the same (tanh GELU, LayerNorm's
    eps 1e-5, attention scaled by 1/sqrt(head_dim), tied head); for the Llama family, LlamaForCausalLM's, or
    Qwen3ForCausalLM's with QK-norm. `eot`: the end-of-text id of prepare.py's tokenizer, else GPT-2's where the
    vocab is GPT-2's size or more; `bos`: its begin-of-text id where it has one (Llama 3's), else eot."""
    if config.family == "llama":
        return llama_config(config, eot, eot if bos is None else bos)
    eot = eot if eot is not None else GPT2_VOCAB - 1 if config.vocab_size >= GPT2_VOCAB else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.seq_len, "n_embd": config.n_embd, "n_layer": config.n_layer,
            "n_head": config.n_head, "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": config.dropout, "embd_pdrop": config.dropout, "attn_pdrop": config.dropout,
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot, "dtype": "float32"}


def llama_config(config: GPTConfig, eot: int | None, bos: int | None) -> dict:
    """config.json for LlamaForCausalLM, or Qwen3ForCausalLM where QK-norm is on, in transformers 5's terms
    (rope_parameters). max_position_embeddings: the run's --seq_len, or where Llama 3's scaling reaches (the original
    length × its factor) if more: transformers warns of an original length not below it."""
    kind, c = "qwen3_moe" if config.n_expert else "qwen3" if config.qk_norm else "llama", config
    rope, positions = {"rope_type": "default", "rope_theta": c.rope_theta}, c.seq_len
    if c.rope_llama3 is not None:
        names = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope = {**rope, "rope_type": "llama3", **dict(zip(names, c.rope_llama3, strict=True))}
        positions = max(positions, int(c.rope_llama3[0] * c.rope_llama3[3]))
    moe = {"num_experts": c.n_expert, "num_experts_per_tok": c.top_k, "moe_intermediate_size": c.expert_hidden,
           "norm_topk_prob": c.norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": list(range(c.first_dense)),
           "router_aux_loss_coef": c.aux_loss_coef, "output_router_logits": False} if c.n_expert else {}
    return {"architectures": [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]], "model_type": kind, **moe,
            "vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.ffn_hidden,
            "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head,
            "head_dim": c.head_dim, "hidden_act": "silu", "max_position_embeddings": positions,
            "rms_norm_eps": c.norm_eps, "rope_parameters": rope, "attention_bias": False,
            "attention_dropout": c.dropout,
            **({"mlp_bias": False} if kind == "llama" else {"use_sliding_window": False}),
            "tie_word_embeddings": c.tie_head, "initializer_range": 0.02, "bos_token_id": bos, "eos_token_id": eot,
            "dtype": "float32"}


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
        state["lm_head.weight"] = state["lm_head.weight"][:vocab_size]  # the same rows where tied
        said = f"vocab {vocab_size} (the first {vocab_size} of the model's {config.vocab_size} rows)"
        config = GPTConfig(**{**asdict(config), "vocab_size": vocab_size})
    elif config.vocab_size > GPT2_VOCAB and config.family == "gpt2":
        said += f" (GPT-2's {GPT2_VOCAB} padded: no token's id is {GPT2_VOCAB} or more; --vocab_size {GPT2_VOCAB} cuts)"
    if config.n_expert:  # Qwen3-MoE's router is softmax, top-k, maybe renormalised: nothing more
        lacks = [what for what, bad in (("a sigmoid router", config.router != "softmax"), ("no QK-norm", not
                 config.qk_norm), ("shared experts", config.n_shared_expert), ("a route_scale", config.route_scale
                 != 1), ("DeepSeek's expert biases", config.bias_rate)) if bad]
        if lacks:
            raise ValueError(f"a mixture of experts with {lacks[0]}, which Qwen3MoeForCausalLM lacks")
    ours = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")  # what an export writes
    stale = sorted(name for name in (os.listdir(dest) if os.path.isdir(dest) else []) if name not in ours)
    if stale:  # another model's weights, index, generation settings: transformers would read them with ours
        raise ValueError(f"{dest} holds another model's files ({stale[0]}): give an empty folder, or remove them")
    os.makedirs(dest, exist_ok=True)
    save_file(to_hf(state, config), os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dest, "config.json"), "w") as file:
        json.dump(hf_config(config, tokenizer and tokenizer["eot"], tokenizer and tokenizer.get("bos")), file,
                  indent=2)
    said += tokenizer_files(tokenizer, dest, config.seq_len)
    kind = hf_config(config)["architectures"][0]
    return f"wrote {dest} from {source}: {kind}, {config.n_layer} layers, {said}"


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
    own = tokenizers.Tokenizer.from_str(text)
    eot, bos = own.id_to_token(tokenizer["eot"]), own.id_to_token(tokenizer.get("bos", tokenizer["eot"]))
    with open(os.path.join(dest, "tokenizer.json"), "w", encoding="utf-8") as file:
        file.write(text)
    with open(os.path.join(dest, "tokenizer_config.json"), "w") as file:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": bos,
                   "model_max_length": positions}, file, indent=2)
    begin = f", begin of text {bos!r}" if "bos" in tokenizer else ""
    return f"; tokenizer.json ({os.path.basename(tokenizer['name'])}, end of text {eot!r}{begin})"


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
    out.add_argument("source", help="a train.py --export file, a checkpoint folder (OUT_DIR/step_N), or OUT_DIR (its "
                                    "newest)")
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
