"""Dropless token-choice mixture of experts: every token reaches each of its top-k experts, whatever
the load (no capacity, no dropped token), optionally beside always-on shared experts.

Shapes stay static although the routing is data-dependent: the ``T * k`` (token, expert) pairs are
sorted by expert, each expert's rows are one contiguous group whose end ``offs`` (cumulative counts)
is a tensor, and the experts run as one grouped matrix product over the groups (``F.grouped_mm``,
or, with ``experts="batched"``, a batched product over per-row gathered weights: the same values in
every dtype, at the memory of one weight copy per row). The combine adds each pair's gated output
back at its token (``index_add``). The layer also returns the Switch-Transformer load-balancing loss
``E * sum_e f_e * p_e`` (``f_e``: share of pairs routed to ``e``, ``p_e``: mean router
probability), which the model adds to the loss at ``aux_loss_coef``.

``F.grouped_mm``'s fake-tensor kernel takes bf16 only on torch 2.13, so ``experts="auto"`` (the
default) runs grouped products in bf16 and the batched form in every other dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make, token_pair
from .moe import one_hot

PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=64, dim=32, ffn_dim=32, n_experts=4, top_k=2, seq_len=16),
    "small": dict(vocab_size=1024, dim=256, ffn_dim=512, n_experts=8, top_k=2, n_layers=2, seq_len=128),
    # One Mixtral-8x7B-shaped expert layer (8 experts of 4096 -> 14336 -> 4096, top-2).
    "large": dict(vocab_size=32000, dim=4096, ffn_dim=14336, n_experts=8, top_k=2, seq_len=1024),
}

EXPERTS = ("auto", "grouped_mm", "batched")


@dataclass
class DroplessConfig:
    """``n_layers`` residual dropless MoE feed-forward layers between an embedding and a head."""

    vocab_size: int = 64  # also the number of output classes
    dim: int = 32
    ffn_dim: int = 32  # per routed expert
    n_experts: int = 4
    top_k: int = 2
    n_shared: int = 0  # always-on shared experts (DeepSeek / Qwen-MoE style), each ffn_dim wide
    n_layers: int = 1
    seq_len: int = 16
    normalize_gates: bool = True
    aux_loss_coef: float = 0.01
    experts: str = "auto"  # "grouped_mm", "batched" (any dtype), or "auto": grouped_mm in bf16 only
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "DroplessConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown dropless MoE preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def route(probs: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, ...]:
    """``(order, experts, counts, gates)`` for router probabilities ``probs [T, E]``: ``order [T*k]``
    lists the (token, choice) pairs, flattened as ``t * k + j``, sorted by expert; ``experts [T*k]``
    the expert of each sorted pair; ``counts [E]`` the pairs per expert; ``gates [T*k]`` each
    pair's weight in the same sorted order."""
    gates, idx = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if normalize:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    flat = idx.reshape(-1)
    experts, order = torch.sort(flat)
    counts = one_hot(flat, probs.shape[-1]).sum(0)
    return order, experts, counts, gates.reshape(-1).index_select(0, order)


def balance_loss(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's auxiliary loss ``E * sum_e f_e * p_e`` (1 at a perfectly even routing)."""
    n_experts = probs.shape[-1]
    share = counts.to(probs.dtype) / counts.sum()
    return n_experts * (share * probs.mean(0)).sum()


class DroplessExperts(nn.Module):
    """``E`` GELU experts ``w1 [E, D, F]``, ``w2 [E, F, D]`` applied to expert-sorted rows."""

    def __init__(self, cfg: DroplessConfig) -> None:
        super().__init__()
        if cfg.experts not in EXPERTS:
            raise ValueError(f"DroplessConfig.experts {cfg.experts!r}: choose from {EXPERTS}")
        self.kind = cfg.experts
        if self.kind == "auto":
            self.kind = "grouped_mm" if cfg.dtype == torch.bfloat16 else "batched"
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim, dtype=cfg.dtype))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim, dtype=cfg.dtype))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Uniform(+-1/sqrt(fan_in)) per expert matrix."""
        nn.init.uniform_(self.w1, -self.w1.shape[1] ** -0.5, self.w1.shape[1] ** -0.5)
        nn.init.uniform_(self.w2, -self.w2.shape[1] ** -0.5, self.w2.shape[1] ** -0.5)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert: ``rows [R, D]`` sorted by expert, ``counts [E]`` rows per
        expert, ``experts [R]`` each row's expert (used by the batched form)."""
        if self.kind == "grouped_mm":
            offs = torch.cumsum(counts, 0).to(torch.int32)
            h = F.gelu(F.grouped_mm(rows, self.w1, offs=offs))
            return F.grouped_mm(h, self.w2, offs=offs)
        h = F.gelu(torch.bmm(rows.unsqueeze(1), self.w1.index_select(0, experts)))
        return torch.bmm(h, self.w2.index_select(0, experts)).squeeze(1)


class DroplessMoE(nn.Module):
    """Router ``Linear(D, E)`` -> softmax -> top-k -> sort by expert -> experts -> gated combine,
    plus ``n_shared`` always-on experts. ``forward`` returns ``(y, balance loss)``."""

    def __init__(self, cfg: DroplessConfig) -> None:
        super().__init__()
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"top_k {cfg.top_k} must be in [1, n_experts={cfg.n_experts}]")
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False, dtype=cfg.dtype)
        self.experts = DroplessExperts(cfg)
        self.shared = None
        if cfg.n_shared:
            width = cfg.n_shared * cfg.ffn_dim
            self.shared = nn.Sequential(nn.Linear(cfg.dim, width, bias=False, dtype=cfg.dtype), nn.GELU(),
                                        nn.Linear(width, cfg.dim, bias=False, dtype=cfg.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        k = self.cfg.top_k
        probs = F.softmax(self.router(x), dim=-1)
        order, experts, counts, gates = route(probs, k, self.cfg.normalize_gates)
        token = order // k  # the token of each sorted pair
        y = self.experts(x.index_select(0, token), counts, experts)
        out = torch.zeros_like(x).index_add(0, token, y * gates.unsqueeze(-1))
        if self.shared is not None:
            out = out + self.shared(x)
        return out.reshape(shape), balance_loss(probs, counts)


class DroplessBlock(nn.Module):
    """``x + moe(norm(x))``; returns the balance loss beside."""

    def __init__(self, cfg: DroplessConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, dtype=cfg.dtype)
        self.moe = DroplessMoE(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, aux = self.moe(self.norm(x))
        return x + y, aux


class DroplessModel(nn.Module):
    """``embed`` -> ``layers.{i}`` -> ``norm`` -> ``head``; mean cross-entropy plus
    ``aux_loss_coef`` times the layers' mean balance loss."""

    def __init__(self, cfg: DroplessConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=cfg.dtype)
        self.layers = nn.ModuleList(DroplessBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, dtype=cfg.dtype)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, dtype=cfg.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter (e.g. after ``to_empty`` from meta)."""
        for m in self.modules():
            if isinstance(m, (nn.Embedding, nn.LayerNorm, nn.Linear, DroplessExperts)):
                m.reset_parameters()

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy against int64 ``targets [B, S]`` plus the weighted balance loss."""
        x = self.embed(tokens)
        aux = []
        for layer in self.layers:
            x, a = layer(x)
            aux.append(a)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return loss + self.cfg.aux_loss_coef * torch.stack(aux).mean()


def build(cfg: DroplessConfig, device: torch.device | str | None = None) -> DroplessModel:
    """Construct a ``DroplessModel`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(DroplessModel, cfg, device)


def example_inputs(
    cfg: DroplessConfig, batch: int = 2, seq: int | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``, both ``[batch, seq]`` int64; ``seq`` defaults to ``cfg.seq_len``."""
    seq = cfg.seq_len if seq is None else seq
    return token_pair(cfg.vocab_size, batch, seq, device)


make = family_make(DroplessConfig, build, example_inputs, has_seq=True)
