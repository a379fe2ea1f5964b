"""gpt/data.py's token files: llm.c's shards (uint16 or uint32, one file or many) and raw ids train
what the same tokens train in any other format; a damaged file is one line naming it, with nothing
written; the id check reads the data once per OUT_DIR, and again only where a file changed.

The runs go through tests/harness.torchrun_in_process, as tests/test_gpt.py's do."""
import fcntl
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from harness import torchrun_in_process
from launch import REPO
from test_gpt import train

sys.path.insert(0, str(REPO))
from gpt.data import CHECKED, HEADER_BYTES, load  # noqa: E402

TRAIN = "gpt/train.py"
# 6 steps on 1 rank, every loss logged; 32 validation windows, which span the val shards' boundary.
ARGV = ("--max_steps", "6", "--log_every", "1", "--eval_every", "6", "--seq_len", "32", "--val_tokens", "1024",
        "--vocab_size", "512")


def llmc(path: Path, tokens: np.ndarray, magic: int = 20240520, version: int = 1, count: int | None = None,
         dtype: type = np.uint16) -> None:
    """A shard as llm.c's data_common.write_datafile writes it: 256 int32, then the ids."""
    header = np.zeros(HEADER_BYTES // 4, dtype="<i4")
    header[:3] = magic, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + tokens.astype(dtype).tobytes())


def uint32(path: Path, tokens: np.ndarray) -> None:
    llmc(path, tokens, magic=20240801, version=7, dtype=np.uint32)


@pytest.fixture(scope="module")
def stream() -> tuple[np.ndarray, np.ndarray]:
    """(train, val): the README's and docs' bytes, doubled into ids up to 510: wider than a byte."""
    text = b"".join(p.read_bytes() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64) * 2
    cut = len(ids) * 9 // 10
    return ids[:cut], ids[cut:]


def write(folder: Path, form: str, train_ids: np.ndarray, val_ids: np.ndarray) -> list[str]:
    """The tokens in one format; the options it needs."""
    folder.mkdir()
    if form == "raw uint16":  # nanoGPT's
        train_ids.astype(np.uint16).tofile(folder / "train.bin")
        val_ids.astype(np.uint16).tofile(folder / "val.bin")
    elif form == "raw uint32":
        train_ids.astype(np.uint32).tofile(folder / "train.bin")
        val_ids.astype(np.uint32).tofile(folder / "val.bin")
        return ["--data_dtype", "uint32"]
    elif form in ("llm.c uint16", "llm.c uint32"):
        shard = llmc if form == "llm.c uint16" else uint32
        shard(folder / "tiny_train.bin", train_ids)
        shard(folder / "tiny_val.bin", val_ids)
    else:  # shards, written last first: read in name order all the same (numbered 1, 2, 10: as numbers)
        cuts = [len(train_ids) // 3, len(train_ids) * 2 // 3]
        for i, part in reversed(list(enumerate(np.split(train_ids, cuts)))):
            number = f"{i + 1:06d}" if form == "shards" else [1, 2, 10][i]
            llmc(folder / f"fineweb_train_{number}.bin", part)
        for i, part in enumerate(np.split(val_ids, [100])):  # validation window 3 spans the two
            llmc(folder / f"fineweb_val_{i:06d}.bin", part)
    return []


def losses(records: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records]


@pytest.fixture(scope="module")
def nanogpt(stream, tmp_path_factory) -> list[dict]:
    """metrics.jsonl's records of a run on the stream as nanoGPT's raw uint16 train.bin and val.bin."""
    folder = tmp_path_factory.mktemp("nanogpt") / "data"
    write(folder, "raw uint16", *stream)
    return train(1, "--data", str(folder), *ARGV)[0]


@pytest.mark.parametrize("form", ["llm.c uint16", "llm.c uint32", "shards", "shards numbered 1, 2, 10", "raw uint32"])
def test_each_format_trains_exactly_as_the_same_tokens_in_nanogpts(form, stream, nanogpt, tmp_path):
    """The same ids as nanoGPT's train.bin and val.bin, so the same run, bit for bit."""
    folder = tmp_path / "data"
    flag = write(folder, form, *stream)
    loaded = load(str(folder), dtype=flag[1] if flag else None)
    for split, ids in zip((loaded.train, loaded.val), stream, strict=True):
        assert len(split) == len(ids)
        for begin in (0, 80, len(ids) // 3 - 20, len(ids) * 2 // 3 - 1, len(ids) - 40):  # across the shards' cuts
            np.testing.assert_array_equal(split[begin:begin + 40], ids[begin:begin + 40])
    records, _, stdout = train(1, "--data", str(folder), *flag, *ARGV)
    shards = form.startswith("shards")
    files = "train 3 files" if shards else "train 1 file"
    files += f" {len(stream[0]):,} tokens, val {2 if shards else 1} file"
    assert f"data {folder} ({'llm.c uint16' if shards else form}: {files}" in stdout  # the start line
    assert f" {len(stream[1]):,} tokens; vocab 512)" in stdout
    assert len(records) == 7 and losses(records) == losses(nanogpt)


def test_uint32_shards_hold_ids_past_65535(tmp_path):
    """Llama 3's ids need 32 bits: read as uint16 they would wrap and still pass a vocab check."""
    ids = np.arange(70_000, 70_500)
    uint32(tmp_path / "a_train.bin", ids)
    uint32(tmp_path / "a_val.bin", ids[::-1])
    loaded = load(str(tmp_path))
    assert loaded.train.dtype == np.uint32 and loaded.train.max() == 70_499 and loaded.val[0] == 70_499


GOOD = np.arange(3000) % 256


def test_val_tokens_past_the_val_split_evaluates_the_split_and_says_so(tmp_path):
    """--val_tokens is the tokens evaluated (prepare.py's is the val shard's size): asked for more than the val
    split holds, train.py evaluates the split's whole windows and says so, once, at the start."""
    GOOD.astype(np.uint16).tofile(tmp_path / "train.bin")
    GOOD[:100].astype(np.uint16).tofile(tmp_path / "val.bin")  # (100 - 1) // 32: 3 windows
    records, _, stdout = train(1, "--data", str(tmp_path), "--vocab_size", "256", "--max_steps", "2", "--seq_len",
                               "32", "--val_tokens", "1024", "--eval_every", "2")
    assert stdout.count("validation: 96 tokens, what the val split's 100 tokens hold in windows of --seq_len "
                        "(--val_tokens 1,024 asks more)\n") == 1, stdout
    assert records[-1]["step"] == 2 and "val_loss" in records[-1]
    _, _, stdout = train(1, "--data", str(tmp_path), "--vocab_size", "256", "--max_steps", "1", "--seq_len", "32",
                         "--val_tokens", "101")  # 3 windows asked, as many as the split holds: nothing said
    assert "validation:" not in stdout, stdout


# What each damage to the middle one of three train shards is refused with, after "error: --data FILE: ".
DAMAGED = {
    "bad magic": "no llm.c header (magic 20240520 or 20240801) where {folder}/x_train_000.bin has one: a folder's "
                 ".bin files all have one, or none",
    "unknown version": "version 2 of llm.c's header (magic 20240520) is not known; 1 is",
    "truncated": "truncated: its header says 3000 tokens (7024 bytes with it), the file has 7018 bytes",
    "count disagrees": "its header says 2900 tokens (6824 bytes with it), the file has 7024 bytes",
    "cut in the header": "truncated: 100 bytes, shorter than llm.c's header (1024)",
    "odd bytes": "6001 bytes is not a whole number of uint16 token ids",
    "uint32 among uint16": "llm.c uint32 ids where {folder}/x_train_000.bin holds llm.c uint16: a folder's .bin "
                           "files hold ids of one width",
    "contradicted flag": "its header says uint16 ids, not --data_dtype uint32",
    "a link to another": "the same file as {folder}/x_train_000.bin",
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_file_is_one_line_naming_it_and_nothing_is_written(damage, tmp_path):
    """Three train shards and a val shard, the middle train shard damaged (raw files for the odd byte
    count; uint32 shards, but that one, for the flag): refused before any step, OUT_DIR never created."""
    folder = tmp_path / "data"
    folder.mkdir()
    bad = folder / "x_train_001.bin"
    for path in ("x_train_000.bin", "x_train_001.bin", "x_train_002.bin", "x_val_000.bin"):
        (uint32 if damage == "contradicted flag" else llmc)(folder / path, GOOD)
    argv = ["--data_dtype", "uint32"] if damage == "contradicted flag" else []
    if damage == "bad magic":
        llmc(bad, GOOD, magic=20240521)
    elif damage == "unknown version":
        llmc(bad, GOOD, version=2)
    elif damage == "truncated":
        bad.write_bytes(bad.read_bytes()[:-6])
    elif damage == "count disagrees":
        llmc(bad, GOOD, count=2900)
    elif damage == "cut in the header":
        bad.write_bytes(bad.read_bytes()[:100])
    elif damage == "odd bytes":
        for path in folder.iterdir():
            GOOD.astype(np.uint16).tofile(path)
        bad.write_bytes(bad.read_bytes() + b"\0")
    elif damage in ("uint32 among uint16", "contradicted flag"):
        (uint32 if damage == "uint32 among uint16" else llmc)(bad, GOOD)
    elif damage == "a link to another":  # a shard listed twice would be trained twice (or val on train's)
        bad.unlink()
        bad.symlink_to(folder / "x_train_000.bin")
    result = torchrun_in_process(1, TRAIN, "--data", str(folder), *argv, "--vocab_size", "256", "--max_steps", "1",
                                 cwd=tmp_path, timeout=60)
    assert result.codes == [1], result.stderr
    assert result.stderr.strip() == f"error: --data {bad}: {DAMAGED[damage].format(folder=folder)}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stray", ["train_old.bin", "A_TRAIN.bin", "fineweb_train_000001.bin.bin", "val.bin.bak.bin"])
def test_a_bin_file_not_named_as_a_shard_is_refused_by_name(stray, tmp_path):
    """A folder's shards are train.bin and val.bin or NAME_train_N.bin and NAME_val_N.bin (data.SHARD): a stray
    train_old.bin would have joined the training stream in silence; what is not a .bin (meta.pkl) is left alone."""
    for name in ("fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"):
        llmc(tmp_path / name, GOOD)
    (tmp_path / "meta.pkl").write_bytes(b"\0" * 10)
    loaded = load(str(tmp_path))
    assert loaded.counts == (2, 1) and len(loaded.train) == 2 * len(GOOD)
    assert loaded.summary() == f"{tmp_path} (llm.c uint16: train 2 files 6,000 tokens, val 1 file 3,000 tokens; " \
                               "vocab 50304)"
    llmc(tmp_path / stray, GOOD)
    with pytest.raises(ValueError) as refused:
        load(str(tmp_path))
    assert str(refused.value) == f"--data {tmp_path / stray}: not a shard's name (train.bin and val.bin, or " \
                                 "NAME_train_N.bin and NAME_val_N.bin as llm.c writes): rename it, or move it out of " \
                                 "the folder"


@pytest.mark.parametrize(("other", "names"), [("old_train.bin", "'fineweb_', 'old_'"),
                                              ("edu_fineweb_train_000001.bin", "'edu_fineweb_', 'fineweb_'"),
                                              ("train_val.bin", "'fineweb_', 'train_'")])
def test_shards_of_two_data_sets_in_one_folder_are_refused(other, names, tmp_path):
    """Each name matches on its own, but two data sets in one folder would be read as one stream."""
    for name in ("fineweb_train_000001.bin", "fineweb_val_000000.bin"):
        llmc(tmp_path / name, GOOD)
    llmc(tmp_path / other, GOOD)
    with pytest.raises(ValueError) as refused:
        load(str(tmp_path))
    assert str(refused.value) == f"--data {tmp_path}: shards of 2 data sets ({names}): one a folder"
    (tmp_path / other).unlink()
    for name in ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"):  # llm.c's name of two words, alone
        llmc(tmp_path / name, GOOD)
    for name in ("fineweb_train_000001.bin", "fineweb_val_000000.bin"):
        (tmp_path / name).unlink()
    assert load(str(tmp_path)).counts == (1, 1)


def test_a_job_refused_for_a_held_lock_reads_no_data(tmp_path):
    """OUT_DIR's lock is taken before the data is read in full: a second job on a running job's folder (its lock
    held here) is refused at once, though its data, 2 TiB of sparse zeros, would take the ranks far longer than the
    test's minute to read (data_check.json has no record of it); it writes nothing there."""
    for split in ("train", "val"):
        with open(tmp_path / f"{split}.bin", "wb") as file:
            file.truncate(1 << 40)
    (tmp_path / "out").mkdir()
    lock = os.open(tmp_path / "out" / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as the running job holds it
    try:
        result = torchrun_in_process(2, TRAIN, "--data", str(tmp_path), "--vocab_size", "256", cwd=tmp_path,
                                     timeout=60)
    finally:
        os.close(lock)
    assert result.codes == [1, 1], result.stderr
    host = f"{socket.gethostname()} (node 0)"  # rank 0's finding, named as such; rank 1 says it stopped for it
    assert result.stderrs[0].strip() == f"error: out is in use by another job (it holds out/lock) (found by rank 0 " \
                                        f"on {host})" and result.stderrs[1].strip() == f"stopped: rank 0 on {host} " \
                                                                                       "found an error", result.stderr
    assert os.listdir(tmp_path / "out") == ["lock"]


def test_data_dtype_is_refused_for_a_text_file(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 100)
    result = torchrun_in_process(1, TRAIN, "--data", "a.txt", "--data_dtype", "uint32", cwd=tmp_path, timeout=60)
    assert result.codes == [1] and result.stderr.strip() == "error: --data_dtype is for a folder of .bin files, not " \
                                                            "--data a.txt"
    assert not (tmp_path / "out").exists()


def test_one_of_llmcs_shards_given_as_a_file_is_not_read_as_text(tmp_path):
    llmc(tmp_path / "fineweb_train_000001.bin", GOOD)
    result = torchrun_in_process(1, TRAIN, "--data", "fineweb_train_000001.bin", cwd=tmp_path, timeout=60)
    assert result.codes == [1] and result.stderr.strip() == "error: --data fineweb_train_000001.bin: one of llm.c's " \
                                                            "shards, not text: give the folder that holds it"
    assert not (tmp_path / "out").exists()


def start(folder: Path) -> object:
    """2 ranks to step 2 on the folder's raw train.bin and val.bin, OUT_DIR folder/out, each rank saying
    each read of a file's ids (tests/gpt_count_reads.py): a second start resumes at step 2 and trains
    nothing, so all it does with the data is the id check."""
    return torchrun_in_process(2, "gpt_count_reads.py", "--data", str(folder), "--vocab_size", "256", "--max_steps",
                               "2", "--seq_len", "32", "--val_tokens", "64", "--out_dir", str(folder / "out"),
                               cwd=folder, timeout=60)


def reads(result) -> list[str]:
    return [line for stdout in result.stdouts for line in stdout.splitlines() if line.startswith("[read]")]


def plant(path: Path, tokens: np.ndarray, mtime_ns: int) -> None:
    """Write `tokens` over the file, then give it `mtime_ns` back."""
    tokens.astype(np.uint16).tofile(path)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_a_second_start_reads_no_data(tmp_path):
    """The first start reads each file (each rank its share) and keeps what it found in OUT_DIR under
    the file's identity; the second reads nothing."""
    for split in ("train", "val"):
        GOOD.astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    first = start(tmp_path)
    assert first.codes == [0, 0], first.stderr
    assert reads(first) == ["[read] 3000 ids"] * 4  # 2 files, on each of 2 ranks
    kept = json.loads((tmp_path / "out" / CHECKED).read_text())
    stat = os.stat(tmp_path / "train.bin")
    assert kept[os.path.realpath(tmp_path / "train.bin")] == {
        "size": 6000, "mtime_ns": stat.st_mtime_ns, "ctime_ns": stat.st_ctime_ns, "inode": stat.st_ino,
        "format": "raw uint16", "largest": 255}
    second = start(tmp_path)
    assert second.codes == [0, 0], second.stderr
    assert "resuming from" in second.stdouts[0] and reads(second) == []


@pytest.mark.parametrize("change", ["mtime", "size", "content, size and mtime restored"])
def test_a_file_changed_since_is_read_again(change, tmp_path):
    """An id past the vocab written into val.bin after a first start: with a new mtime and the same
    size, with one more id and the old mtime, or with the same size and the old mtime (its ctime says
    it). Each is read again, and the id found."""
    for split in ("train", "val"):
        GOOD.astype(np.uint16).tofile(tmp_path / f"{split}.bin")
    assert start(tmp_path).codes == [0, 0]
    mtime_ns = os.stat(tmp_path / "val.bin").st_mtime_ns
    if change == "mtime":
        plant(tmp_path / "val.bin", np.where(np.arange(3000) == 10, 300, GOOD), mtime_ns + 10**9)
    elif change == "size":
        plant(tmp_path / "val.bin", np.append(GOOD, 300), mtime_ns)
    else:
        time.sleep(0.01)  # a ctime that differs on a file system with coarse timestamps
        plant(tmp_path / "val.bin", np.where(np.arange(3000) == 10, 300, GOOD), mtime_ns)
    again = start(tmp_path)
    assert again.codes == [1, 1], again.stderr
    assert reads(again) == [f"[read] {3001 if change == 'size' else 3000} ids"] * 2  # val.bin only, on each rank
    # The rank whose share of val.bin holds the id says so, once; the other, that it stopped for it.
    finder = 1 if change == "size" else 0  # appended: in the second half; else at index 10, in the first
    who = f"rank {finder} on {socket.gethostname()} (node 0)"
    assert again.stderrs[finder].strip() == f"error: --data {tmp_path / 'val.bin'}: token id 300 is outside the " \
        f"vocab of 256: set --vocab_size, or --data_dtype uint32 if the files hold uint32 ids (found by {who})"
    assert again.stderrs[1 - finder].strip() == f"stopped: {who} found an error"


@pytest.mark.parametrize(("hard", "said"), [(4096, None), (300, "above the hard limit of 300 (ulimit -Hn)")])
def test_a_folder_of_more_shards_than_open_files_allowed_raises_the_limit_or_says_so(hard, said, tmp_path):
    """Each shard's memory map keeps a file descriptor open: 60 shards under a soft limit of 64 (FineWeb's
    1,000 under the common 1,024) raise it to what they need, up to the hard limit; past that, one line."""
    for i in range(60):
        llmc(tmp_path / f"s_train_{i:03d}.bin", GOOD)
    llmc(tmp_path / "s_val.bin", GOOD)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

    result = subprocess.run([sys.executable, str(REPO / TRAIN), "--data", str(tmp_path), "--vocab_size", "256",
                             "--max_steps", "2", "--seq_len", "32", "--val_tokens", "64", "--out_dir",
                             str(tmp_path / "out")], capture_output=True, text=True, preexec_fn=limited, timeout=120)
    if said is None:
        assert result.returncode == 0, result.stderr[-2000:]
    else:
        assert result.returncode == 1 and result.stderr.strip() == f"error: --data {tmp_path}: 61 files need about " \
            f"573 open files, {said}: raise it, or join the shards into fewer files"
