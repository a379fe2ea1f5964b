"""A decoder of two families, read top to bottom: GPT-2 (learned positions, LayerNorm, a tanh-GELU MLP, biases,
the head tied to the token embedding) and Llama (Llama 3, Qwen3: rotary positions, RMSNorm, a SwiGLU MLP,
grouped-query attention, no biases, the head tied or not, Qwen3's RMSNorm of each head's q and k). The families
differ by the options of GPTConfig, not by a second copy of the model. Pre-norm blocks, causal attention through
scaled_dot_product_attention, no dropout by default.

Only torch: this file loads an exported model (`GPT.load`) with no torch.distributed, and the parallelism
lessons import it. Each block is its own module in `blocks`, and each projection its own Linear (q, k, v, o;
fc, proj, and SwiGLU's gate), so that tensor parallel can split them column- or row-wise and pipeline parallel
can cut the list.
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
    seq_len: int  # the longest sequence: the size of GPT-2's position embedding
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    # What sets the families apart. The defaults are GPT-2's; None is worked out in __post_init__.
    family: str = "gpt2"  # gpt2: LayerNorm, learned positions, GELU, biases; llama: RMSNorm, rotary, SwiGLU, none
    n_kv_head: int | None = None  # k and v heads, each shared by n_head / n_kv_head q heads (1: multi-query)
    head_dim: int | None = None  # n_embd // n_head, unless set (Qwen3's is its own)
    ffn_hidden: int | None = None  # the MLP's hidden units: 4 · n_embd (GPT-2's); SwiGLU's have their own
    norm_eps: float = 1e-5
    rope_theta: float = 10_000.0  # the rotary frequencies' base (llama)
    # Llama 3's frequency scaling, as transformers' rope_type "llama3" computes it: (factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings); None: none
    rope_llama3: tuple | None = None
    qk_norm: bool = False  # Qwen3: each head's q and k through an RMSNorm of head_dim, before the rotation
    tie_head: bool = True  # the head is the token embedding's matrix
    # A mixture of experts in place of the MLP (llama only; 0 experts: dense). Each token goes to top_k of
    # n_expert SwiGLU experts of expert_hidden units, chosen by a router's scores (softmax: Qwen3-MoE's; sigmoid:
    # DeepSeek-V3's), its output their sum weighted by the scores (renormalised over the top_k with norm_topk),
    # times route_scale; n_shared_expert experts' worth of one more SwiGLU take every token; the first
    # `first_dense` blocks keep the dense MLP (DeepSeek's first_k_dense).
    n_expert: int = 0
    top_k: int = 2
    expert_hidden: int | None = None  # ffn_hidden unless set
    n_shared_expert: int = 0
    router: str = "softmax"
    norm_topk: bool = False
    route_scale: float = 1.0
    first_dense: int = 0
    # Balancing. aux_loss_coef: the weight of transformers' load_balancing_loss_func over each forward's tokens;
    # bias_rate: DeepSeek-V3's per-expert bias, added to the scores for the choice only, moved by this much after
    # each step toward the under-loaded experts (0: none); capacity_factor: in training, each expert takes at most this
    # share over an even split of a forward's choices, the rest dropped (counted in the metrics; 0: none dropped).
    aux_loss_coef: float = 0.0
    bias_rate: float = 0.0
    capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        if self.family not in ("gpt2", "llama"):
            raise ValueError(f"family {self.family!r}: gpt2 or llama")
        defaults = {"n_kv_head": self.n_head, "head_dim": self.n_embd // self.n_head, "ffn_hidden": 4 * self.n_embd}
        defaults["expert_hidden"] = self.ffn_hidden or defaults["ffn_hidden"]
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: set once, here
        if self.rope_llama3 is not None:  # a list, as JSON gives it back
            object.__setattr__(self, "rope_llama3", tuple(self.rope_llama3))
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head {self.n_kv_head} does not divide n_head {self.n_head}")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: the rotation turns pairs of dimensions")
        if self.family == "gpt2" and (self.n_kv_head != self.n_head or self.qk_norm or not self.tie_head
                                      or self.head_dim * self.n_head != self.n_embd):
            raise ValueError("GPT-2 has full multi-head attention of n_embd / n_head, no qk_norm, a tied head")
        if self.n_expert:
            if self.family != "llama":
                raise ValueError("experts replace the Llama family's SwiGLU MLP: family llama")
            if not 1 <= self.top_k <= self.n_expert:
                raise ValueError(f"top_k {self.top_k}: from 1 to n_expert, {self.n_expert}")
            if self.router not in ("softmax", "sigmoid"):
                raise ValueError(f"router {self.router!r}: softmax or sigmoid")
            if not 0 <= self.first_dense < self.n_layer:
                raise ValueError(f"first_dense {self.first_dense}: from 0 to n_layer - 1, {self.n_layer - 1} (all "
                                 "dense: n_expert 0)")
            for name in ("aux_loss_coef", "bias_rate", "capacity_factor"):
                if not 0 <= getattr(self, name) < math.inf:
                    raise ValueError(f"{name} {getattr(self, name)!r}: 0 or more, finite")


# The shapes that --model names; vocab_size and seq_len come from the data and --seq_len.
LLAMA3 = dict(family="llama", rope_theta=500_000.0, norm_eps=1e-5)
QWEN3 = dict(family="llama", rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True, head_dim=128)
CONFIGS = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),  # trains in seconds on 2 CPU cores
    "mini": dict(n_layer=4, n_head=4, n_embd=128),  # 4 heads: tensor parallel up to 4 (gpt/bench.py --tp)
    "small": dict(n_layer=6, n_head=6, n_embd=384),  # nanoGPT's Shakespeare config
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # GPT-2 124M (with vocab 50304, seq_len 1024)
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # GPT-2 350M
    # The Llama family at tiny's and mini's widths: grouped-query (2 heads per k and v), Llama 3's scaled
    # frequencies; llama-tiny's head untied, as Llama 3.1 8B's; qwen3-tiny's heads of their own size, and QK-norm.
    "llama-tiny": dict(**LLAMA3, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=160, tie_head=False,
                       rope_llama3=(8.0, 1.0, 4.0, 8192)),
    "qwen3-tiny": dict(**{**QWEN3, "head_dim": 32}, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=160),
    "llama-mini": dict(**LLAMA3, n_layer=4, n_head=8, n_kv_head=4, n_embd=128, ffn_hidden=352,
                       rope_llama3=(32.0, 1.0, 4.0, 8192)),
    # The published shapes (config.json on the Hugging Face hub); their vocabularies are the data's (--vocab_size).
    "llama3.2-1b": dict(**LLAMA3, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192,
                        rope_llama3=(32.0, 1.0, 4.0, 8192)),
    "llama3.1-8b": dict(**LLAMA3, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336, tie_head=False,
                        rope_llama3=(8.0, 1.0, 4.0, 8192)),
    "qwen3-0.6b": dict(**QWEN3, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, ffn_hidden=3072),
    "qwen3-8b": dict(**QWEN3, n_layer=36, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=12288, tie_head=False),
    # Mixtures of experts. moe-tiny: Qwen3-MoE's router (softmax, the top_k renormalised, the auxiliary loss);
    # moe-mini: DeepSeek-V3's (sigmoid scores scaled, a shared expert, a dense first block, the bias).
    "moe-tiny": dict(**{**QWEN3, "head_dim": 32}, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_expert=4, top_k=2,
                     expert_hidden=32, norm_topk=True, aux_loss_coef=0.01, tie_head=False),
    "moe-mini": dict(**LLAMA3, n_layer=4, n_head=8, n_kv_head=4, n_embd=128, ffn_hidden=352, n_expert=8, top_k=2,
                     expert_hidden=64, n_shared_expert=1, first_dense=1, router="sigmoid", norm_topk=True,
                     route_scale=2.5, bias_rate=1e-3),
    "qwen3-30b-a3b": dict(**QWEN3, n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=6144, n_expert=128,
                          top_k=8, expert_hidden=768, norm_topk=True, aux_loss_coef=0.001, tie_head=False),
    # DeepSeek-V3's experts and widths on this file's attention (grouped-query, not its multi-head latent one)
    "deepseek-v3-moe": dict(**LLAMA3, n_layer=61, n_head=128, n_kv_head=128, n_embd=7168, ffn_hidden=18432,
                            n_expert=256, top_k=8, expert_hidden=2048, n_shared_expert=1, first_dense=3,
                            router="sigmoid", norm_topk=True, route_scale=2.5, bias_rate=1e-3, tie_head=False),
}


def norm(config: GPTConfig, size: int) -> nn.Module:
    return nn.LayerNorm(size, eps=config.norm_eps) if config.family == "gpt2" else nn.RMSNorm(size, eps=config.norm_eps)


def rotary(config: GPTConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (seq, head_dim) in fp32, of the tokens at `positions` (seq,): the angle of frequency i is
    position · theta^(-2i / head_dim), Llama 3's low frequencies divided by its factor (and the middle ones
    blended), as transformers computes them (modeling_rope_utils.py, _compute_llama3_parameters). In transformers'
    layout, rotate-half: a head's first half pairs with its second (Meta's checkpoints pair neighbours: docs)."""
    d = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, device=positions.device).float() / d)
    if config.rope_llama3 is not None:
        factor, low, high, old_len = config.rope_llama3
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)  # 0 at the low-frequency end, 1 at the high one
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    angles = positions.float()[:, None] * inv_freq  # (seq, head_dim / 2)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seq, head_dim) rotated pair by pair, (x1, x2) the head's halves: (x1 cos - x2 sin, x2 cos +
    x1 sin). cos and sin in x's dtype, as transformers casts them."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c, bias = config, config.family == "gpt2"
        self.head_dim = c.head_dim
        self.dropout = c.dropout
        self.q = nn.Linear(c.n_embd, c.n_head * c.head_dim, bias=bias)
        self.k = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)  # fewer heads under grouped-query
        self.v = nn.Linear(c.n_embd, c.n_kv_head * c.head_dim, bias=bias)
        self.o = nn.Linear(c.n_head * c.head_dim, c.n_embd, bias=bias)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.norm_eps) if c.qk_norm else None
        self.attend = causal_attention  # (q, k, v, dropout_p) -> the heads' outputs; context parallel swaps it

    def forward(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:  # x: (batch, seq, n_embd)
        batch, seq, _ = x.shape
        # (batch, seq, heads, head_dim); -1 heads: under tensor parallel a rank holds only some
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim) for proj in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)  # --cp: gpt/context.py's
        return self.o(y.transpose(1, 2).reshape(batch, seq, -1))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Each query over the keys up to its own place. enable_gqa: q head h attends with k and v head
    h // (n_head / n_kv_head), as transformers' repeat_kv."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        self.swiglu, bias, hidden = config.family == "llama", config.family == "gpt2", hidden or config.ffn_hidden
        self.fc = nn.Linear(config.n_embd, hidden, bias=bias)
        self.gate = nn.Linear(config.n_embd, hidden, bias=False) if self.swiglu else None
        self.proj = nn.Linear(hidden, config.n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:  # Llama's w2(silu(w1 x) * w3 x): w1 is gate, w3 fc, w2 proj
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))  # GPT-2's GELU


def grouped(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x's rows (tokens, in), in runs of counts[e] rows for expert e, each run times weight[e] (experts, out,
    in) transposed, as one nn.Linear per expert: one grouped product where torch 2.13 has one (torch._grouped_mm:
    CUDA in bf16; the CPU in fp32 on plain tensors, eager only: under torch.compile, and on gpt/simulate.py's
    fake tensors, its shape check asks bf16), with rows of a multiple of 16 bytes; else a loop over the experts."""
    w = weight.transpose(1, 2)  # (experts, in, out)
    eager = type(x) is torch.Tensor and not torch.compiler.is_compiling()
    kernel = x.is_cuda and x.dtype == torch.bfloat16 or (eager and x.device.type == "cpu" and x.dtype == torch.float32)
    if kernel and all(n * x.element_size() % 16 == 0 for n in w.shape[1:]) and hasattr(torch, "_grouped_mm"):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offsets)
    return torch.cat([rows @ w_e for rows, w_e in zip(x.split(counts), w, strict=True)])


class Experts(nn.Module):
    """n_expert SwiGLU MLPs, each projection one parameter over all of them (experts, out, in): gate, fc and proj
    as MLP's, expert e's rows at [e]. Under expert parallel a rank holds a run of experts (gpt/parallelize.py)."""

    def __init__(self, n_expert: int, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_expert, hidden, n_embd))
        self.fc = nn.Parameter(torch.empty(n_expert, hidden, n_embd))
        self.proj = nn.Parameter(torch.empty(n_expert, n_embd, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x's rows sorted by expert, counts[e] of them expert e's (of the experts this module holds)."""
        return grouped(F.silu(grouped(x, self.gate, counts)) * grouped(x, self.fc, counts), self.proj, counts)


class MoE(nn.Module):
    """A mixture of experts in the MLP's place: the router scores each token for every expert, the token goes to
    its top_k (the scores plus expert_bias decide, the scores alone weigh), and the output is the weighted sum of
    those experts' outputs, plus the shared experts'. `routed` is what one forward routed: each expert's count
    of choices and sum of probabilities (for the auxiliary loss) and the choices dropped (capacity_factor)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.router = nn.Linear(config.n_embd, config.n_expert, bias=False)
        self.experts = Experts(config.n_expert, config.n_embd, config.expert_hidden)
        self.shared = MLP(config, config.n_shared_expert * config.expert_hidden) if config.n_shared_expert else None
        # outside autograd, saved in checkpoints (a persistent buffer), moved by gpt/parallelize.py's moe_step
        self.register_buffer("expert_bias", torch.zeros(config.n_expert) if config.bias_rate else None)
        self.routed = None
        # gpt/simulate.py's: choice i to expert i mod n_expert, each expert's count known from shapes alone (its
        # simulated tensors hold none), every rank's the same: the even load that balancing aims for
        self.even = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, shape = self.config, x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, n_embd)
        logits = self.router(x).float()
        scores = logits.softmax(-1) if c.router == "softmax" else logits.sigmoid()
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        chosen = choice.topk(c.top_k, dim=-1).indices  # (tokens, top_k)
        sizes = None  # each expert's count of choices, on the host: known from the shapes when even
        if self.even:
            chosen = torch.arange(chosen.numel(), device=x.device).remainder(c.n_expert).view(chosen.shape)
            sizes = [len(range(e, chosen.numel(), c.n_expert)) for e in range(c.n_expert)]
        weights = scores.gather(1, chosen)
        if c.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = (weights * c.route_scale).to(x.dtype)
        flat = chosen.flatten()  # choice i is token i // top_k's
        counts = torch.bincount(flat, minlength=c.n_expert) if sizes is None else torch.tensor(sizes, device=x.device)
        order = flat.argsort(stable=True)  # the choices by expert, each expert's in token order
        kept = counts
        if c.capacity_factor and self.training:  # each expert's first `capacity` choices in token order, the rest
            # adding nothing; in evaluation none dropped (as transformers' Qwen3-MoE, and servers): a token's loss
            # does not depend on the others in its batch
            capacity = math.ceil(c.capacity_factor * flat.numel() / c.n_expert)
            within = torch.arange(flat.numel(), device=x.device) - (counts.cumsum(0) - counts)[flat[order]]
            order, kept = order[within < capacity], counts.clamp(max=capacity)
        out = torch.zeros(flat.numel(), shape[-1], dtype=x.dtype, device=x.device)
        # kept.tolist(): a host sync per layer (on a GPU, the step waits here): the runs' sizes are the
        # split's and the grouped product's arguments, and the next all-to-all's under --ep
        out[order] = self.experts(x[order // c.top_k], kept.tolist() if sizes is None else sizes).to(x.dtype)
        y = (out.view(-1, c.top_k, shape[-1]) * weights.unsqueeze(-1)).sum(1)  # the choices' weighted sum
        if self.shared is not None:
            y = y + self.shared(x)
        probs = scores if c.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        self.routed = (counts.float(), probs.sum(0), (counts - kept).sum())
        return y.view(shape)


def balancing_loss(config: GPTConfig, counts: torch.Tensor, probs: torch.Tensor, tokens: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func (Switch Transformer's) of one forward of `tokens` tokens, from each
    expert's choices and probabilities summed over the MoE layers: n_expert times the sum over experts of (their
    share of the choices) × (their mean probability), both averaged over the layers and the tokens: top_k when the
    choices and the probabilities are even, more the less they are."""
    rows = (config.n_layer - config.first_dense) * tokens
    return config.n_expert * (counts / rows * (probs / rows)).sum()


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = norm(config, config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = norm(config, config.n_embd)
        self.mlp = MoE(config) if config.n_expert and layer >= config.first_dense else MLP(config)
        # One Dropout module each: a module called twice per forward breaks torch's CommDebugMode, whose
        # module tracker registers a forward hook at each call (torch 2.13), so the second call pops twice.
        self.attn_dropout, self.mlp_dropout = nn.Dropout(config.dropout), nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple | None = None) -> torch.Tensor:
        # rope by keyword: a forward pre-hook (tensor parallel's, the lessons') sees and replaces x alone
        x = x + self.attn_dropout(self.attn(self.ln_1(x), rope=rope))
        return x + self.mlp_dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd) if config.family == "gpt2" else None  # llama: rotary
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layer))
        self.ln_f = norm(config, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_head:
            self.lm_head.weight = self.wte.weight  # tied: one matrix, listed once by parameters()
        self.cp_size = 1  # --cp: the ranks a sequence is split over, whose routing a forward's sums are (context.py)
        # the training forwards' routing (tally()) since the last optimizer step, and since the last log line
        # (gpt/parallelize.py's moe_step and moe_metrics): None in a dense model
        self.routing = self.interval = None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (batch, seq, vocab_size) of idx (batch, seq), or with targets each token's loss
        (batch × seq), in training plus aux_loss_coef times the experts' auxiliary loss (so that their mean is
        the loss transformers' Qwen3-MoE trains). `positions` (seq,): the tokens' places in their sequence, 0 to
        seq - 1 unless given."""
        x, rope = self.embed(idx, positions)
        for block in self.blocks:
            x = block(x, rope=rope)
        if targets is None:
            return self.lm_head(self.ln_f(x))
        losses = self.head_loss(x, targets)
        if self.config.n_expert and self.training:
            aux = self.aux_loss(idx.numel() * self.cp_size)
            self.tally(aux.detach())
            losses = losses + self.config.aux_loss_coef * aux
        return losses

    def moe_layers(self) -> list["MoE"]:
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def aux_loss(self, tokens: int) -> torch.Tensor:
        """balancing_loss over this forward's MoE layers."""
        routed = [layer.routed for layer in self.moe_layers()]
        return balancing_loss(self.config, sum(r[0] for r in routed), sum(r[1] for r in routed), tokens)

    @torch.no_grad()
    def tally(self, aux: torch.Tensor) -> None:
        """Add this forward's routing to `routing`, one flat tensor (for one all-reduce): each MoE layer's
        choices per expert, its choices dropped, the auxiliary loss, 1 forward. gpt/parallelize.py's moe_step
        reads it after the optimizer step (DeepSeek's bias, the metrics)."""
        routed = [layer.routed for layer in self.moe_layers()]
        now = torch.cat([torch.stack([r[0] for r in routed]).flatten(), torch.stack([r[2] for r in routed]).float(),
                         aux.float()[None], aux.new_ones(1)])
        self.routing = now if self.routing is None else self.routing + now

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple | None]:
        """(the embedded tokens (batch, seq, n_embd), the rotary tables every block takes, or None for GPT-2,
        whose positions are added here): the model's input end, which a pipeline's first stage runs too."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        if self.wpe is not None:
            return self.wte(idx) + self.wpe(positions), None
        return self.wte(idx), rotary(self.config, positions)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each token's loss (batch × seq) in fp32 from the last block's output: the final norm, the tied
        head and the cross-entropy in one method, so that train.py --compile compiles them together (at
        GPT-2's vocabulary the head is 38.6M of the 124M weights: a third of the matmul FLOPs)."""
        logits = self.lm_head(self.ln_f(x)).float()  # fp32 whatever the compute dtype: a stable log-softmax
        # flat, not a view: FSDP warns of a view returned by a wrapped module (an in-place op on it would skip a hook)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    def init_value(self, name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
        """The full starting value of parameter `name` (GPT-2's rule, for both families), drawn on the CPU from
        `generator`: the same numbers whatever device or sharding the parameter lives on."""
        if name.endswith("bias"):
            return torch.zeros(shape)
        if name.startswith("ln") or ".ln_" in name or name.endswith("_norm.weight"):  # the norms' gains
            return torch.ones(shape)
        std = 0.02
        if name.endswith(("attn.o.weight", "mlp.proj.weight", "experts.proj", "shared.proj.weight")):
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
        """Training FLOPs per token: 6 per parameter that multiplies (forward 2, backward 4: not GPT-2's position
        table, nor an untied embedding, which are looked up; of the experts, the top_k a token takes) plus
        attention's 12 · layers · heads · head_dim · seq_len (the PaLM paper's estimate, as nanoGPT uses)."""
        c = self.config
        looked_up = (self.wpe.weight.numel() if self.wpe is not None else 0) + (0 if c.tie_head else
                                                                                self.wte.weight.numel())
        idle = sum(sum(p.numel() for p in layer.experts.parameters()) for layer in self.moe_layers()) \
            * (c.n_expert - c.top_k) // max(c.n_expert, 1)  # a token's experts are top_k of n_expert: active
        return 6 * (self.num_params() - looked_up - idle) + 12 * c.n_layer * c.n_head * c.head_dim * c.seq_len

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
