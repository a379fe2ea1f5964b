"""The token stream: where it comes from, and which windows of it each step trains on.

Three sources, each a pair of 1-D arrays of token ids (train, val):
- `synthetic`: a random Markov chain over 64 tokens. Its entropy rate is computed exactly, so a run
  knows the lowest loss any model can reach (the floor) and prints its distance to it.
- `FILE.txt` (any file): its bytes are the tokens (vocab 256), read in place with np.memmap; the
  last tenth is the validation split. There is nothing to prepare and no tokenized copy to go stale.
- `DIR`: its shards, named as nanoGPT (train.bin, val.bin) or llm.c (NAME_train_N.bin, NAME_val_N.bin)
  names them (SHARD; any other .bin file is refused by name), each split's read in name order as one
  stream (a window may span two files), memory-mapped: nothing is loaded whole. Two formats, never mixed:
  - llm.c's shards, which modded-nanogpt reads too (fineweb_train_000001.bin, ...): 256 little-endian
    int32 (magic, version, token count, then zeros), then the tokens. The header says the width:
    magic 20240520 version 1, uint16 (GPT-2's tokenizer); magic 20240801 version 7, uint32 (llm.c's
    Llama 3). A file is taken for one when its first int32 is a magic.
  - raw ids, as nanoGPT's prepare.py writes train.bin and val.bin: uint16, or uint32 with
    --data_dtype uint32. Nothing in the file says its width, and uint32 ids read as uint16 are all
    below 65,536: with a vocab past that (Llama 3's 128,256) no id check can tell. Only the flag says it.
  Refused in one line that names the file, before any step: a file without a magic beside files
  with one (a damaged magic, or a stray file), shards of two widths, an unknown version, a width that
  contradicts --data_dtype, a token count that disagrees with the file's size (a truncated file), a
  size that is not a whole number of ids. GPT-2's vocab (50304) unless --vocab_size, whatever the
  width: uint32 data of a larger vocab is refused by the id check until --vocab_size says it. Shards that
  gpt/prepare.py wrote carry the record of their tokenizer (prepare.json): its vocab, rounded up to a
  multiple of 64, is the default, and the record goes into --export's file and each checkpoint.

Every id must fit the vocab, which takes a read of the whole data: each file's largest id is kept
in OUT_DIR/data_check.json under its real path, inode, size, mtime, ctime and format, so a restart
or resume with that OUT_DIR reads no data, and a file changed since is read again (a write changes
its ctime, which no tool can set back, even where one restores the size and mtime).

The batch of step s is drawn from (seed, s) alone: the whole global batch is drawn, then split
among ranks and micro-steps. So what is trained does not depend on the world size or on
--grad_accum (only on their product with --batch_size), and a resume will need only the step.
"""
import bisect
import functools
import hashlib
import itertools
import json
import os
import re
import resource
from dataclasses import dataclass

import numpy as np
import torch

SYNTHETIC_VOCAB = 64
SYNTHETIC_CONCENTRATION = 0.1  # Dirichlet parameter of each row: smaller is more predictable
SYNTHETIC_SEED = 1234  # fixed: the task is the same whatever --seed the run uses
SYNTHETIC_TOKENS = (1 << 19, 1 << 15)  # train, val
GPT2_VOCAB = 50304  # GPT-2's 50257, rounded up to a multiple of 64 as nanoGPT does: faster matmuls
HEADER_BYTES = 256 * 4  # llm.c's header: 256 little-endian int32
HEADERS = {20240520: (1, np.uint16), 20240801: (7, np.uint32)}  # magic: (version, ids), llm.c's data_common.py
# A shard's name, as nanoGPT's prepare.py and llm.c's scripts write them: train.bin, val.bin;
# fineweb_train_000001.bin, tiny_shakespeare_val.bin. Any other .bin file in the folder is refused by name.
SHARD = re.compile(r"^(?:(.+)_)?(train|val)(?:_(\d+))?\.bin$")  # (NAME, split, N); one NAME a folder
SHARD_NAMES = "train.bin and val.bin, or NAME_train_N.bin and NAME_val_N.bin as llm.c writes"
PREPARED = ("prepare.json", "tokenizer.json")  # gpt/prepare.py's record, and its copy of a Hugging Face tokenizer
CHECKED = "data_check.json"  # in OUT_DIR: each file's largest id, so that a restart reads no data


@dataclass
class TokenFile:
    path: str
    tokens: np.ndarray  # its ids, memory-mapped, after the header if it has one
    format: str  # "llm.c uint16", "raw uint32", "text uint8", ...
    real: str  # its real path: the same file under any name
    key: dict  # its size, mtime and format when loaded: a largest id kept for another key is read again


class Shards:
    """Several 1-D arrays as one, for len() and slices: a slice within one file is a view of it, one
    that spans two is copied from both. Nothing is read until sliced."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        self.arrays = arrays
        self.starts = [0, *itertools.accumulate(len(a) for a in arrays)]  # where each begins in the stream
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("Shards take slices of consecutive ids only")
        i, pieces = bisect.bisect_right(self.starts, start) - 1, []  # i: the file that holds `start`
        while start < stop:
            pieces.append(self.arrays[i][start - self.starts[i]:stop - self.starts[i]])
            start, i = start + len(pieces[-1]), i + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces) if pieces else np.empty(0, self.dtype)


@dataclass
class Tokens:
    train: np.ndarray | Shards  # 1-D token ids
    val: np.ndarray | Shards
    vocab_size: int
    floor: float | None  # the lowest expected loss per token (nats), where it is known
    name: str
    files: list[TokenFile]  # what the id check reads: none for synthetic, whose ids fit by construction
    counts: tuple[int, int] = (0, 0)  # how many files each split reads (train, val)
    tokenizer: dict | None = None  # gpt/prepare.py's record of what made the ids, where it made them

    def summary(self) -> str:
        """What the start line says of the data: its format, files and tokens per split."""
        if not self.files:
            return f"{self.name} (vocab {self.vocab_size})"
        splits = ", ".join(f"{split} {n} file{'s' if n > 1 else ''} {len(a):,} tokens"
                           for split, n, a in zip(("train", "val"), self.counts, (self.train, self.val), strict=True))
        made = f", tokenizer {os.path.basename(self.tokenizer['name'])}" if self.tokenizer else ""
        return f"{self.name} ({self.files[0].format}: {splits}; vocab {self.vocab_size}{made})"


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
    cumulative = [np.cumsum(row).tolist() for row in transitions]  # Python floats: bisect compares them fast
    last = len(transitions) - 1
    token, out = int(rng.integers(len(transitions))), []
    for u in rng.random(length).tolist():
        token = bisect.bisect_right(cumulative[token], u)
        if token > last:  # a cumsum that ends at 0.9999999
            token = last
        out.append(token)
    return np.array(out, dtype=np.uint16)


@functools.cache
def synthetic_stream() -> tuple[np.ndarray, np.ndarray, float]:
    """(train ids, val ids, entropy rate): the same in every run, so drawn once per process, read-only."""
    transitions, entropy = markov_chain(SYNTHETIC_VOCAB, SYNTHETIC_CONCENTRATION, SYNTHETIC_SEED)
    rng = np.random.default_rng(SYNTHETIC_SEED + 1)
    train, val = (sample_chain(transitions, n, rng) for n in SYNTHETIC_TOKENS)
    train.flags.writeable = val.flags.writeable = False
    return train, val, entropy


def synthetic() -> Tokens:
    train, val, entropy = synthetic_stream()
    return Tokens(train, val, SYNTHETIC_VOCAB, entropy, "synthetic", [])


def load(spec: str, vocab_size: int | None = None, dtype: str | None = None) -> Tokens:
    """`synthetic`, a file of text, or a folder of .bin files (nanoGPT's or llm.c's); `dtype`: the
    width of raw .bin ids (default uint16)."""
    if dtype is not None and not os.path.isdir(spec):
        raise ValueError(f"--data_dtype is for a folder of .bin files, not --data {spec}")
    if spec == "synthetic":
        return synthetic()
    if os.path.isdir(spec):
        return _folder(spec, vocab_size, dtype)
    text = _token_file(spec, "uint8", text=True)
    if len(text.tokens) >= 4 and int.from_bytes(bytes(text.tokens[:4]), "little", signed=True) in HEADERS:
        raise ValueError(f"--data {spec}: one of llm.c's shards, not text: give the folder that holds it")
    cut = len(text.tokens) * 9 // 10
    return Tokens(text.tokens[:cut], text.tokens[cut:], vocab_size or 256, None, spec, [text], (1, 1))


def shard_order(name: str) -> tuple:
    """By name, and a shard's N as a number: train_2.bin before train_10.bin (llm.c's N, zero-padded, sort alike)."""
    match = SHARD.match(name)
    return (name, 0) if not match or match[3] is None else (name[:match.start(3)], int(match[3]))


def _folder(folder: str, vocab_size: int | None, dtype: str | None) -> Tokens:
    tokenizer = tokenizer_of(folder)  # prepare.py's shards: its vocab, rounded up to a multiple of 64 as GPT2_VOCAB
    found, names = {"train": [], "val": []}, set()
    for name in sorted(os.listdir(folder), key=shard_order):  # each split's files are one stream in this order
        if not name.lower().endswith(".bin"):
            continue  # nanoGPT's meta.pkl, a README, ...
        match = SHARD.match(name)
        if not match:  # train_old.bin, A_TRAIN.bin: never trained on in silence
            raise ValueError(f"--data {os.path.join(folder, name)}: not a shard's name ({SHARD_NAMES}): "
                             "rename it, or move it out of the folder")
        found[match[2]].append(os.path.join(folder, name))
        names.add(match[1] or "")
    if len(names) > 1:  # old_train.bin beside train.bin, edu_fineweb_ beside fineweb_: two streams as one
        raise ValueError(f"--data {folder}: shards of {len(names)} data sets ("
                         f"{', '.join(repr(n + '_' if n else '') for n in sorted(names))}): one a folder")
    for split, paths in found.items():
        if not paths:
            raise ValueError(f"--data {folder}: no {split} shard in it ({SHARD_NAMES}; or give synthetic, or a "
                             "text file)")
    _enough_descriptors(folder, len(found["train"]) + len(found["val"]))
    files = {split: [_token_file(path, dtype) for path in paths] for split, paths in found.items()}
    every = files["train"] + files["val"]
    for i, f in enumerate(every):
        twin = next((g for g in every[:i] if g.real == f.real), None)
        if twin:  # a link, e.g. val.bin -> train.bin: it would validate on the training tokens, or train twice
            raise ValueError(f"--data {f.path}: the same file as {twin.path}")
    headed = [f for f in every if f.format.startswith("llm.c")]
    for f in every:
        # A damaged magic is read as raw ids: among shards with a header, it is refused, not trained on.
        if headed and not f.format.startswith("llm.c"):
            raise ValueError(f"--data {f.path}: no llm.c header (magic {' or '.join(map(str, HEADERS))}) where "
                             f"{headed[0].path} has one: a folder's .bin files all have one, or none")
        if f.format != every[0].format:
            raise ValueError(f"--data {f.path}: {f.format} ids where {every[0].path} holds {every[0].format}: "
                             "a folder's .bin files hold ids of one width")
    train, val = (split[0].tokens if len(split) == 1 else Shards([f.tokens for f in split]) for split in files.values())
    counts = (len(files["train"]), len(files["val"]))
    default = -(-tokenizer["vocab_size"] // 64) * 64 if tokenizer else GPT2_VOCAB
    return Tokens(train, val, vocab_size or default, None, folder, every, counts, tokenizer)


def tokenizer_of(folder: str) -> dict | None:
    """gpt/prepare.py's record of the tokenizer that made a folder's shards (with its tokenizer.json's text), or
    None where prepare.py did not make them. ValueError where it has not finished them, or its record is damaged."""
    path = os.path.join(folder, PREPARED[0])
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as file:
            record = json.load(file)
        done, shards, tokenizer = record["done"], len(record["shards"]), record["tokenizer"]
        if done and tokenizer["kind"] == "tokenizers":
            with open(os.path.join(folder, PREPARED[1]), encoding="utf-8") as file:
                tokenizer["json"] = file.read()
    except (OSError, ValueError, KeyError, TypeError) as error:  # a truncated or foreign record, a lost file
        raise ValueError(f"--data {path}: not a whole record of gpt/prepare.py ({type(error).__name__}): run the "
                         "prepare.py command again, or remove it") from None
    if not done:  # an interrupted prepare.py: its shards so far are part of the data
        raise ValueError(f"--data {folder}: gpt/prepare.py has not finished it ({shards} shards so far): run the "
                         "same prepare.py command again, which finishes it")
    return tokenizer


def _enough_descriptors(folder: str, count: int) -> None:
    """Room for a memory map per file, each of which holds a file descriptor open for the run: a
    folder of 1,000 shards (FineWeb's 100B) would pass the common soft limit of 1,024. Raised up to
    the hard limit, as any process may; past it, one line."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = count + 512  # and the rest: torch, gloo's sockets, DCP's files
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ValueError(f"--data {folder}: {count} files need about {need} open files, above the hard limit "
                         f"of {hard} (ulimit -Hn): raise it, or join the shards into fewer files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _token_file(path: str, dtype: str | None, text: bool = False) -> TokenFile:
    """One file's ids, memory-mapped: after llm.c's header where the file starts with a magic (its
    width from the header), else the whole file as raw ids of `dtype` (default uint16)."""
    if not os.path.isfile(path):
        raise ValueError(f"--data {path}: no such file (give synthetic, a text file, or a folder with "
                         "nanoGPT's train.bin and val.bin or llm.c's shards)")
    stat = os.stat(path)  # before any read: a file changed after it is read again at the next start
    size = stat.st_size
    if size == 0:
        raise ValueError(f"--data {path}: the file is empty")
    with open(path, "rb") as file:
        head = file.read(HEADER_BYTES)
    if not text and int.from_bytes(head[:4], "little", signed=True) in HEADERS:
        tokens, form = _after_header(path, head, size, dtype)
    else:
        name = np.dtype(dtype or "uint16").name
        if size % np.dtype(name).itemsize:
            raise ValueError(f"--data {path}: {size} bytes is not a whole number of {name} token ids")
        tokens, form = np.memmap(path, dtype=name, mode="r"), f"{'text' if text else 'raw'} {name}"
    key = {"size": size, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino,
           "format": form}
    return TokenFile(path, tokens, form, os.path.realpath(path), key)


def _after_header(path: str, head: bytes, size: int, dtype: str | None) -> tuple[np.memmap, str]:
    """(the ids, the format) of a file that starts with llm.c's magic, once its header is found whole
    and agrees with the file's size and with --data_dtype."""
    if len(head) < HEADER_BYTES:
        raise ValueError(f"--data {path}: truncated: {size} bytes, shorter than llm.c's header ({HEADER_BYTES})")
    magic, version, count = np.frombuffer(head, dtype="<i4")[:3].tolist()
    known, ids = HEADERS[magic]
    name = np.dtype(ids).name
    if version != known:
        raise ValueError(f"--data {path}: version {version} of llm.c's header (magic {magic}) is not known; "
                         f"{known} is")
    if dtype is not None and dtype != name:
        raise ValueError(f"--data {path}: its header says {name} ids, not --data_dtype {dtype}")
    expected = HEADER_BYTES + count * np.dtype(ids).itemsize
    if count < 1 or size != expected:
        raise ValueError(f"--data {path}: {'truncated: ' if size < expected else ''}its header says {count} "
                         f"tokens ({expected} bytes with it), the file has {size} bytes")
    return np.memmap(path, dtype=ids, mode="r", offset=HEADER_BYTES, shape=(count,)), f"llm.c {name}"


def fingerprint(tokens: Tokens) -> list[tuple]:
    """Each file's name, size, format and a digest of its first and last 4 KiB (what train.py compares between
    ranks: a host whose copy differs), read without reading the files in full."""
    prints = []
    for f in tokens.files:
        with open(f.path, "rb") as file:
            ends = file.read(4096)
            file.seek(max(0, f.key["size"] - 4096))
            ends += file.read()
        prints.append((os.path.basename(f.path), f.key["size"], f.format, hashlib.sha256(ends).hexdigest()))
    return prints


def difference(mine: list[tuple], first: list[tuple]) -> str:
    """How this rank's files (fingerprint) differ from rank 0's, in words."""
    theirs = {name: rest for name, *rest in first}
    for name, size, form, digest in mine:
        if name not in theirs:
            return f"{name} is there, where rank 0 has no such file"
        if theirs[name][0] != size:
            return f"{name} holds {size:,} bytes, where rank 0's holds {theirs[name][0]:,}"
        if theirs[name][1:] != [form, digest]:
            return f"{name} differs from rank 0's in its first or last 4 KiB"
    missing = sorted(set(theirs) - {name for name, *_ in mine})
    return f"{missing[0]} is missing, where rank 0 has it"


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


def remembered(out_dir: str, files: list[TokenFile]) -> list[int | None]:
    """Each file's largest id as OUT_DIR/data_check.json holds it, or None where it holds none for the
    file as it is now (another size, mtime or format). Reading creates nothing: bad data still leaves
    no OUT_DIR behind."""
    try:
        with open(os.path.join(out_dir, CHECKED)) as file:
            kept = json.load(file)
    except (OSError, ValueError):  # none yet; or OUT_DIR is no folder (checks.out_dir says so)
        kept = {}
    largest = []
    for f in files:
        entry = kept.get(f.real) if isinstance(kept, dict) else None
        n = entry.get("largest") if isinstance(entry, dict) else None
        largest.append(n if isinstance(n, int) and entry == {**f.key, "largest": n} else None)
    return largest


def remember(out_dir: str, files: list[TokenFile], largest: list[int]) -> None:
    """Keep each file's largest id in OUT_DIR/data_check.json, whole or not at all (a torn file would
    only be read as none: the next start reads the data again)."""
    path = os.path.join(out_dir, CHECKED)
    with open(path + ".tmp", "w") as file:
        json.dump({f.real: {**f.key, "largest": n} for f, n in zip(files, largest, strict=True)}, file, indent=1)
    os.replace(path + ".tmp", path)


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
