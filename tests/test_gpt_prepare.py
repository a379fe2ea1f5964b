"""gpt/prepare.py, text to llm.c's shards, with no network: a tokenizer trained here with `tokenizers` (saved as
tokenizer.json), and two tiktoken encodings built from local ranks (tests/tiktoken_ext), one of them with ids
above 65,535. The shards hold exactly each document's ids with its end-of-text token before them, in order across
shards, the same bytes at 1 and 2 workers (tokenizers' and tiktoken's own calls are the reference, not
prepare.py's); an interrupted run finishes with the uninterrupted run's bytes, tokenizing only what was not
written; train.py trains on them with the tokenizer's vocabulary, and sample.py and hf.py turn its ids into text
with the record the shards carry; bad input is one line."""
import fcntl
import json
import os
import sys

import numpy as np
import pytest
import tiktoken
from harness import torchrun_in_process
from launch import REPO
from test_errors import run_main
from test_gpt_sample import import_gpt
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(REPO))
from gpt.data import load  # noqa: E402

prepare = import_gpt("prepare")


@pytest.fixture(autouse=True)
def gpt_on_the_path(monkeypatch):
    """prepare.py's workers (spawned) import it by name, as `python gpt/prepare.py` has it on the path."""
    monkeypatch.syspath_prepend(str(REPO / "gpt"))
SIZES = ("--val_tokens", "3000", "--shard_tokens", "7000")  # a val shard and several train shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(inputs, documents): the docs as a folder of text files (one document each) and the README as JSON
    lines (one document a paragraph), with a line of non-ASCII text; and the documents in the order read."""
    root = tmp_path_factory.mktemp("corpus")
    (root / "pages").mkdir()
    documents = []
    for path in sorted((REPO / "docs").glob("*.md"))[:6]:
        (root / "pages" / path.name).write_text(path.read_text())
    documents += [p.read_text() for p in sorted((root / "pages").iterdir())]
    paragraphs = [p for p in (REPO / "README.md").read_text().split("\n\n") if p.strip()]
    paragraphs += ["naïve café, 東京 ✓", "a text that names <|endoftext|>, which is text here, not a boundary"]
    (root / "readme.jsonl").write_text("".join(json.dumps({"text": p, "id": i}) + "\n" for i, p in
                                               enumerate(paragraphs)))
    return [str(root / "pages"), str(root / "readme.jsonl")], documents + paragraphs


@pytest.fixture(scope="module")
def tokenizer_json(corpus, tmp_path_factory) -> str:
    """A byte-level BPE of 400 ids trained on the corpus, <|endoftext|> among them, as a tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus[1], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = str(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")
    tokenizer.save(path)
    return path


def expected_ids(tokenizer: str, documents: list[str]) -> tuple[np.ndarray, int]:
    """(the stream, the end-of-text id) by the tokenizer library's own calls."""
    if tokenizer.endswith(".json"):
        own = Tokenizer.from_file(tokenizer)
        own.encode_special_tokens = True  # its special tokens' text as text: tiktoken's encode_ordinary
        eot, encode = own.token_to_id("<|endoftext|>"), lambda text: own.encode(text, add_special_tokens=False).ids
    else:
        own = tiktoken.get_encoding(tokenizer)
        eot, encode = own.eot_token, own.encode_ordinary
    return np.array([i for d in documents for i in (eot, *encode(d))]), eot


def run(inputs: list[str], tokenizer: str, out_dir, *argv: str) -> tuple[int, str, str]:
    return run_main(prepare, *inputs, "--tokenizer", tokenizer, "--out_dir", str(out_dir), *SIZES, *argv)


def shards(folder) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder)) if name.endswith(".bin")}


@pytest.mark.parametrize("tokenizer", ["tokenizer.json", "test_bytes", "test_wide"])
def test_the_shards_hold_each_documents_ids_after_its_end_of_text_whatever_the_worker_count(
        tokenizer, corpus, tokenizer_json, tmp_path):
    tokenizer = tokenizer_json if tokenizer == "tokenizer.json" else tokenizer
    written = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}" / "docs"
        code, stdout, stderr = run(corpus[0], tokenizer, out, "--workers", str(workers))
        assert code == 0, stderr
        written[workers] = shards(out)
    assert written[1] == written[2]  # the same bytes
    expected, eot = expected_ids(tokenizer, corpus[1])
    wide = tokenizer == "test_wide"
    names = list(written[1])
    assert names == ["docs_train_000001.bin", *[f"docs_train_{i:06d}.bin" for i in range(2, len(names))],
                     "docs_val_000000.bin"] and len(names) >= 4, names
    header = np.frombuffer(written[1]["docs_val_000000.bin"][:12], "<i4").tolist()
    assert header == [20240801, 7, 3000] if wide else [20240520, 1, 3000]
    tokens = load(str(out))  # train.py's reader: the val shard, then the train shards in order
    assert tokens.train.dtype == (np.uint32 if wide else np.uint16)
    stream = np.concatenate([tokens.val[:], tokens.train[:]])
    assert np.array_equal(stream, expected)
    assert (stream == eot).sum() == len(corpus[1]) and (eot > 65535) == wide  # one a document: none from its text
    assert tokens.vocab_size == {"test_bytes": 320, "test_wide": 70016}.get(tokenizer, 448)  # rounded up to 64
    assert f"train {len(names) - 1} shards {len(expected) - 3000:,} tokens (llm.c uint{32 if wide else 16}" in stdout


def test_a_corpus_under_the_default_val_split_gives_a_tenth_of_itself_to_val(corpus, tmp_path):
    """No --val_tokens and fewer tokens than its default, 131,072 (refused before: none left to train on): a tenth
    of the stream is the val shard and the rest the train shard, said; the same bytes, and the same recorded
    starts (where a resumed run goes on from), as a run given that tenth."""
    expected, _ = expected_ids("test_bytes", corpus[1])
    tenth = len(expected) // 10
    folders = {name: tmp_path / name / "docs" for name in ("share", "given")}
    for name, argv in (("share", []), ("given", ["--val_tokens", str(tenth)])):
        code, stdout, stderr = run_main(prepare, *corpus[0], "--tokenizer", "test_bytes", "--out_dir",
                                        str(folders[name]), "--workers", "1", *argv)
        assert code == 0, stderr
        said = f"val 1 shard {tenth:,} tokens{' (a tenth of a corpus under 1,310,720 tokens)' * (not argv)}, " \
            f"train 1 shard {len(expected) - tenth:,} tokens"
        assert len(expected) < 131072 and said in stdout, stdout
    tokens = load(str(folders["share"]))
    assert np.array_equal(np.concatenate([tokens.val[:], tokens.train[:]]), expected)
    assert shards(folders["share"]) == shards(folders["given"])
    starts = [[s["next"] for s in json.loads((f / "prepare.json").read_text())["shards"]] for f in folders.values()]
    assert starts[0] == starts[1] and starts[0][0] != [0, 0], starts


def test_the_default_val_split_has_no_step_at_any_size(tmp_path):
    """Around 131,072 tokens (a cliff before: exactly that many refused, one more gave one train token) a tenth is
    val's; from ten times that on, val holds 131,072, and the bytes are --val_tokens 131072's."""
    text = " ".join(f"w{i % 997}" for i in range(26_900))  # about 131,500 test_bytes tokens
    for name, copies, argv in (("small", 1, []), ("large", 11, []), ("given", 11, ["--val_tokens", "131072"])):
        (tmp_path / f"{name}.txt").write_text("\n".join([text] * copies))
        code, stdout, stderr = run_main(prepare, str(tmp_path / f"{name}.txt"), "--tokenizer", "test_bytes",
                                        "--out_dir", str(tmp_path / name / "docs"), "--workers", "1", *argv)
        assert code == 0, stderr
        tokens = load(str(tmp_path / name / "docs"))
        count = len(tokens.val) + len(tokens.train)
        assert len(tokens.val) == (count // 10 if name == "small" else 131072), (name, count, len(tokens.val))
        assert 130_000 < count < 140_000 if name == "small" else count > 10 * 131072
    assert shards(tmp_path / "large" / "docs") == shards(tmp_path / "given" / "docs")


def test_an_interrupted_run_finishes_with_the_same_bytes_tokenizing_only_what_was_not_written(
        corpus, tmp_path, monkeypatch):
    """Interrupted as its third shard is written (a .tmp left behind), the same command finishes the folder: the
    uninterrupted run's bytes, and the documents before the recorded start of the third shard never tokenized
    again. Then it does nothing; another command on the folder is refused."""
    whole = tmp_path / "whole" / "docs"
    assert run(corpus[0], "test_bytes", whole, "--workers", "1")[0] == 0
    out = tmp_path / "cut" / "docs"
    write = prepare.write_shard

    def interrupted(path, ids, dtype):
        if path.endswith("_000002.bin"):
            open(path + ".tmp", "wb").close()
            raise KeyboardInterrupt
        write(path, ids, dtype)
    monkeypatch.setattr(prepare, "write_shard", interrupted)
    code, _, stderr = run(corpus[0], "test_bytes", out, "--workers", "1")  # Ctrl-C, or SIGTERM: the same
    assert code == 130 and stderr == f"interrupted: {out}'s whole shards are kept, and the same command finishes it\n"
    record = json.loads((out / "prepare.json").read_text())
    assert [s["name"] for s in record["shards"]] == ["docs_val_000000.bin", "docs_train_000001.bin"]
    assert not record["done"]
    with pytest.raises(ValueError, match="has not finished it"):  # train.py's data.load: one line before any step
        load(str(out))
    first, skip = record["shards"][-1]["next"]
    assert first > 0
    tokenized, tokenize = [], prepare.tokenize
    monkeypatch.setattr(prepare, "write_shard", write)
    monkeypatch.setattr(prepare, "tokenize", lambda batch: tokenized.extend(i for i, _ in batch) or tokenize(batch))
    code, stdout, stderr = run(corpus[0], "test_bytes", out, "--workers", "1")
    assert code == 0, stderr
    assert tokenized == list(range(first, len(corpus[1])))
    assert shards(out) == shards(whole) and not (out / "docs_train_000002.bin.tmp").exists()
    again = run(corpus[0], "test_bytes", out)[1]
    assert again == f"{out}: prepared already ({len(shards(whole))} shards): nothing to do\n"
    code, _, stderr = run(corpus[0], "test_wide", out)
    assert code == 1 and stderr == f"error: --out_dir {out}: prepared by another command (another --tokenizer): " \
        "give another --out_dir, or remove this one\n"


def test_train_py_trains_on_them_and_sample_and_hf_read_their_tokenizer(corpus, tokenizer_json, tmp_path):
    """train.py's vocabulary is the tokenizer's (400, rounded up to 448), its start line names it; the --export
    file carries the record: sample.py's text is the prompt and then the tokenizer's decoding of the drawn ids;
    hf.py writes the tokenizer beside the weights, which transformers' AutoTokenizer reads into the same ids."""
    out = tmp_path / "docs"
    assert run(corpus[0], tokenizer_json, out, "--workers", "2")[0] == 0
    result = torchrun_in_process(1, "gpt/train.py", "--data", str(out), "--max_steps", "20", "--eval_every", "20",
                                 "--out_dir", "run", "--export", "model.pt", cwd=tmp_path, timeout=120)
    assert result.codes == [0], result.stderr
    assert "vocab 448, tokenizer tokenizer.json) |" in result.stdouts[0]
    losses = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1]["val_loss"] < 0.9 * np.log(400), losses[-1]  # well below uniform over its ids
    code, text, stderr = run_main(import_gpt("sample"), str(tmp_path / "model.pt"), "--prompt", "The naïve model",
                                  "--length", "30", "--seed", "1")
    own = Tokenizer.from_file(tokenizer_json)
    assert code == 0 and text.startswith("The naïve model") and len(own.encode(text).ids) > 20, stderr
    from transformers import AutoTokenizer
    code, said, stderr = run_main(import_gpt("hf"), "export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert code == 0 and "tokenizer.json (tokenizer.json, end of text '<|endoftext|>')" in said, stderr
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs(corpus[1][-1])["input_ids"] == own.encode(corpus[1][-1]).ids and theirs.eos_token == "<|endoftext|>"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == own.token_to_id("<|endoftext|>") and theirs.model_max_length == 64


def test_a_tokenizer_trained_on_the_corpus_is_carried_by_the_shards_train_sample_and_hf(corpus, tokenizer_json,
                                                                                       tmp_path):
    """--train_tokenizer 400, with no network: the folder's tokenizer.json is the BPE that tokenizers' own calls
    train on the same documents (the tokenizer_json fixture's recipe), and the shards are those of --tokenizer that
    file, byte for byte; train.py trains on them and exports, and the tokenizer that transformers reads from hf.py's
    folder encodes the corpus to the shards' ids."""
    own, given = tmp_path / "own" / "docs", tmp_path / "given" / "docs"
    code, said, stderr = run_main(prepare, *corpus[0], "--train_tokenizer", "400", "--out_dir", str(own), *SIZES)
    assert code == 0 and "tokenizer --train_tokenizer 400, vocab 400" in said, stderr
    assert run(corpus[0], tokenizer_json, given)[0] == 0
    trained = Tokenizer.from_file(str(own / "tokenizer.json"))
    assert trained.to_str() == Tokenizer.from_file(tokenizer_json).to_str() and shards(own) == shards(given)
    result = torchrun_in_process(1, "gpt/train.py", "--data", str(own), "--max_steps", "2", "--val_tokens", "256",
                                 "--out_dir", "run", "--export", "model.pt", cwd=tmp_path, timeout=120)
    assert result.codes == [0], result.stderr
    code, text, stderr = run_main(import_gpt("sample"), str(tmp_path / "model.pt"), "--prompt", "The model",
                                  "--length", "10")
    assert code == 0 and text.startswith("The model"), stderr
    code, said, stderr = run_main(import_gpt("hf"), "export", str(tmp_path / "run"), str(tmp_path / "hf"))
    assert code == 0, stderr
    from transformers import AutoTokenizer
    theirs, tokens = AutoTokenizer.from_pretrained(tmp_path / "hf"), load(str(own))
    eot = theirs.convert_tokens_to_ids("<|endoftext|>")
    encoded = [i for document in corpus[1] for i in (eot, *theirs(document, add_special_tokens=False,
                                                                  split_special_tokens=True)["input_ids"])]  # its text
    assert encoded == np.concatenate([tokens.val[:], tokens.train[:]]).tolist()  # "<|endoftext|>" in a text: text


@pytest.mark.parametrize(("argv", "error"), [
    (["--train_tokenizer", "256"], "--train_tokenizer 256: from 257 ids (the 256 bytes and <|endoftext|>) to "
                                   "1,048,576"),
    (["--train_tokenizer", str(2**32)], f"--train_tokenizer {2**32}: from 257 ids (the 256 bytes and <|endoftext|>) "
                                        "to 1,048,576"),
    (["--train_tokenizer", "300", "--tokenizer", "gpt2"], "argument --tokenizer: not allowed with argument "
                                                          "--train_tokenizer")])
def test_a_tokenizer_to_train_is_refused_in_one_line_where_it_cannot_be(argv, error, corpus, tmp_path):
    code, _, stderr = run_main(prepare, *corpus[0], *argv, "--out_dir", str(tmp_path / "out"))
    assert code == 2 and stderr.splitlines()[-1] == f"prepare.py: error: {error}", stderr
    assert not (tmp_path / "out").exists()


def test_a_tiktoken_encoding_is_written_as_a_tokenizer_json_that_gives_its_ids(corpus, tmp_path):
    """hf.py's folder for shards that a tiktoken encoding made: AutoTokenizer's ids are tiktoken's, its special
    token keeping its id past the gap (test_bytes: ranks up to 270, end of text 300); sample.py's decoding of an id
    in the gap, or past the vocab, is U+FFFD."""
    from transformers import AutoTokenizer
    record = {"kind": "tiktoken", "name": "test_bytes", "eot": 300}
    said = import_gpt("hf").tokenizer_files(record, str(tmp_path), 64)
    assert said == "; tokenizer.json (test_bytes, end of text '<|endoftext|>')"
    theirs, own = AutoTokenizer.from_pretrained(tmp_path), tiktoken.get_encoding("test_bytes")
    text = corpus[1][-1] + "<|endoftext|>" + corpus[1][0]
    assert theirs(text)["input_ids"] == own.encode(text, allowed_special="all") and theirs.eos_token_id == 300
    encode, decode = prepare.codec(record)[:2]
    assert decode([*encode("naïve"), 290, 320, *encode(" café")]) == "naïve\ufffd\ufffd café"


def test_a_data_set_streams_the_same_shards_as_its_files(corpus, tmp_path, monkeypatch):
    """--dataset DIR (a folder of a data set's files, as `hf download --repo-type dataset` leaves it; a hub name
    goes through the same datasets.load_dataset, streamed): the same bytes as the .jsonl given as INPUT. Offline,
    a hub name is one line that says how to download it, and nothing is left."""
    import datasets.config
    import huggingface_hub.constants
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "train.jsonl").write_bytes(open(corpus[0][1], "rb").read())
    for argv, out in ((["--dataset", str(tmp_path / "set")], tmp_path / "a" / "x"),
                      ([corpus[0][1]], tmp_path / "b" / "x")):
        code, _, stderr = run_main(prepare, *argv, "--tokenizer", "test_bytes", "--out_dir", str(out),
                                   "--val_tokens", "1000", "--shard_tokens", "3000", "--workers", "1")
        assert code == 0, stderr
    assert shards(tmp_path / "a" / "x") == shards(tmp_path / "b" / "x") and len(shards(tmp_path / "a" / "x")) > 2
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # both read it at their import
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    code, _, stderr = run_main(prepare, "--dataset", "someone/nothing", "--tokenizer", "test_bytes", "--out_dir",
                               str(tmp_path / "c"))
    assert code == 1 and stderr.startswith("error: --dataset someone/nothing: could not be read (") and \
        stderr.endswith("offline, download it first (hf download --repo-type dataset NAME --local-dir DIR) and give "
                        "--dataset DIR\n") and not (tmp_path / "c").exists(), stderr


@pytest.mark.parametrize(("case", "error"), [
    ("offline tiktoken", "--tokenizer cl100k_base: tiktoken downloads its table on first use, which failed here: "
                         "run once where the network is reachable, give a tokenizer.json, or train one on the "
                         "inputs: --train_tokenizer VOCAB"),
    ("offline hub", "--tokenizer someone/tokenizer: neither a file, nor a tiktoken encoding, nor a tokenizer on the "
                    "hub that could be had ("),
    ("no end of text", "no end-of-text token named '<|eot|>': name its own with --eot"),
    ("not text", "not UTF-8 text (byte 0): give text files"),
    ("bad line", "readme.jsonl:1: not a JSON object with a string field 'body' (--text_field)"),
    ("foreign shards", "holds .bin files that prepare.py did not write (no prepare.json)"),
    ("too little", "tokens in all, none left to train on after --val_tokens 10,000,000: give fewer"),
    ("no text", "0 tokens in all, none left to train on after --val_tokens 131,072: no text in it"),
    ("no text file", "no .txt, .md, .jsonl file in it"),
    ("inputs changed", "prepared by another command (the inputs (or their sizes or times) differ): give another "
                       "--out_dir, or remove this one"),
    ("locked", "another prepare.py is writing it: wait for it, or give another --out_dir"),
    ("damaged record", "its prepare.json is damaged (Expecting value: line 1 column 1 (char 0)): remove the folder"),
])
def test_bad_input_is_one_line(case, error, corpus, tmp_path, monkeypatch):
    inputs, tokenizer, argv, env = corpus[0], "test_bytes", [], {}
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at its import: no wait on a DNS
    if case == "offline tiktoken":
        tokenizer, env = "cl100k_base", {"TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9"}
    elif case == "offline hub":
        tokenizer, env = "someone/tokenizer", {"HF_HUB_OFFLINE": "1"}
    elif case == "no end of text":
        argv = ["--eot", "<|eot|>"]
    elif case == "not text":
        (tmp_path / "model.bin.txt").write_bytes(b"\xff\xfe\x00")
        inputs = [str(tmp_path / "model.bin.txt")]
    elif case == "bad line":
        inputs, argv = [corpus[0][1]], ["--text_field", "body"]
    elif case == "foreign shards":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "train.bin").write_bytes(b"\0\0")
    elif case in ("no text", "no text file"):
        (tmp_path / "in").mkdir()
        (tmp_path / "in" / ("empty.jsonl" if case == "no text" else "picture.png")).write_bytes(b"")
        inputs = [str(tmp_path / "in")]
    elif case in ("inputs changed", "locked", "damaged record"):
        inputs, argv = [str(tmp_path / "page.md")], ["--val_tokens", "100"]
        (tmp_path / "page.md").write_text(corpus[1][0])
        assert run_main(prepare, *inputs, "--tokenizer", tokenizer, "--out_dir", str(tmp_path / "out"), *argv)[0] == 0
        if case == "inputs changed":
            (tmp_path / "page.md").write_text(corpus[1][0] + "\nmore")
        elif case == "locked":
            held = open(tmp_path / "out" / "prepare.lock", "w")  # noqa: SIM115
            fcntl.flock(held, fcntl.LOCK_EX)
        else:
            (tmp_path / "out" / "prepare.json").write_text("")
            with pytest.raises(ValueError, match="prepare.json: not a whole record of gpt/prepare.py"):
                load(str(tmp_path / "out"))  # train.py's reader: one line, not a run without the record
    code, _, stderr = run_main(prepare, *inputs, "--tokenizer", tokenizer, "--out_dir", str(tmp_path / "out"), *argv,
                               *(["--val_tokens", "10000000"] if case == "too little" else []), env=env)
    assert code == 1 and stderr.startswith("error: ") and error in stderr and stderr.count("\n") == 1, stderr
    if case not in ("foreign shards", "inputs changed", "locked", "damaged record"):
        assert not (tmp_path / "out").exists()  # refused before it is made, or removed with what it held


@pytest.fixture(scope="module")
def llama3_tokenizer(corpus, tmp_path_factory) -> str:
    """A tokenizer.json laid out as Llama 3's: a byte-level BPE (400 ids trained on the corpus), reserved special
    tokens up to id 128000, then <|begin_of_text|> (128000) and <|end_of_text|> (128001)."""
    from tokenizers import AddedToken
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus[1], trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens([AddedToken(f"<|reserved_special_token_{i}|>", special=True)
                                  for i in range(tokenizer.get_vocab_size(with_added_tokens=True), 128000)])
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in ("<|begin_of_text|>", "<|end_of_text|>")])
    path = str(tmp_path_factory.mktemp("llama3") / "tokenizer.json")
    tokenizer.save(path)
    return path


def test_a_llama_3_tokenizer_puts_each_document_between_its_begin_and_end_and_transformers_generates_from_it(
        corpus, llama3_tokenizer, tmp_path):
    """Llama 3's layout: ids past 65,535 (uint32 shards), each document as <|begin_of_text|> ids <|end_of_text|>
    (the tokenizer library's own ids between them); llama-tiny trained on them, exported by hf.py with the
    tokenizer; transformers' AutoTokenizer and LlamaForCausalLM read the folder (its begin and end of text named)
    and greedy generation gives the tokens gpt/'s own model picks, one argmax at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = tmp_path / "docs"
    code, said, stderr = run(corpus[0], llama3_tokenizer, out, "--workers", "1")
    assert code == 0 and "(llm.c uint32, tokenizer" in said, stderr
    own = Tokenizer.from_file(llama3_tokenizer)
    own.encode_special_tokens = True
    bos, eot = own.token_to_id("<|begin_of_text|>"), own.token_to_id("<|end_of_text|>")
    expected = [i for d in corpus[1] for i in (bos, *own.encode(d, add_special_tokens=False).ids, eot)]
    tokens = load(str(out))
    assert np.array_equal(np.concatenate([tokens.val[:], tokens.train[:]]), expected)
    assert tokens.train.dtype == np.uint32 and tokens.vocab_size == 128064  # 128002 rounded up to 64
    result = torchrun_in_process(1, "gpt/train.py", "--data", str(out), "--model", "llama-tiny", "--max_steps", "4",
                                 "--eval_every", "4", "--val_tokens", "512", "--seq_len", "32", "--out_dir", "run",
                                 "--export", "model.pt", cwd=tmp_path, timeout=120)
    assert result.codes == [0], result.stderr
    code, said, stderr = run_main(import_gpt("hf"), "export", str(tmp_path / "model.pt"), str(tmp_path / "hf"))
    assert code == 0 and "LlamaForCausalLM" in said and "begin of text '<|begin_of_text|>'" in said, stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eot)
    theirs_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (theirs_tokenizer.bos_token, theirs_tokenizer.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    prompt = [bos, *theirs_tokenizer("The model", add_special_tokens=False)["input_ids"]]
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    generated = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
    ours, ids = import_gpt("model").GPT.load(str(tmp_path / "model.pt")).eval(), list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(ours(torch.tensor([ids]))[0, -1].argmax()))
    assert generated == ids
