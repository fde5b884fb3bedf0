"""Top-k mixture-of-experts with static shapes: capacity-limited one-hot dispatch, batched experts.

Every shape depends only on the config and input shape, never on routing decisions, so the layer
traces under fake tensors: routing is expressed as dense ``[T, E, C]`` dispatch/combine tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make, token_pair

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=64, dim=32, ffn_dim=64, n_experts=4, top_k=2, seq_len=16),
    "small": dict(vocab_size=1024, dim=256, ffn_dim=1024, n_experts=8, top_k=2, n_layers=2, seq_len=128),
    # One Mixtral-8x7B-shaped expert layer (8 experts of 4096 -> 14336 -> 4096, top-2).
    "large": dict(vocab_size=32000, dim=4096, ffn_dim=14336, n_experts=8, top_k=2, seq_len=1024),
}


@dataclass
class MoEConfig:
    """``n_layers`` residual MoE feed-forward layers between an embedding and a vocabulary head."""

    vocab_size: int = 64  # also the number of output classes
    dim: int = 32
    ffn_dim: int = 64
    n_experts: int = 4
    top_k: int = 2
    capacity_factor: float = 1.25
    n_layers: int = 1
    seq_len: int = 16  # default sequence length of example inputs
    normalize_gates: bool = True  # renormalise the top-k router probabilities to sum to 1
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "MoEConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown MoE preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def one_hot(idx: torch.Tensor, n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``F.one_hot`` as a comparison with ``arange``: same values, but no range-check asserts."""
    return (idx.unsqueeze(-1) == torch.arange(n, device=idx.device)).to(dtype)


def capacity(cfg: MoEConfig, n_tokens: int) -> int:
    """Slots per expert: ``ceil(capacity_factor * T * k / E)``, at most ``T`` (a token picks an expert once)."""
    return max(1, min(n_tokens, math.ceil(cfg.capacity_factor * n_tokens * cfg.top_k / cfg.n_experts)))


class MoELayer(nn.Module):
    """Router ``Linear(D, E)`` -> softmax -> top-k; experts ``w1 [E, D, F]``, ``w2 [E, F, D]`` (GELU)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"top_k {cfg.top_k} must be in [1, n_experts={cfg.n_experts}]")
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False, dtype=cfg.dtype)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim, dtype=cfg.dtype))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim, dtype=cfg.dtype))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) per expert matrix, as ``nn.Linear`` would give each expert."""
        self.router.reset_parameters()
        nn.init.uniform_(self.w1, -self.cfg.dim**-0.5, self.cfg.dim**-0.5)
        nn.init.uniform_(self.w2, -self.cfg.ffn_dim**-0.5, self.cfg.ffn_dim**-0.5)

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dispatch, combine)``, both ``[T, E, C]``, for tokens ``x [T, D]``.

        Slots are assigned first-come in (choice rank, token) order, as in GShard/Switch: every
        token's first choice is placed before any second choice. Assignments whose slot index
        reaches ``C`` are dropped by a multiplicative mask.
        """
        T, E, k = x.shape[0], self.cfg.n_experts, self.cfg.top_k
        C = capacity(self.cfg, T)
        probs = F.softmax(self.router(x), dim=-1)
        gates, idx = torch.topk(probs, k, dim=-1)  # [T, k]
        if self.cfg.normalize_gates:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        choice = one_hot(idx, E)  # [T, k, E] int64
        ranked = choice.transpose(0, 1).reshape(k * T, E)  # rank-major order
        pos = ((torch.cumsum(ranked, dim=0) - 1) * ranked).sum(dim=-1)  # slot in its expert
        pos = pos.reshape(k, T).transpose(0, 1)  # [T, k]
        keep = (pos < C).to(x.dtype)
        slot = one_hot(pos.clamp(max=C - 1), C, x.dtype)  # [T, k, C]
        chosen = choice.to(x.dtype) * keep.unsqueeze(-1)  # [T, k, E]
        dispatch = torch.einsum("tke,tkc->tec", chosen, slot)
        combine = torch.einsum("tke,tkc->tec", chosen * gates.unsqueeze(-1), slot)
        return dispatch, combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        dispatch, combine = self.routing(x)
        expert_in = torch.einsum("tec,td->ecd", dispatch, x)  # [E, C, D]
        h = F.gelu(torch.bmm(expert_in, self.w1))
        out = torch.bmm(h, self.w2)  # [E, C, D]
        return torch.einsum("tec,ecd->td", combine, out).reshape(shape)


class MoEBlock(nn.Module):
    """``x + moe(norm(x))``."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, dtype=cfg.dtype)
        self.moe = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEModel(nn.Module):
    """``embed`` -> ``layers.{i}`` (MoE blocks) -> ``norm`` -> ``head``; per-token cross-entropy."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.dtype)
        self.layers = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, dtype=cfg.dtype)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, dtype=cfg.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter (e.g. after ``to_empty`` from meta)."""
        for m in self.modules():
            if isinstance(m, (nn.Embedding, nn.LayerNorm, nn.Linear, MoELayer)):
                m.reset_parameters()

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, S, vocab_size]`` for int64 ``tokens [B, S]``."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy against int64 ``targets [B, S]``."""
        logits = self.logits(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def build(cfg: MoEConfig, device: torch.device | str | None = None) -> MoEModel:
    """Construct a ``MoEModel`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(MoEModel, cfg, device)


def example_inputs(
    cfg: MoEConfig, batch: int = 2, seq: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, both ``[batch, seq]`` int64; ``seq`` defaults to ``cfg.seq_len``."""
    seq = cfg.seq_len if seq is None else seq
    return token_pair(cfg.vocab_size, batch, seq, device)


make = family_make(MoEConfig, build, example_inputs, has_seq=True)
