"""Two tiktoken encodings for tests/test_gpt_prepare.py, built from local ranks (no download): a tiktoken_ext
plugin, as a user registers an encoding of their own, found by name because tests/ is on sys.path.
test_bytes: the 256 bytes and a few merges, its end of text id 300; test_wide: the same, its end of text
id 70000, so that its shards hold uint32 ids."""
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = [b"th", b"he", b"in", b"er", b"an", b" t", b" a", b"re", b"on", b" the", b"ing", b"es", b"en", b"ed"]


def ranks() -> dict[bytes, int]:
    table = {bytes([i]): i for i in range(256)}
    for piece in MERGES:
        for end in range(2, len(piece) + 1):  # every prefix first: BPE reaches a piece through them
            table.setdefault(piece[:end], len(table))
    return table


def test_bytes() -> dict:
    return {"name": "test_bytes", "pat_str": GPT2_PATTERN, "mergeable_ranks": ranks(),
            "special_tokens": {"<|endoftext|>": 300}}


def test_wide() -> dict:
    return {"name": "test_wide", "pat_str": GPT2_PATTERN, "mergeable_ranks": ranks(),
            "special_tokens": {"<|endoftext|>": 70000}}


ENCODING_CONSTRUCTORS = {"test_bytes": test_bytes, "test_wide": test_wide}
