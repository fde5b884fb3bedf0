"""GPT-2/GPT-3 style decoder: learned positions, pre-LayerNorm blocks, causal SDPA, tied LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar._torch_compat import after_conversion

from .common import build_on, family_make, token_pair

_GPT3 = dict(vocab_size=50304, block_size=2048)
# GPT-3 family shapes (Brown et al. 2020, table 2.1), with head counts that divide n_embd
# (Megatron's choices); 30B and 70B follow OPT-30B and the common 80x8192 shape.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64),
    "125M": dict(_GPT3, n_layer=12, n_head=12, n_embd=768),
    "350M": dict(_GPT3, n_layer=24, n_head=16, n_embd=1024),
    "1.3B": dict(_GPT3, n_layer=24, n_head=16, n_embd=2048),
    "2.7B": dict(_GPT3, n_layer=32, n_head=32, n_embd=2560),
    "6.7B": dict(_GPT3, n_layer=32, n_head=32, n_embd=4096),
    "13B": dict(_GPT3, n_layer=40, n_head=40, n_embd=5120),
    "30B": dict(_GPT3, n_layer=48, n_head=56, n_embd=7168),
    "70B": dict(_GPT3, n_layer=80, n_head=64, n_embd=8192),
}


@dataclass
class GPTConfig:
    """Shape of a GPT; the defaults are the ``"tiny"`` test size."""

    vocab_size: int = 128
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "GPTConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown GPT preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _dropout(p: float) -> nn.Module:
    # p == 0 gets no module at all, so no random ops appear in a traced training graph.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Fused ``qkv`` projection, causal SDPA over ``n_head`` heads, output ``proj``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd {cfg.n_embd} is not divisible by n_head {cfg.n_head}")
        kw = dict(bias=cfg.bias, dtype=cfg.dtype)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, **kw)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, **kw)
        self.resid_dropout = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    """``fc`` (4x) -> GELU -> ``proj``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        kw = dict(bias=cfg.bias, dtype=cfg.dtype)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, **kw)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, **kw)
        self.dropout = _dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN residual block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        kw = dict(bias=cfg.bias, dtype=cfg.dtype)
        self.ln_1 = nn.LayerNorm(cfg.n_embd, **kw)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, **kw)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# Conversions such as ``to_empty`` may replace the two tied references separately;
# re-tie afterwards so the model keeps one shared embedding/head matrix.
@after_conversion(lambda gpt: setattr(gpt.lm_head, "weight", gpt.wte.weight))
class GPT(nn.Module):
    """Token ids ``[B, T]`` -> logits ``[B, T, vocab]``; ``forward`` returns the mean LM loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, dtype=cfg.dtype)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, dtype=cfg.dtype)
        self.drop = _dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias, dtype=cfg.dtype)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        self.lm_head.weight = self.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by depth."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.proj.weight, mean=0.0, std=std)
            nn.init.normal_(blk.mlp.proj.weight, mean=0.0, std=std)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for int64 token ids ``[B, T]`` (``T <= block_size``)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy; ``targets`` is ``[B, T]`` int64."""
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build(cfg: GPTConfig, device: torch.device | str | None = None) -> GPT:
    """Construct a ``GPT`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(GPT, cfg, device)


def example_inputs(
    cfg: GPTConfig, batch: int = 2, seq: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)``, both ``[batch, seq]`` int64; ``seq`` defaults to ``block_size``."""
    seq = cfg.block_size if seq is None else seq
    if seq > cfg.block_size:
        raise ValueError(f"seq {seq} exceeds block_size {cfg.block_size}")
    return token_pair(cfg.vocab_size, batch, seq, device)


make = family_make(GPTConfig, build, example_inputs, has_seq=True)
