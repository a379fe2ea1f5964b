"""gpt/sample.py: text from a model that gpt/train.py --export wrote. Top-k 1 is greedy decoding,
computed here without sample.py; draws follow softmax(logits / temperature) over the top k; a seed
repeats a text; a text model reads and prints text, any other vocab ids; bad input is one line.

The models are trained here for 30 steps with --seq_len 16: the texts of 40 and 60 tokens run past
it, so sample.py must crop its context."""
import functools
import importlib
import string
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from harness import torchrun_in_process
from launch import REPO, python
from test_errors import run_main
from test_gpt import text_file  # noqa: F401 (a fixture: the README and docs as one file)

sys.path.insert(0, str(REPO))
from gpt.model import GPT  # noqa: E402

ARGV = ("--max_steps", "30", "--seq_len", "16", "--log_every", "30", "--eval_every", "30", "--val_tokens", "256")
FOLDERS = tempfile.TemporaryDirectory()  # each exported model, removed with the session


@functools.cache
def exported(data: str) -> Path:
    """The path of a model that `gpt/train.py --data DATA --export model.pt` wrote, in a fresh folder."""
    folder = Path(tempfile.mkdtemp(dir=FOLDERS.name))
    result = torchrun_in_process(1, "gpt/train.py", "--data", data, *ARGV, "--out_dir", "out", "--export",
                                 "model.pt", cwd=folder, timeout=120)
    assert result.codes == [0], result.stderr
    return folder / "model.pt"


@pytest.fixture(scope="module")
def text_model(text_file) -> Path:  # noqa: F811
    return exported(str(text_file))


@functools.cache
def import_gpt(name: str) -> types.ModuleType:
    """gpt/NAME.py as a module of this process. It imports gpt/model.py as `model`, a name that the
    root's model.py holds here: swapped out for the import, then back."""
    root = sys.modules.pop("model", None)
    sys.path.insert(0, str(REPO / "gpt"))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "gpt"))
        sys.modules.pop("model", None)
        if root is not None:
            sys.modules["model"] = root
    return module


def import_sample() -> types.ModuleType:
    return import_gpt("sample")


def run_sample(model: Path, *argv: str) -> str:
    """`python gpt/sample.py MODEL argv`'s stdout (its main() run here), after checking that it exited 0."""
    code, stdout, stderr = run_main(import_sample(), str(model), *argv)
    assert code == 0 and not stderr, stderr
    return stdout


def greedy(model: GPT, ids: list[int], length: int) -> list[int]:
    """The likeliest next token, `length` times, over at most the last seq_len tokens."""
    with torch.no_grad():
        for _ in range(length):
            ids = ids + [int(model(torch.tensor([ids[-model.config.seq_len:]]))[0, -1].argmax())]
    return ids


def test_top_k_1_is_greedy_decoding_whatever_the_temperature_and_seed(text_model):
    model = GPT.load(str(text_model)).eval()
    prompt = list(b"The model ")
    expected = greedy(model, prompt, 40)  # past seq_len 16: the context is cropped
    shown = run_sample(text_model, "--prompt", "The model ", "--length", "40", "--top_k", "1", "--temperature",
                       "5", "--seed", "3")
    assert shown == bytes(expected).decode("utf-8", errors="replace") + "\n"
    generate = import_sample().generate
    for temperature, top_k, seed in ((0.5, 1, 0), (100.0, 1, 1), (1e-300, None, 2)):  # 1e-300: 0 in float32
        out = generate(model, torch.tensor([prompt]), 40, temperature, top_k, torch.Generator().manual_seed(seed))
        assert out[0].tolist() == expected, (temperature, top_k)


def test_draws_follow_the_softmax_of_the_top_k_logits_over_the_temperature(text_model):
    """20,000 draws of one token after the same prompt, against softmax(top-5 logits / T) computed
    here: within 0.015 each (4 standard deviations at most), and never a token outside the top 5."""
    model, draws, top_k = GPT.load(str(text_model)).eval(), 20_000, 5
    prompt = torch.tensor([list(b"The ")])
    with torch.no_grad():
        logits = model(prompt)[0, -1]
    top = torch.topk(logits, top_k)
    for temperature in (0.5, 3.0):
        expected = torch.softmax(top.values.double() / temperature, -1)
        # a sampler that ignored the temperature would be off by more than twice the tolerance
        assert (expected - torch.softmax(top.values.double(), -1)).abs().max() > 0.05
        out = import_sample().generate(model, prompt.repeat(draws, 1), 1, temperature, top_k,
                                       torch.Generator().manual_seed(0))
        drawn = out[:, -1]
        assert set(drawn.tolist()) <= set(top.indices.tolist())
        frequencies = torch.stack([(drawn == i).double().mean() for i in top.indices])
        torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.015)


def test_a_seed_repeats_a_text_and_another_seed_draws_another(text_model):
    argv = ("--prompt", "The ", "--length", "60", "--top_k", "50")
    first, again, other = (run_sample(text_model, *argv, "--seed", seed) for seed in ("7", "7", "8"))
    assert first == again and first != other


def test_a_text_model_echoes_the_prompt_then_prints_text(text_model):
    """The prompt as UTF-8 (× and → are 2 and 3 bytes each), echoed whole; then 60 bytes of what the
    model learned from English and Markdown, mostly printable ASCII. The same prompt given as the ids
    of its bytes draws the same text."""
    prompt = "2 × 8 GPUs → "
    shown = run_sample(text_model, "--prompt", prompt, "--length", "60", "--seed", "0")
    assert shown.startswith(prompt)
    drawn = shown[len(prompt):-1]
    assert sum(c in string.printable for c in drawn) >= 0.8 * len(drawn) and len(drawn) >= 30
    ids = ",".join(map(str, prompt.encode()))
    assert run_sample(text_model, "--prompt_ids", ids, "--length", "60", "--seed", "0") == shown


def test_a_model_of_token_ids_prints_ids():
    shown = run_sample(exported("synthetic"), "--prompt_ids", "1,2,3", "--length", "20").split()
    assert len(shown) == 23 and shown[:3] == ["1", "2", "3"]
    assert all(0 <= int(i) < 64 for i in shown)  # the synthetic vocab


def test_gpt2_ids_are_text_only_with_tiktoken_and_the_padding_rows_do_not_break_it(monkeypatch):
    """tiktoken is not installed here (nor required); a stand-in with GPT-2's 50257 ids, which raises
    KeyError past them as tiktoken does, shows how sample.py uses one: ids from the 47 padding rows
    of a 50304-vocab model print as U+FFFD."""
    text_codec = import_sample().text_codec
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` fails, as where it is not installed
    assert text_codec(50304) is None

    class Encoding:
        n_vocab = 50257

        def encode(self, text: str, allowed_special: str) -> list[int]:
            return [ord(c) - 65 for c in text]

        def decode_single_token_bytes(self, token: int) -> bytes:
            if token >= self.n_vocab:
                raise KeyError(token)
            return bytes([65 + token % 26])

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=lambda name: Encoding()))
    for vocab_size in (50257, 50304):
        encode, decode = text_codec(vocab_size)
        assert encode("AB") == [0, 1] and decode([0, 1, 50257, 50303, 2]) == "AB\ufffd\ufffdC"
    assert text_codec(64) is None and text_codec(256)[1]([72, 105, 0xE2]) == "Hi\ufffd"

    def offline(name: str):
        raise OSError("no network")  # requests' errors are OSErrors

    monkeypatch.setitem(sys.modules, "tiktoken", types.SimpleNamespace(get_encoding=offline))
    assert text_codec(50304) is None


def test_importing_sample_starts_nothing():
    result = python("-c", "import sys; sys.path.insert(0, 'gpt'); import sample; print(sample.generate.__name__)")
    assert result.returncode == 0 and result.stdout == "generate\n" and not result.stderr, result.stderr


BAD_INPUT = [
    (["{text}", "--length", "0"], "--length must be at least 1"),
    (["{text}", "--top_k", "0"], "--top_k must be at least 1"),
    (["{text}", "--temperature", "0"], "--temperature must be above 0 and finite"),
    (["{text}", "--temperature", "nan"], "--temperature must be above 0 and finite"),
    (["{text}", "--temperature", "-1"], "--temperature must be above 0 and finite"),
    (["{text}", "--seed", "-1"], "--seed must be in [0, 2**64)"),
    (["{text}", "--prompt_ids", "1,x"], "--prompt_ids must be integers"),
    (["no/such.pt"], "error: no/such.pt: No such file or directory"),
    (["{folder}"], "error: {folder}: Is a directory"),
    (["{data}"], "error: {data}: not a model written by gpt/train.py --export"),
    (["{text}", "--prompt_ids", "256"], "each in [0, 256): the model's vocab"),
    (["{text}", "--prompt_ids", "1,-1"], "each in [0, 256): the model's vocab"),
    (["{text}", "--prompt", ""], "error: the prompt must hold at least one token id"),
    (["{ids}", "--prompt", "hello"], "error: the ids of this model (vocab 64) are not text here: give --prompt_ids"),
]


@pytest.mark.parametrize(("argv", "error"), BAD_INPUT, ids=[" ".join(argv) for argv, _ in BAD_INPUT])
def test_bad_input_gets_one_line_and_a_non_zero_exit(argv, error, text_model, text_file):  # noqa: F811
    names = {"text": text_model, "folder": text_model.parent, "data": text_file, "ids": exported("synthetic")}
    code, stdout, stderr = run_main(import_sample(), *(a.format(**names) for a in argv))  # an exception: red
    assert code != 0 and error.format(**names) in stderr, stderr
    said = [line for line in stderr.splitlines() if not line.startswith(("usage:", " "))]  # argparse's usage
    assert len(said) == 1 and not stdout, stderr
