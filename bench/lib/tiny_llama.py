"""A small Llama-style decoder in plain PyTorch: the reference model of gift_compile.

Tests, the demo and the benchmarks need a real transformer whose gradient collectives GIFT
rewrites, that trains in minutes on CPU and compiles as ONE graph (``fullgraph=True``) so the
backward graph holds every gradient. It deliberately has no torchtitan dependency.

Architecture and initialisation follow torchtitan's Llama 3 (pre-norm RMSNorm, RoPE on
adjacent pairs, grouped-query causal SDPA, SwiGLU, no biases, untied output head, depth-scaled
init of ``wo``/``w2``/``w3``). Parameter names are ``tok_embeddings``,
``layers.{i}.attention.{wq,wk,wv,wo}``, ``layers.{i}.feed_forward.{w1,w2,w3}`` (``w2`` is the
down projection), ``layers.{i}.{attention_norm,ffn_norm}``, ``norm`` and ``output``: the
classic torchtitan Llama naming, so selection globs such as ``layers.*.feed_forward.w2``
apply unchanged. (torchtitan 0.3.0 itself nests q/k/v as ``attention.qkv_linear.wqkv``, or
``qkv_linear.{wq,wk,wv}`` unfused, and calls the head ``lm_head``; globs on ``wo``, ``w1``,
``w2``, ``w3`` and the norms match both.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyLlama", "TinyLlamaConfig", "loss"]


@dataclass(frozen=True)
class TinyLlamaConfig:
    """Shape of a :class:`TinyLlama`.

    ``ffn_hidden`` follows Llama: ``int(8 * dim / 3)`` rounded up to ``multiple_of``, keeping
    SwiGLU's three matrices at the parameter cost of a 4x MLP.
    """

    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int | None = None  # None: multi-head attention (n_kv_heads = n_heads)
    vocab_size: int = 4096
    multiple_of: int = 64
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} not divisible by n_heads {self.n_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads {self.kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` or, when None, ``n_heads``)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def ffn_hidden(self) -> int:
        hidden = int(8 * self.dim / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @classmethod
    def tiny(cls) -> TinyLlamaConfig:
        """~1.0M parameters (79% in embedding + head), for unit tests; GQA with 4 q, 2 kv heads."""
        return cls(dim=96, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32, max_seq_len=256)

    @classmethod
    def small(cls) -> TinyLlamaConfig:
        """~3.3M parameters (dim 192, 4 layers): the benchmarks' reference model."""
        return cls(dim=192, n_layers=4, n_heads=6, multiple_of=64, max_seq_len=256)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned gain (computed in fp32, cast back)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (Llama's complex formulation written with real tensors).

    ``x``: [B, S, H, D]; ``cos``/``sin``: [S, D/2]. Real arithmetic keeps the graph free of
    complex dtypes, which every backend and FX pass handles.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE and SDPA."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.wq(x).view(bsz, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq, self.n_kv_heads, self.head_dim)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # Repeat kv heads explicitly (as torchtitan does) rather than SDPA's enable_gqa, so
        # every SDPA backend, including CPU math and flash, takes the same path.
        repeats = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``; ``w2`` is the down projection."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    """Llama-style decoder: ``forward(tokens [B, S] int64) -> logits [B, S, vocab]``.

    Weights are initialised by ``init_weights(seed)`` at construction (seed 0), independent
    of the global RNG, so two processes (ranks, arms of a benchmark) that build the same
    config get bit-identical models. Built on the meta device, call ``to_empty`` then
    ``init_weights``.
    """

    def __init__(self, config: TinyLlamaConfig, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # RoPE tables are derived, not learned: non-persistent, so state_dicts hold parameters
        # only and these are rebuilt by init_weights (e.g. after to_empty from meta).
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        if self.output.weight.device.type != "meta":
            self.init_weights(seed)

    def _rope_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        freqs = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).double() / c.head_dim))
        angles = torch.outer(torch.arange(c.max_seq_len).double(), freqs)
        return angles.cos().float().to(device), angles.sin().float().to(device)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic torchtitan-Llama3 initialisation from ``seed`` (CPU generator).

        Linear weights: truncated normal, std 0.02; ``wo``, ``w2``, ``w3`` of layer ``i``: std
        ``0.02 / sqrt(2 (i + 1))`` (keeps the residual stream's variance from growing with
        depth); embedding: normal, std 1; output: truncated normal, std ``dim**-0.5`` (unit-RMS
        features then give unit-variance logits); norms: ones. Values are drawn on CPU and
        copied, so the same seed gives the same weights on every device.
        """
        gen = torch.Generator().manual_seed(seed)

        def fill(param: torch.Tensor, std: float, truncated: bool = True) -> None:
            values = torch.empty(param.shape, dtype=torch.float32)
            if truncated:
                nn.init.trunc_normal_(values, std=std, a=-3 * std, b=3 * std, generator=gen)
            else:
                nn.init.normal_(values, std=std, generator=gen)
            param.copy_(values)

        fill(self.tok_embeddings.weight, 1.0, truncated=False)
        for i, layer in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            attn, ffn = layer.attention, layer.feed_forward
            for linear, std in (
                (attn.wq, 0.02),
                (attn.wk, 0.02),
                (attn.wv, 0.02),
                (attn.wo, depth_std),
                (ffn.w1, 0.02),
                (ffn.w2, depth_std),
                (ffn.w3, depth_std),
            ):
                fill(linear.weight, std)
            layer.attention_norm.weight.fill_(1.0)
            layer.ffn_norm.weight.fill_(1.0)
        self.norm.weight.fill_(1.0)
        fill(self.output.weight, self.config.dim**-0.5)
        self.rope_cos, self.rope_sin = self._rope_tables(self.output.weight.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of ``logits [B, S, V]`` against ``labels [B, S]``.

    Computed in fp32 whatever the logits dtype: a bf16 log-softmax over a 4096-way vocabulary
    loses the small differences that training signal lives in.
    """
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
