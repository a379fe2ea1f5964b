"""Text from a model that gpt/train.py --export wrote: one token at a time, with a temperature and top-k.

    python gpt/train.py --data FILE.txt --out_dir out/text --export model.pt    # a text file: bytes are tokens
    python gpt/sample.py model.pt --prompt "The " --length 200 --temperature 0.8 --top_k 50 --seed 0
    python gpt/sample.py model.pt --prompt_ids 1,2,3      # a model of token ids (--data synthetic or DIR)

A model of vocab 256 learned a file's bytes: the prompt is encoded as UTF-8 and the output decoded
so, a broken character as U+FFFD. A model trained on gpt/prepare.py's shards carries the record of their
tokenizer: text both ways with it. Other models read token ids (--prompt_ids) and print ids, except
GPT-2's vocab (50257, or 50304 padded) where tiktoken is installed: text both ways. The same --seed
draws the same text on the same device (CUDA when there is one, else the CPU).
"""
import argparse
import math
import sys
from collections.abc import Callable

import torch

import prepare
from model import GPT


@torch.no_grad()  # no graph kept: memory stays flat however long the text
def generate(model: GPT, ids: torch.Tensor, length: int, temperature: float, top_k: int | None,
             generator: torch.Generator) -> torch.Tensor:
    """`ids` (batch, seq) followed by `length` tokens, each drawn from the model's next-token
    distribution divided by `temperature`, among its `top_k` likeliest (None: all). Call in eval mode."""
    for _ in range(length):
        logits = model(ids[:, -model.config.seq_len:])[:, -1]  # (batch, vocab); no positions past seq_len
        values, indices = torch.topk(logits, min(top_k or logits.shape[-1], logits.shape[-1]))  # largest first
        # float64 and minus the largest: no nan whatever the temperature (float32 rounds 1e-300 to 0)
        probs = torch.softmax((values - values[:, :1]).double() / temperature, -1)
        ids = torch.cat([ids, indices.gather(-1, torch.multinomial(probs, 1, generator=generator))], 1)
    return ids


def text_codec(vocab_size: int, tokenizer: dict | None = None
               ) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str]] | None:
    """(encode, decode) between text and the model's token ids, or None where its ids are not text here.
    `tokenizer`: gpt/prepare.py's record, which the model's --export file carries (ValueError in one line
    where what it needs is not installed)."""
    if tokenizer is not None:
        return prepare.codec(tokenizer)[:2]
    if vocab_size == 256:  # a file's bytes
        return lambda text: list(text.encode()), lambda ids: bytes(ids).decode("utf-8", errors="replace")
    if vocab_size not in (50257, 50304):
        return None
    try:
        import tiktoken  # optional: only to read GPT-2's ids as text

        gpt2 = tiktoken.get_encoding("gpt2")  # downloads its tables on first use: OSError offline
    except (ImportError, OSError):
        return None
    unknown = "\ufffd".encode()  # ids from 50257 up: the padding rows, which no text maps to

    def decode(ids: list[int]) -> str:
        pieces = (gpt2.decode_single_token_bytes(i) if i < gpt2.n_vocab else unknown for i in ids)
        return b"".join(pieces).decode("utf-8", errors="replace")

    return lambda text: gpt2.encode(text, allowed_special="all"), decode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a file written by gpt/train.py --export")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    prompt.add_argument("--prompt_ids", help="token ids to continue, e.g. 1,2,3 (for a model whose ids are not text)")
    p.add_argument("--length", type=int, default=200, help="tokens to generate (default: 200)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the logits: below 1 likelier tokens, above 1 more random (default: 0.8)")
    p.add_argument("--top_k", type=int, help="sample among the k likeliest tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="of the draws: the same seed, the same text (default: 0)")
    args = p.parse_args(argv)
    for name in ("length", "top_k"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if not 0 < args.temperature < math.inf:  # also refuses nan
        p.error("--temperature must be above 0 and finite")
    if not 0 <= args.seed < 2**64:
        p.error("--seed must be in [0, 2**64) (torch.manual_seed's range)")
    if args.prompt_ids is not None:
        try:
            args.prompt_ids = [int(i) for i in args.prompt_ids.replace(",", " ").split()]
        except ValueError:
            p.error("--prompt_ids must be integers, e.g. 1,2,3")
    return args


def main() -> None:
    args = parse_args()
    try:
        model = GPT.load(args.model)  # weights_only: tensors and plain types, no code from the file
    except OSError as error:
        sys.exit(f"error: {args.model}: {error.strerror or error}")
    except Exception as error:  # torch.load and load_state_dict: KeyError, EOFError, UnpicklingError, ...
        sys.exit(f"error: {args.model}: not a model written by gpt/train.py --export ({type(error).__name__})")
    vocab_size = model.config.vocab_size
    try:
        encode, decode = text_codec(vocab_size, model.tokenizer) or (None, None)
    except ValueError as error:
        sys.exit(f"error: {args.model}: {error}")
    if args.prompt_ids is None and encode is None:
        sys.exit(f"error: the ids of this model (vocab {vocab_size}) are not text here: give --prompt_ids")
    ids = args.prompt_ids if args.prompt_ids is not None else encode(args.prompt)
    if not ids or not 0 <= min(ids) <= max(ids) < vocab_size:
        sys.exit(f"error: the prompt must hold at least one token id, each in [0, {vocab_size}): the model's vocab")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    generator = torch.Generator(device).manual_seed(args.seed)  # on the device that draws
    out = generate(model, torch.tensor([ids], device=device), args.length, args.temperature, args.top_k, generator)
    out = out[0].tolist()  # the prompt, then what was drawn
    print(decode(out) if decode else " ".join(map(str, out)))


if __name__ == "__main__":
    main()
