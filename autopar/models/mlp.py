"""A plain multi-layer perceptron classifier: the simplest model to shard (Linear chains)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make, labelled

PRESETS: dict[str, dict] = {
    "tiny": dict(in_dim=16, hidden_dim=32, n_layers=2, num_classes=4),
    "small": dict(in_dim=256, hidden_dim=1024, n_layers=4, num_classes=10),
    "large": dict(in_dim=4096, hidden_dim=16384, n_layers=8, num_classes=1000),
}


@dataclass
class MLPConfig:
    """``n_layers`` hidden Linear+activation layers of width ``hidden_dim``, then a Linear head."""

    in_dim: int = 16
    hidden_dim: int = 32
    n_layers: int = 2
    num_classes: int = 4
    activation: str = "gelu"  # "gelu" or "relu"
    bias: bool = True
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "MLPConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown MLP preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


class MLP(nn.Module):
    """``layers.{i}`` (Linear) -> activation, repeated; ``head`` Linear; cross-entropy loss."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        if cfg.activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be 'gelu' or 'relu', not {cfg.activation!r}")
        self.cfg = cfg
        kw = dict(bias=cfg.bias, dtype=cfg.dtype)
        dims = [cfg.in_dim] + [cfg.hidden_dim] * cfg.n_layers
        self.layers = nn.ModuleList(nn.Linear(a, b, **kw) for a, b in zip(dims[:-1], dims[1:]))
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.head = nn.Linear(dims[-1], cfg.num_classes, **kw)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[batch, num_classes]`` for float inputs ``[batch, in_dim]``."""
        for layer in self.layers:
            x = self.act(layer(x))
        return self.head(x)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits against int64 class ``targets`` ``[batch]``."""
        return F.cross_entropy(self.logits(x), targets)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter (e.g. after ``to_empty`` from meta)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()


def build(cfg: MLPConfig, device: torch.device | str | None = None) -> MLP:
    """Construct an ``MLP`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(MLP, cfg, device)


def example_inputs(
    cfg: MLPConfig, batch: int = 2, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [batch, in_dim] float, targets [batch] int64)``, deterministic (generator seed 0)."""
    return labelled((batch, cfg.in_dim), cfg.dtype, cfg.num_classes, device)


make = family_make(MLPConfig, build, example_inputs, has_seq=False)
