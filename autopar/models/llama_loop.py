"""LLaMA written as user code often is: the decoder's ``forward`` loops over ``self.layers`` and does
RoPE, attention and the residual adds itself; the layer modules only hold the linears and norms.

The model computes what ``models.llama`` computes (same config and presets), but its layers' own
ops (RoPE, ``F.scaled_dot_product_attention``, SwiGLU's product, the residual adds) carry the
parent's module path, not the layer's: folding must find the repeated blocks from the graph.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make
from .llama import PRESETS, Llama, LlamaConfig, RMSNorm, example_inputs

__all__ = ["PRESETS", "LoopLayer", "LoopLlama", "build", "example_inputs", "make"]


class LoopLayer(nn.Module):
    """One layer's weights: attention and SwiGLU projections and two norms; no ``forward``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hd = cfg.dim // cfg.n_heads
        kw = {"bias": False, "dtype": cfg.dtype}
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=cfg.dtype)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, **kw)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, **kw)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, **kw)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, **kw)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=cfg.dtype)
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, **kw)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, **kw)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, **kw)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class LoopLlama(Llama):
    """``models.llama.Llama`` with its layers' code in its own ``logits``: every op between the
    layers' linears is the parent's (the weights, their initialisation and the loss are Llama's)."""

    block = LoopLayer

    def __init__(self, cfg: LlamaConfig) -> None:
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads or (cfg.dim // cfg.n_heads) % 2:
            raise ValueError("need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim")
        super().__init__(cfg)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]`` for int64 ``tokens [B, S]`` (``S <= max_seq_len``)."""
        cfg = self.cfg
        B, S = tokens.shape
        H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.dim // cfg.n_heads
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer.attention_norm(h)
            q = _rotate(layer.wq(x).view(B, S, H, hd).transpose(1, 2), cos, sin)
            k = _rotate(layer.wk(x).view(B, S, KV, hd).transpose(1, 2), cos, sin)
            v = layer.wv(x).view(B, S, KV, hd).transpose(1, 2)
            if H != KV:
                k = k[:, :, None].expand(B, KV, H // KV, S, hd).reshape(B, H, S, hd)
                v = v[:, :, None].expand(B, KV, H // KV, S, hd).reshape(B, H, S, hd)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + layer.wo(y.transpose(1, 2).reshape(B, S, H * hd))
            x = layer.ffn_norm(h)
            h = h + layer.w2(F.silu(layer.w1(x)) * layer.w3(x))
        return self.output(self.norm(h))


def build(cfg: LlamaConfig, device: torch.device | str | None = None) -> LoopLlama:
    """Construct a ``LoopLlama`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(LoopLlama, cfg, device)


make = family_make(LlamaConfig, build, example_inputs, has_seq=True)
