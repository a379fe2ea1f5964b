"""What --activation_checkpoint keeps and what it costs: the bytes a block keeps for its backward, measured and by
formula, and train.py's tokens/s under each mode.

    python gpt/activations.py                                   # the tiny model on 1 rank: bytes, then tokens/s
    python gpt/activations.py --world_size 2 -- --model mini --parallel fsdp
    python gpt/activations.py --bytes_only -- --model gpt2 --seq_len 1024 --batch_size 4

The bytes are measured by running one block's forward under a TorchDispatchMode that notes every storage an
operation makes (weakly: noting keeps nothing alive), then counting those still alive once the forward returns:
what autograd, or a checkpoint, holds for the backward, and the block's output. The same on a CPU and a GPU, as it
reads no allocator. Explained in docs/activation_checkpointing.md.
"""
import argparse
import os
import signal
import statistics
import sys

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import bench
import parallelize
from model import CONFIGS, GPT, GPTConfig

MODES = ["none", "selective", "full"]  # ever more recomputed


class Kept(TorchDispatchMode):
    """Every storage an operation makes while this mode is on; kept() adds up those still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.made = []  # (weak reference, bytes, address): an address freed may be handed out again

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.made.append((StorageWeakRef(storage), storage.nbytes(), storage.data_ptr()))
        return out

    def kept(self, before: set[int]) -> int:
        """Bytes of the storages made and still alive, each once, leaving out those at the addresses in `before`
        (the weights and the input: a view of one, as a weight's transpose, makes no storage)."""
        alive = {address: size for ref, size, address in self.made if not ref.expired() and address not in before}
        return sum(alive.values())


def kept_per_block(config: GPTConfig, batch: int, mode: str, device: str = "cpu") -> int:
    """The bytes the first block of a GPT under --activation_checkpoint `mode` keeps after its forward, fp32."""
    model = GPT(config).to(device)
    parallelize.checkpoint_blocks(model, mode)
    x = torch.randn(batch, config.seq_len, config.n_embd, device=device, requires_grad=True)
    block = model.blocks[0]
    before = {t.untyped_storage().data_ptr() for t in (x, *block.parameters())}
    with Kept() as kept:
        y = block(x)
    held = kept.kept(before)
    y.sum().backward()  # frees what the forward kept
    return held


def formula(config: GPTConfig, batch: int, mode: str) -> int:
    """The bytes a block keeps in fp32, with H = batch · seq_len · n_embd numbers (one activation of the residual
    stream). none: the first norm's output, q, k, v, attention's output, the stream after attention, the second
    norm's output, the MLP's fc output and its GELU (4H each), the block's output: 16H, and each norm's mean and
    1/std (batch · seq each), attention's log-sum-exp (batch · heads · seq). selective: the six matrix products'
    outputs (q, k, v, o: H each; fc 4H, proj H), attention's output and log-sum-exp, the block's output: 11H.
    full: the block's output, H, which the next block keeps as its input."""
    tokens = batch * config.seq_len
    h, stats, lse = tokens * config.n_embd, tokens, tokens * config.n_head
    return 4 * {"none": 16 * h + 4 * stats + lse, "selective": 11 * h + lse, "full": h}[mode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_size", type=int, default=1, help="ranks of each train.py run")
    parser.add_argument("--repeats", type=int, default=3, help="train.py runs per mode")
    parser.add_argument("--bytes_only", action="store_true", help="measure the bytes, run no training")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: train.py's own arguments")
    args = parser.parse_args()
    if args.world_size < 1 or args.repeats < 1:
        parser.error("--world_size and --repeats must be at least 1")
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    import train  # gpt/train.py, for its parser: importing it starts nothing

    known = train.parse_args(train_args)  # train.py's own checks, before anything runs: one line for a bad value
    if known.model is None or CONFIGS[known.model].get("family", "gpt2") != "gpt2":  # the formula is GPT-2's block's
        parser.error(f"--model {known.model}: the formula counts GPT-2's block (give one of its shapes: tiny, mini, "
                     "small, gpt2, gpt2-medium)")
    config = GPTConfig(64, known.seq_len, **CONFIGS[known.model])  # a block's bytes: the vocabulary plays no part
    print(f"machine: {bench.machine()}")
    print(f"one block of --model {known.model}, {known.batch_size} sequences of {known.seq_len} tokens, measured in "
          f"fp32: the bytes kept for backward (H = {known.batch_size * known.seq_len * config.n_embd:,} numbers)")
    rows = {mode: kept_per_block(config, known.batch_size, mode) for mode in MODES}
    h = 4 * known.batch_size * known.seq_len * config.n_embd
    for mode, held in rows.items():
        print(f"{mode:>10} {held:>14,} B measured {formula(config, known.batch_size, mode):>14,} B by formula "
              f"({held / h:.2f} H)", flush=True)
    if args.bytes_only:
        return
    threads = 1 if torch.cuda.is_available() else max(1, (os.cpu_count() or 1) // args.world_size)
    print(f"train.py {' '.join(bench.DEFAULTS + train_args)} on {args.world_size} rank(s), modes interleaved: "
          f"tokens/s, median of {args.repeats} runs (min, max), and the time a step costs against none's")
    speeds = {mode: [] for mode in MODES}
    # Stopped by SIGTERM, this process exits, and subprocess.run kills the run's torchrun on the way out (train.py's
    # ranks follow it: they ask Linux for a SIGTERM when it dies)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for _ in range(args.repeats):  # interleaved: a drift in the machine's speed touches every mode alike
            for mode in MODES:
                speeds[mode].append(statistics.median(bench.run(args.world_size, [*train_args,
                                                                                  "--activation_checkpoint", mode],
                                                                threads)))
    except KeyboardInterrupt:  # torchrun, in this terminal's process group, got it too and passes it on
        raise SystemExit("error: stopped by Ctrl-C") from None
    for mode in MODES:
        extra = sorted(none / mine - 1 for none, mine in zip(speeds["none"], speeds[mode], strict=True))
        print(f"{mode:>10} {statistics.median(speeds[mode]):>10,.0f} tokens/s ({min(speeds[mode]):,.0f}, "
              f"{max(speeds[mode]):,.0f}) {statistics.median(extra):+.1%} a step", flush=True)


if __name__ == "__main__":
    sys.exit(main())
