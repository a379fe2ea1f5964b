"""A stand-in for nanoGPT's train.py with its interface (tests/test_vs_nanogpt.py): run from its own folder, it
takes the same --key=value overrides (an unknown key or a wrong type is an error, as nanoGPT's configurator.py
makes it), reads data/<dataset>/train.bin as uint16 ids and meta.pkl's vocab_size, and prints nanoGPT's line
`iter N: loss L, time T ms, mfu M%` for iterations 0 to max_iters, each timing a small matmul. Set
STANDIN_FAIL to make it fail, as a broken checkout would."""
import os
import pickle
import sys
import time
from ast import literal_eval

import numpy as np
import torch

config = dict(dataset="openwebtext", out_dir="out", device="cuda", compile=True, dtype="bfloat16", n_layer=12,
              n_head=12, n_embd=768, block_size=1024, batch_size=12, gradient_accumulation_steps=40, bias=False,
              dropout=0.0, max_iters=600000, eval_interval=2000, eval_iters=200, log_interval=1,
              always_save_checkpoint=True, wandb_log=False)
for arg in sys.argv[1:]:
    key, _, value = arg[2:].partition("=")
    if key not in config:
        raise ValueError(f"Unknown config key: {key}")
    try:
        value = literal_eval(value)
    except (SyntaxError, ValueError):
        pass
    assert type(value) is type(config[key]), f"{key}: {value!r}"
    config[key] = value
if os.environ.get("STANDIN_FAIL"):
    raise SystemExit("a broken checkout")
folder = os.path.join("data", config["dataset"])
ids = np.memmap(os.path.join(folder, "train.bin"), dtype=np.uint16, mode="r")
vocab = 50304
if os.path.exists(os.path.join(folder, "meta.pkl")):
    with open(os.path.join(folder, "meta.pkl"), "rb") as file:
        vocab = pickle.load(file)["vocab_size"]
assert ids.max() < vocab and len(ids) > config["block_size"] + 1, (ids.max(), vocab)
assert config["device"] == "cpu" and config["dtype"] == "float32" and config["n_embd"] % config["n_head"] == 0
weights = torch.randn(config["n_embd"], config["n_embd"])
x = torch.randn(config["batch_size"] * config["block_size"], config["n_embd"])
for step in range(config["max_iters"] + 1):
    started = time.perf_counter()
    for _ in range(config["n_layer"]):
        x = torch.tanh(x @ weights)
    print(f"iter {step}: loss 4.0000, time {(time.perf_counter() - started) * 1000:.2f}ms, mfu -100.00%", flush=True)
