"""A GPT-2-style decoder: pre-norm blocks, causal attention through scaled_dot_product_attention,
a GELU MLP, and an output layer tied to the token embedding. No dropout by default.

Only torch: this file loads an exported model (`GPT.load`) with no torch.distributed, and the
parallelism lessons to come (tensor, pipeline, context, expert) are to import it. Each block is
its own module in `blocks`, and each projection its own Linear (q, k, v, o; fc, proj), so that
tensor parallel can split them column- or row-wise and pipeline parallel can cut the list.
"""
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int  # the longest sequence: the size of the position embedding
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


# The sizes that --model names; vocab_size and seq_len come from the data and --seq_len.
CONFIGS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),  # trains in seconds on 2 CPU cores
    "mini": dict(n_layer=4, n_head=4, n_embd=128),  # 4 heads: tensor parallel up to 4 (gpt/bench.py --tp)
    "small": dict(n_layer=6, n_head=6, n_embd=384),  # nanoGPT's Shakespeare config
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M (with vocab 50304, seq_len 1024)
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
}


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.o = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, n_embd)
        batch, seq, _ = x.shape
        # (batch, heads, seq, head_dim); -1 heads: under tensor parallel a rank holds only some
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # GPT-2's GELU


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)
        # One Dropout module each: a module called twice per forward breaks torch's CommDebugMode, whose
        # module tracker registers a forward hook at each call (torch 2.13), so the second call pops twice.
        self.attn_dropout, self.mlp_dropout = nn.Dropout(config.dropout), nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_dropout(self.attn(self.ln_1(x)))
        return x + self.mlp_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix, listed once by parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (batch, seq, vocab_size) of idx (batch, seq), or with targets each token's loss
        (batch × seq)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)  # (batch, seq, n_embd)
        for block in self.blocks:
            x = block(x)
        if targets is None:
            return self.lm_head(self.ln_f(x))
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each token's loss (batch × seq) in fp32 from the last block's output: the final norm, the tied
        head and the cross-entropy in one method, so that train.py --compile compiles them together (at
        GPT-2's vocabulary the head is 38.6M of the 124M weights: a third of the matmul FLOPs)."""
        logits = self.lm_head(self.ln_f(x)).float()  # fp32 whatever the compute dtype: a stable log-softmax
        # flat, not a view: FSDP warns of a view returned by a wrapped module (an in-place op on it would skip a hook)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    def init_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The full starting value of parameter `name` (GPT-2's rule), drawn on the CPU from
        `generator`: the same numbers whatever device or sharding the parameter lives on."""
        if name.endswith("bias"):
            return torch.zeros(shape)
        if name.startswith("ln") or ".ln_" in name:
            return torch.ones(shape)
        std = 0.02
        if name.endswith(("attn.o.weight", "mlp.proj.weight")):
            std /= math.sqrt(2 * self.config.n_layer)  # projections into the residual stream (GPT-2)
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter from init_value, in the order of named_parameters()."""
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            param.copy_(self.init_value(name, param.shape, generator))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter (forward 2, backward 4) plus attention's
        12 · layers · n_embd · seq_len (the PaLM paper's estimate, as nanoGPT uses)."""
        c = self.config
        return 6 * (self.num_params() - self.wpe.weight.numel()) + 12 * c.n_layer * c.n_embd * c.seq_len

    @classmethod
    def load(cls, path: str) -> "GPT":
        """A model exported by train.py --export: {"config": dict, "model": state_dict, "tokenizer": the record of
        gpt/prepare.py's tokenizer, or None}, the record kept as model.tokenizer."""
        saved = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain types only
        model = cls(GPTConfig(**saved["config"]))
        model.load_state_dict(saved["model"])
        model.tokenizer = saved.get("tokenizer")
        return model


def export(path: str, config: GPTConfig, state_dict: dict, tokenizer: dict | None = None) -> None:
    """Write what GPT.load reads to a temporary file, then rename it: PATH is whole or absent."""
    torch.save({"config": asdict(config), "model": state_dict, "tokenizer": tokenizer}, path + ".tmp")
    os.replace(path + ".tmp", path)
