"""Text to the shards gpt/train.py reads, in one command.

    python gpt/prepare.py INPUT... --tokenizer gpt2 --out_dir data/mine
    python gpt/train.py --data data/mine ...

INPUT: text files, folders (their .txt, .md and .jsonl files, in name order) and JSON lines (.jsonl: one document a
line, its --text_field), or --dataset: a Hugging Face data set, a hub name or a folder of its files, streamed in
order. A text file is one document. Each document is tokenized with an end-of-text token before it (GPT-2's and
Qwen3's way); with a tokenizer that has a begin-of-text token (Llama 3's <|begin_of_text|>), between that token and
the end-of-text one (<|end_of_text|>), as torchtitan's Llama 3 data are. Then the stream is cut into llm.c's shards,
as its fineweb.py cuts them: NAME_val_000000.bin holds the first --val_tokens tokens (131,072, or a tenth of a
corpus under 1,310,720), NAME_train_000001.bin and on the rest, --shard_tokens each (the last shorter); NAME is
--out_dir's last part. Their header (gpt/data.py reads both): magic 20240520 version 1 and uint16 ids where every
id of the tokenizer fits (a vocabulary of at most 65,536), else magic 20240801 version 7 and uint32.

--tokenizer: a tiktoken encoding by name (gpt2, cl100k_base, o200k_base, or one a tiktoken_ext plugin adds), or
a Hugging Face tokenizer.json (a file, or a hub name such as openai-community/gpt2, which needs the network); or
--train_tokenizer VOCAB: a byte-level BPE of VOCAB ids trained on the inputs, with no network.
DIR/prepare.json records it (and DIR/tokenizer.json, a copy of the file): train.py takes its vocabulary from it
and puts it into --export's file, where sample.py reads it to turn text into ids and back, and hf.py writes it
beside the weights.

--workers processes tokenize (default: every core) and one writes, in document order: the shards are the same
bytes whatever the count. A shard is written whole (a .tmp file, renamed) and then recorded, with where the next
one starts (a document, and a token in it): the same command again skips the whole shards and finishes the rest,
or over a finished folder does nothing; another command on the folder is refused.
"""
import argparse
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context

import numpy as np

HEADER = {np.uint16: (20240520, 1), np.uint32: (20240801, 7)}  # llm.c's magic and version (gpt/data.py's)
RECORD, TOKENIZER_FILE = "prepare.json", "tokenizer.json"  # read by gpt/data.py's tokenizer_of
LOCK = "prepare.lock"  # held by the one prepare.py that writes the folder
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")  # GPT-2 and OpenAI's, Llama 3, Llama 2, Gemma
BOS_NAMES = ("<|begin_of_text|>",)  # Llama 3's: each document then begins with it and ends with the end of text
INSTALL = "pip install -r requirements-hf.txt"
TEXT = (".txt", ".md", ".jsonl")  # what a folder's files are read
VAL_TOKENS = 131072  # the val shard's, by default; a corpus under ten times these many gives a tenth of itself


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="*", metavar="INPUT", help="text files, folders, .jsonl files")
    p.add_argument("--dataset", help="a Hugging Face data set (a hub name, or a folder of its files), in place of "
                   "INPUT: its --dataset_split's --text_field, streamed in order (requirements-hf.txt)")
    p.add_argument("--dataset_config", help="the data set's configuration (a subset), if it has several")
    p.add_argument("--dataset_split", default="train", help="its split (default: train)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", help="a tiktoken encoding's name, or a tokenizer.json (file or hub)")
    which.add_argument("--train_tokenizer", type=int, metavar="VOCAB", help="instead: train a byte-level BPE of "
                       "VOCAB ids on the inputs (offline; tokenizers), saved as OUT_DIR/tokenizer.json")
    p.add_argument("--out_dir", required=True, help="the folder of shards (train.py's --data)")
    p.add_argument("--text_field", default="text", help="the field of a .jsonl line that holds its text")
    p.add_argument("--eot", help=f"the end-of-text token (default: the first of {', '.join(EOT_NAMES)} it has)")
    p.add_argument("--val_tokens", type=int, help=f"tokens in the val shard (default: {VAL_TOKENS}, or a tenth of a "
                                                  f"corpus under {10 * VAL_TOKENS} tokens)")
    p.add_argument("--shard_tokens", type=int, default=10**8, help="tokens in a train shard (default: 1e8, llm.c's)")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizing processes (default: every core)")
    p.add_argument("--bench", action="store_true", help="print the tokens/s at 1 and --workers workers, and the "
                   "tokenizer's own in one thread, writing nothing to --out_dir")
    args = p.parse_args(argv)
    if bool(args.inputs) == bool(args.dataset):
        p.error("give INPUT files or folders, or --dataset, not both")
    if args.train_tokenizer is not None and not 257 <= args.train_tokenizer <= 1 << 20:
        p.error(f"--train_tokenizer {args.train_tokenizer}: from 257 ids (the 256 bytes and <|endoftext|>) to "
                f"{1 << 20:,}")
    for name in ("val_tokens", "shard_tokens", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def load_tokenizer(spec: str, eot_name: str | None = None) -> dict:
    """The record of a tokenizer: kind, name, vocab_size, eot, bos where it has a begin-of-text token (and json, the
    file's text, for Hugging Face's), from which codec() builds it again in any process. ValueError in one line
    where it cannot be had."""
    if os.path.isfile(spec) or spec.endswith(".json"):
        try:
            with open(spec, encoding="utf-8") as file:
                record = {"kind": "tokenizers", "name": os.path.abspath(spec), "json": file.read()}
        except OSError as error:
            raise ValueError(f"--tokenizer {spec}: {error.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(f"--tokenizer {spec}: not a tokenizer.json (not UTF-8 text)") from None
    else:
        try:
            import tiktoken
        except ImportError:
            raise ValueError(f"--tokenizer {spec}: a tiktoken encoding's name needs tiktoken: {INSTALL}") from None
        try:
            tiktoken.get_encoding(spec)
            record = {"kind": "tiktoken", "name": spec}
        except ValueError:  # not a name tiktoken knows: a name on the hub
            record = {"kind": "tokenizers", "name": spec, "json": _from_hub(spec)}
        except OSError:  # its table is downloaded on first use (requests' errors are OSErrors)
            raise ValueError(f"--tokenizer {spec}: tiktoken downloads its table on first use, which failed here: "
                             "run once where the network is reachable, give a tokenizer.json, or train one on "
                             "the inputs: --train_tokenizer VOCAB") from None
    return completed(record, f"--tokenizer {spec}", eot_name)


def trained_tokenizer(args: argparse.Namespace, inputs: list[str]) -> dict:
    """A byte-level BPE (GPT-2's kind, every byte a token) of --train_tokenizer ids trained by `tokenizers` on the
    documents, <|endoftext|> its special token: no download, as nanochat trains its own. The same documents train
    the same one, so that the same command again finds its folder's tokenizer unchanged."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError(f"--train_tokenizer needs tokenizers: {INSTALL}") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    work = streamed(args) if args.dataset else documents(inputs, args.text_field)
    tokenizer.train_from_iterator((text for _, text in work), trainers.BpeTrainer(
        vocab_size=args.train_tokenizer, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    record = {"kind": "tokenizers", "name": f"--train_tokenizer {args.train_tokenizer}",
              "json": tokenizer.to_str()}
    return completed(record, "--train_tokenizer", args.eot)


def completed(record: dict, spec: str, eot_name: str | None) -> dict:
    """A tokenizer's record with its vocabulary size and its end-of-text and begin-of-text ids."""
    _, _, special, size = codec(record)
    eot = special.get(eot_name) if eot_name else next((special[n] for n in EOT_NAMES if n in special), None)
    if eot is None:
        named = f"named {eot_name!r}" if eot_name else "of " + ", ".join(EOT_NAMES)
        raise ValueError(f"{spec}: no end-of-text token {named}: name its own with --eot")
    bos = next((special[n] for n in BOS_NAMES if n in special), None)
    return {**record, "vocab_size": size, "eot": eot, **({"bos": bos} if bos is not None else {})}


def _from_hub(name: str) -> str:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"--tokenizer {name}: a hub name needs tokenizers: {INSTALL}") from None
    try:
        return Tokenizer.from_pretrained(name).to_str()
    except Exception as error:  # offline, or no such repository: tokenizers raises its own Exception
        raise ValueError(f"--tokenizer {name}: neither a file, nor a tiktoken encoding, nor a tokenizer on the "
                         f"hub that could be had ({str(error).splitlines()[0][:120]}): offline, download its "
                         "tokenizer.json and give the file") from None


def codec(record: dict):
    """(encode: text -> ids, decode: ids -> text, {token: id} of the special tokens, vocabulary size) of a
    record. An id the tokenizer lacks (a padded vocabulary's rows) decodes as U+FFFD."""
    if record["kind"] == "tiktoken":
        import tiktoken
        encoding = tiktoken.get_encoding(record["name"])
        size = encoding.n_vocab

        def piece(i: int) -> bytes:
            try:
                return encoding.decode_single_token_bytes(i)
            except KeyError:  # an id past its vocab (padding), or in a gap before its special tokens
                return "\ufffd".encode()

        def decode(ids: list[int]) -> str:
            return b"".join(map(piece, ids)).decode("utf-8", errors="replace")
        return encoding.encode_ordinary, decode, encoding._special_tokens, size
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(f"a Hugging Face tokenizer needs tokenizers: {INSTALL}") from None
    try:
        tokenizer = Tokenizer.from_str(record["json"])
    except Exception as error:  # its parser's own Exception
        raise ValueError(f"--tokenizer {record['name']}: not a tokenizer.json ({str(error)[:120]})") from None
    tokenizer.encode_special_tokens = True  # "<|endoftext|>" in a text is text, as tiktoken's encode_ordinary has it
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1

    def decode(ids: list[int]) -> str:
        pieces = [[]]  # cut at each id the tokenizer lacks
        for i in ids:
            if i < size:
                pieces[-1].append(i)
            else:
                pieces.append([])
        return "\ufffd".join(tokenizer.decode(piece, skip_special_tokens=False) for piece in pieces)
    special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids, decode, special, size


def streamed(args: argparse.Namespace, start: int = 0):
    """(index, text) of each row of --dataset's split, in order, from `start` on (the ones before it are read
    again, not tokenized: a stream has no other way to them)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset needs the datasets package: {INSTALL}") from None
    try:
        rows = datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split, streaming=True)
        for index, row in enumerate(rows):
            if index >= start:
                text = row.get(args.text_field)
                if not isinstance(text, str):
                    raise ValueError(f"--dataset {args.dataset}: row {index} has no string field "
                                     f"{args.text_field!r} (--text_field)")
                yield index, text
    except ValueError:
        raise
    except Exception as error:  # offline, no such data set or split: datasets' and the hub's own errors
        first = (str(error).splitlines() or [""])[0][:150]
        raise ValueError(f"--dataset {args.dataset}: could not be read ({type(error).__name__}: {first}); offline, "
                         "download it first (hf download --repo-type dataset NAME --local-dir DIR) and give "
                         "--dataset DIR") from None


def documents(inputs: list[str], text_field: str, start: int = 0):
    """(index, text) of each document, in order, from `start` on (the ones before it are not read)."""
    index = 0
    for path in files(inputs):
        if not path.endswith(".jsonl"):
            if index >= start:
                yield index, _read(path)
            index += 1
            continue
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(_utf8(lines, path), 1):
                if not line.strip():
                    continue
                if index >= start:
                    try:
                        text = json.loads(line)[text_field]
                    except (ValueError, KeyError, TypeError):
                        text = None
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{number}: not a JSON object with a string field "
                                         f"{text_field!r} (--text_field)")
                    yield index, text
                index += 1


def _utf8(lines, path: str):
    try:
        yield from lines
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start} of a chunk)") from None


def files(inputs: list[str]) -> list[str]:
    found = []
    for path in inputs:
        if os.path.isdir(path):
            found += sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                            if name.endswith(TEXT))  # not its pictures
        elif os.path.isfile(path):
            found.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}): give text files") from None


_encode = _eot = _bos = None


def _start_worker(record: dict, parent: int | None = None) -> None:
    """A worker's tokenizer. Ctrl-C is the writer's to handle; a worker whose writer died (SIGKILL) exits too."""
    global _encode, _eot, _bos
    _encode, _eot, _bos = codec(record)[0], record["eot"], record.get("bos")
    if parent is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)
        threading.Thread(target=watch, daemon=True).start()


def tokenize(batch: list[tuple[int, str]]) -> list[tuple[int, np.ndarray]]:
    """(index, its ids after an end of text, or between a begin and an end of text) of each document of a batch,
    in a worker."""
    if _bos is not None:
        return [(index, np.array([_bos, *_encode(text), _eot], dtype=np.uint32)) for index, text in batch]
    return [(index, np.array([_eot, *_encode(text)], dtype=np.uint32)) for index, text in batch]


def batches(work, size: int = 1 << 20):
    """Documents in lists of about `size` characters (a longer one alone): what a worker is sent at once."""
    batch, held = [], 0
    for index, text in work:
        batch.append((index, text))
        held += len(text)
        if held >= size:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def tokenized(work, workers: int, tokenizer: dict):
    """(index, ids) of each document, in order: tokenized here (one worker), or by `workers` processes with a
    few batches each in flight, so that memory stays bounded. A worker that dies ends it (BrokenProcessPool)."""
    work = batches(work)
    if workers == 1:
        _start_worker(tokenizer)
        for batch in work:
            yield from tokenize(batch)
        return
    pool = ProcessPoolExecutor(workers, get_context("spawn"), initializer=_start_worker,
                               initargs=(tokenizer, os.getpid()))
    try:
        pending = deque(pool.submit(tokenize, batch) for batch in itertools.islice(work, 3 * workers))
        while pending:
            done = pending.popleft().result()
            pending.extend(pool.submit(tokenize, batch) for batch in itertools.islice(work, 1))
            yield from done
    finally:
        pool.shutdown(cancel_futures=True)


def write_shard(path: str, ids: np.ndarray, dtype) -> None:
    header = np.zeros(256, dtype="<i4")
    header[:3] = (*HEADER[dtype], len(ids))
    with open(path + ".tmp", "wb") as file:
        file.write(header.tobytes())
        file.write(ids.astype(dtype).tobytes())
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)


def prepare(args: argparse.Namespace) -> str:
    """Writes (or finishes) the shards; returns the line that says what was done. Everything that can be refused
    is refused before --out_dir is made; the folder is locked while one prepare.py writes it."""
    started = time.perf_counter()
    out, name = args.out_dir, os.path.basename(os.path.normpath(args.out_dir))
    inputs = files(args.inputs)
    if not inputs and not args.dataset:
        raise ValueError(f"{' '.join(args.inputs)}: no {', '.join(TEXT)} file in it")
    tokenizer = trained_tokenizer(args, inputs) if args.train_tokenizer else load_tokenizer(args.tokenizer, args.eot)
    settings = {"inputs": [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in inputs]
                or [args.dataset, args.dataset_config, args.dataset_split],
                "tokenizer": {k: v for k, v in tokenizer.items() if k != "json"}, "text_field": args.text_field,
                "val_tokens": args.val_tokens or VAL_TOKENS, "shard_tokens": args.shard_tokens}
    if "json" in tokenizer:  # its file's text, not only its path
        settings["tokenizer"]["sha256"] = hashlib.sha256(tokenizer["json"].encode()).hexdigest()
    if os.path.isfile(os.path.join(out, RECORD)):
        _compare(_load(out), settings, out)  # before any write; again under the lock
    elif os.path.isdir(out) and any(n.endswith(".bin") for n in os.listdir(out)):
        raise ValueError(f"--out_dir {out}: holds .bin files that prepare.py did not write (no {RECORD})")
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    lock = open(os.path.join(out, LOCK), "w")  # noqa: SIM115 (held until this process ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"--out_dir {out}: another prepare.py is writing it: wait for it, or give another "
                         "--out_dir") from None
    record = _load(out) if os.path.isfile(os.path.join(out, RECORD)) else {"settings": settings, "shards": [],
                                                                         "done": False}
    _compare(record, settings, out)
    if record["done"]:
        return f"{out}: prepared already ({len(record['shards'])} shards): nothing to do"
    dtype = np.uint16 if tokenizer["vocab_size"] <= 1 << 16 else np.uint32
    record["tokenizer"], record["format"] = settings["tokenizer"], f"llm.c {np.dtype(dtype).name}"
    # The shards already whole: their files as recorded; the rest is written again.
    whole = [s for s in record["shards"] if os.path.isfile(os.path.join(out, s["name"]))
             and os.path.getsize(os.path.join(out, s["name"])) == 1024 + s["tokens"] * np.dtype(dtype).itemsize]
    record["shards"] = whole[:next((i for i, s in enumerate(whole) if s["name"] != _name(name, i)), len(whole))]
    begin, skip = record["shards"][-1]["next"] if record["shards"] else (0, 0)
    shard, total, val = len(record["shards"]), 0, args.val_tokens or VAL_TOKENS
    held, count = [], 0  # (document, its first token's place, its ids) not yet in a shard, in order; their tokens
    # By default the val shard waits for ten times its tokens, so that a smaller corpus gives a tenth of itself to
    # val and the rest to train, with no step at any size.
    share = shard == 0 and args.val_tokens is None

    def cut(size: int, next_start: tuple[int, int]) -> None:
        """The first `size` held tokens as the next shard; next_start: where the stream goes on if none is left."""
        nonlocal shard, count
        if shard == 0 and "json" in tokenizer:
            with open(os.path.join(out, TOKENIZER_FILE), "w", encoding="utf-8") as file:
                file.write(tokenizer["json"])
        taken, left = [], size
        while left:
            index, at, ids = held[0]
            taken.append(ids[:left])
            held[0] = (index, at + len(taken[-1]), ids[len(taken[-1]):])
            left -= len(taken[-1])
            if not len(held[0][2]):
                held.pop(0)
        write_shard(os.path.join(out, _name(name, shard)), np.concatenate(taken), dtype)
        record["shards"].append({"name": _name(name, shard), "tokens": size,
                                 "next": held[0][:2] if held else next_start})
        _save(record, os.path.join(out, RECORD))
        shard, count = shard + 1, count - size

    def undo() -> None:
        """What this run wrote, removed (a failure before any train shard: as if never begun)."""
        for leftover in [s["name"] for s in record["shards"]] + [RECORD, TOKENIZER_FILE, LOCK]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, leftover))
        if made:
            os.rmdir(out)

    done, bar = begin, progress_bar()
    try:
        work = streamed(args, begin) if args.dataset else documents(inputs, args.text_field, begin)
        for index, ids in tokenized(work, args.workers, tokenizer):
            bar.update(len(ids))
            at = skip if index == begin else 0
            if at < len(ids):
                held.append((index, at, ids[at:]))
                count, total = count + len(ids) - at, total + len(ids) - at
            while count >= (10 * VAL_TOKENS if shard == 0 and share else val if shard == 0 else args.shard_tokens):
                cut(val if shard == 0 else args.shard_tokens, (index + 1, 0))
            done = index + 1
    except ValueError:  # a file that is not text, a bad line: where nothing is recorded yet, nothing is left
        if not record["shards"]:
            undo()
        raise
    bar.close()
    share = share and shard == 0 and count > 1  # a corpus under ten times VAL_TOKENS: a tenth is val's
    if share:
        cut(max(1, count // 10), (done, 0))
    while count:
        cut(min(count, val if shard == 0 else args.shard_tokens), (done, 0))
    if len(record["shards"]) < 2:  # no train shard
        count = sum(s["tokens"] for s in record["shards"])
        undo()
        raise ValueError(f"{' '.join(args.inputs) or args.dataset}: {count:,} tokens in all, none left to train "
                         f"on after --val_tokens {args.val_tokens or VAL_TOKENS:,}: "
                         f"{'give fewer' if count else 'no text in it'}")
    record["done"] = True
    _save(record, os.path.join(out, RECORD))
    seconds = time.perf_counter() - started
    train = record["shards"][1:]
    shards = f"{len(train)} shard{'s' if len(train) > 1 else ''}"
    return (f"{out}: val 1 shard {record['shards'][0]['tokens']:,} tokens"
            f"{f' (a tenth of a corpus under {10 * VAL_TOKENS:,} tokens)' if share else ''}, train {shards} "
            f"{sum(s['tokens'] for s in train):,} tokens ({record['format']}, tokenizer {tokenizer['name']}, vocab "
            f"{tokenizer['vocab_size']:,}); {total:,} tokens written in {seconds:.1f} s: {total / seconds:,.0f} "
            f"tokens/s on {args.workers} worker{'s' if args.workers > 1 else ''}")


def _load(out: str) -> dict:
    try:
        with open(os.path.join(out, RECORD)) as file:
            return json.load(file)
    except ValueError as error:
        raise ValueError(f"--out_dir {out}: its {RECORD} is damaged ({error}): remove the folder to start "
                         "again") from None


def _compare(record: dict, settings: dict, out: str) -> None:
    """A folder is finished by the command that began it, on the same files: else one line."""
    theirs = record.get("settings", {})
    if theirs != settings:
        other = next(k for k in settings if theirs.get(k) != settings[k])
        what = "the inputs (or their sizes or times) differ" if other == "inputs" else f"another --{other}"
        raise ValueError(f"--out_dir {out}: prepared by another command ({what}): give another --out_dir, or "
                         "remove this one")


def progress_bar():
    """tqdm's bar of tokens, on a terminal (requirements-hf.txt); without tqdm, nothing."""
    try:
        from tqdm import tqdm
    except ImportError:
        return argparse.Namespace(update=lambda n: None, close=lambda: None)
    return tqdm(unit="tok", unit_scale=True, disable=None, desc="tokenizing")


def bench(args: argparse.Namespace) -> None:
    """--bench: prepare.py's tokens/s at 1 worker and at --workers, beside the tokenizer's own rate in one thread
    on the same documents (no shards written), each into a fresh temporary folder."""
    import tempfile

    tokenizer = trained_tokenizer(args, files(args.inputs)) if args.train_tokenizer else \
        load_tokenizer(args.tokenizer, args.eot)
    rows = streamed(args) if args.dataset else documents(args.inputs, args.text_field)
    encode, texts = codec(tokenizer)[0], [text for _, text in rows]
    started = time.perf_counter()
    count = sum(len(encode(text)) + 1 for text in texts)
    rates = {"the tokenizer alone, 1 thread": count / (time.perf_counter() - started)}
    for workers in sorted({1, args.workers}):
        with tempfile.TemporaryDirectory() as folder:
            started = time.perf_counter()
            prepare(argparse.Namespace(**{**vars(args), "workers": workers, "out_dir": os.path.join(folder, "b")}))
            rates[f"prepare.py, {workers} worker{'s' if workers > 1 else ''}"] = count / (time.perf_counter() - started)
    print(f"{count:,} tokens of {len(texts):,} documents, tokenizer {tokenizer['name']}, {os.cpu_count()} cores")
    for what, rate in rates.items():
        print(f"  {what:<32} {rate:>12,.0f} tokens/s")


def _name(name: str, shard: int) -> str:
    return f"{name}_{'val' if shard == 0 else 'train'}_{shard:06d}.bin"


def _save(record: dict, path: str) -> None:
    with open(path + ".tmp", "w") as file:
        json.dump(record, file, indent=1)
    os.replace(path + ".tmp", path)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C: the workers are stopped, shards kept
    try:
        bench(args) if args.bench else print(prepare(args))
    except ValueError as error:
        sys.exit(f"error: {error}")
    except OSError as error:
        sys.exit(f"error: {error.filename or args.out_dir}: {error.strerror or error}")
    except KeyboardInterrupt:
        print(f"interrupted: {args.out_dir}'s whole shards are kept, and the same command finishes it",
              file=sys.stderr)
        sys.exit(130)
    except BrokenProcessPool:  # a worker killed (the out-of-memory killer: a document too large, many workers)
        sys.exit(f"error: a tokenizing worker died (out of memory? fewer --workers): {args.out_dir}'s whole shards "
                 "are kept, and the same command finishes it")


if __name__ == "__main__":
    main()
