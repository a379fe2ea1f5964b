"""The token stream: where it comes from, and which windows of it each step trains on.

Three sources, each a pair of 1-D arrays of token ids (train, val):
- `synthetic`: a random Markov chain over 64 tokens. Its entropy rate is computed exactly, so a run
  knows the lowest loss any model can reach (the floor) and prints its distance to it.
- `FILE.txt` (any file): its bytes are the tokens (vocab 256), read in place with np.memmap; the
  last tenth is the validation split. There is nothing to prepare and no cache to go stale.
- `DIR`: nanoGPT's train.bin and val.bin (uint16 token ids), read with np.memmap, so data prepared
  for nanoGPT runs here unchanged. GPT-2's vocab (50257) unless --vocab_size says otherwise.

The batch of step s is drawn from (seed, s) alone: the whole global batch is drawn, then split
among ranks and micro-steps. So what is trained does not depend on the world size or on
--grad_accum (only on their product with --batch_size), and a resume will need only the step.
"""
import bisect
import os
from dataclasses import dataclass

import numpy as np
import torch

SYNTHETIC_VOCAB = 64
SYNTHETIC_CONCENTRATION = 0.1  # Dirichlet parameter of each row: smaller is more predictable
SYNTHETIC_SEED = 1234  # fixed: the task is the same whatever --seed the run uses
SYNTHETIC_TOKENS = (1 << 19, 1 << 15)  # train, val
GPT2_VOCAB = 50304  # GPT-2's 50257, rounded up to a multiple of 64 as nanoGPT does: faster matmuls


@dataclass
class Tokens:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int
    floor: float | None  # the lowest expected loss per token (nats), where it is known
    name: str


def markov_chain(vocab_size: int, concentration: float, seed: int) -> tuple[np.ndarray, float]:
    """(transition matrix P, entropy rate in nats): row i of P is the distribution of the token after i."""
    rng = np.random.default_rng(seed)
    transitions = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
    stationary = np.full(vocab_size, 1.0 / vocab_size)
    for _ in range(10_000):  # power iteration: the chain's long-run token frequencies
        stationary, before = stationary @ transitions, stationary
        if np.abs(stationary - before).max() < 1e-15:
            break
    logs = np.log(np.where(transitions > 0, transitions, 1.0))
    return transitions, float(-(stationary[:, None] * transitions * logs).sum())


def sample_chain(transitions: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    cumulative = [list(np.cumsum(row)) for row in transitions]
    last = len(transitions) - 1
    token, out = int(rng.integers(len(transitions))), np.empty(length, dtype=np.uint16)
    for i, u in enumerate(rng.random(length).tolist()):
        token = min(bisect.bisect_right(cumulative[token], u), last)  # min: a cumsum that ends at 0.9999999
        out[i] = token
    return out


def synthetic() -> Tokens:
    transitions, entropy = markov_chain(SYNTHETIC_VOCAB, SYNTHETIC_CONCENTRATION, SYNTHETIC_SEED)
    rng = np.random.default_rng(SYNTHETIC_SEED + 1)
    train, val = (sample_chain(transitions, n, rng) for n in SYNTHETIC_TOKENS)
    return Tokens(train, val, SYNTHETIC_VOCAB, entropy, "synthetic")


def load(spec: str, vocab_size: int | None = None) -> Tokens:
    """`synthetic`, a file of text, or a folder with nanoGPT's train.bin and val.bin."""
    if spec == "synthetic":
        return synthetic()
    if os.path.isdir(spec):
        train, val = (_memmap(os.path.join(spec, f"{split}.bin"), np.uint16) for split in ("train", "val"))
        return Tokens(train, val, vocab_size or GPT2_VOCAB, None, spec)
    text = _memmap(spec, np.uint8)
    cut = len(text) * 9 // 10
    return Tokens(text[:cut], text[cut:], vocab_size or 256, None, spec)


def _memmap(path: str, dtype: type) -> np.ndarray:
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file (give synthetic, a text file, or a folder with "
                         "train.bin and val.bin)")
    if os.path.getsize(path) == 0:
        raise ValueError(f"--data {path}: the file is empty")
    if os.path.getsize(path) % np.dtype(dtype).itemsize:
        raise ValueError(f"--data {path}: {os.path.getsize(path)} bytes is not a whole number of "
                         f"{np.dtype(dtype).name} token ids")
    return np.memmap(path, dtype=dtype, mode="r")


def check(tokens: Tokens, seq_len: int) -> None:
    """One line, before any step, for data that cannot fill a window of seq_len + 1 tokens."""
    for split, array in (("train", tokens.train), ("val", tokens.val)):
        if len(array) < seq_len + 1:
            raise ValueError(f"--data {tokens.name}: the {split} split holds {len(array)} tokens, "
                             f"fewer than --seq_len + 1 = {seq_len + 1}")


def largest_id(array: np.ndarray, rank: int, world_size: int, chunk: int = 1 << 26) -> int:
    """The largest token id in this rank's 1/world_size of the array: the ranks read the file in
    parallel, and one all-reduce (max) finishes the check before any step."""
    share = -(-len(array) // world_size)
    part = array[rank * share:(rank + 1) * share]
    return max((int(part[i:i + chunk].max()) for i in range(0, len(part), chunk)), default=0)


def batch_starts(step: int, seed: int, n_tokens: int, seq_len: int, global_batch: int) -> np.ndarray:
    """Where each sequence of step `step`'s global batch starts: a function of (seed, step) only."""
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, n_tokens - seq_len, size=global_batch)  # each window: seq_len + 1 tokens


def val_starts(n_tokens: int, seq_len: int, max_tokens: int) -> np.ndarray:
    """The validation set: the first non-overlapping windows of the val split, the same every time."""
    count = min((n_tokens - 1) // seq_len, max(1, max_tokens // seq_len))
    return np.arange(count) * seq_len


def windows(array: np.ndarray, starts: np.ndarray, seq_len: int,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(starts), seq_len) int64: targets are the inputs shifted by one."""
    rows = np.stack([np.asarray(array[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    batch = torch.from_numpy(rows)
    if device.type == "cuda":
        batch = batch.pin_memory().to(device, non_blocking=True)  # the copy overlaps the step in flight
    return batch[:, :-1], batch[:, 1:]
