"""LLaMA-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make, token_pair

_LLAMA3 = dict(vocab_size=128256, max_seq_len=8192, norm_eps=1e-5, rope_theta=500000.0)
# "1B"/"3B" use the Llama-3.2 body shapes, but with this model's untied output head.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32),
    "1B": dict(_LLAMA3, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "3B": dict(_LLAMA3, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "llama3-8b": dict(_LLAMA3, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "llama3-70b": dict(_LLAMA3, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


@dataclass
class LlamaConfig:
    """Shape of a LLaMA; the defaults are the ``"tiny"`` test size."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "LlamaConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown LLaMA preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(cfg: LlamaConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``, ``sin`` tables ``[max_seq_len, head_dim // 2]`` in ``cfg.dtype`` (built in float64)."""
    hd = cfg.dim // cfg.n_heads
    inv_freq = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().to(cfg.dtype), freqs.sin().to(cfg.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, hd]`` pairing dim ``i`` with ``i + hd/2`` (real arithmetic, no complex)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention: ``n_kv_heads`` k/v heads shared by ``n_heads // n_kv_heads`` q heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError("need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim")
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        kw = dict(bias=False, dtype=cfg.dtype)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, **kw)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, **kw)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, **kw)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.wq(x).view(B, S, H, hd).transpose(1, 2), cos, sin)
        k = apply_rope(self.wk(x).view(B, S, KV, hd).transpose(1, 2), cos, sin)
        v = self.wv(x).view(B, S, KV, hd).transpose(1, 2)
        if H != KV:  # expand+reshape, not repeat_interleave, to keep every shape static
            k = k[:, :, None].expand(B, KV, H // KV, S, hd).reshape(B, H, S, hd)
            v = v[:, :, None].expand(B, KV, H // KV, S, hd).reshape(B, H, S, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, S, H * hd))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=cfg.dtype)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, **kw)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, **kw)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attention(attention_norm(x))``, then ``x + feed_forward(ffn_norm(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=cfg.dtype)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=cfg.dtype)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]``; ``forward`` returns the mean LM loss.
    ``block`` is the class of one layer (a subclass may lay its layers out otherwise)."""

    block: type = TransformerBlock

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.dtype)
        self.layers = nn.ModuleList(self.block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=cfg.dtype)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) weights, unit norms, fresh RoPE tables (needed after ``to_empty``)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]`` for int64 ``tokens [B, S]`` (``S <= max_seq_len``)."""
        S = tokens.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets`` is ``[B, S]`` int64."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build(cfg: LlamaConfig, device: torch.device | str | None = None) -> Llama:
    """Construct a ``Llama`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(Llama, cfg, device)


def example_inputs(
    cfg: LlamaConfig, batch: int = 2, seq: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, both ``[batch, seq]`` int64; ``seq`` defaults to ``max_seq_len``."""
    seq = cfg.max_seq_len if seq is None else seq
    if seq > cfg.max_seq_len:
        raise ValueError(f"seq {seq} exceeds max_seq_len {cfg.max_seq_len}")
    return token_pair(cfg.vocab_size, batch, seq, device)


make = family_make(LlamaConfig, build, example_inputs, has_seq=True)
