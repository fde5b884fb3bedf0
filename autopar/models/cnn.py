"""ResNet-style CNN (basic blocks): convolutions, BatchNorm buffers and residual adds to shard."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import build_on, family_make, labelled

PRESETS: dict[str, dict] = {
    "tiny": dict(in_channels=3, widths=(8, 16), blocks=(1, 1), num_classes=10, image_size=16),
    "resnet18-cifar": dict(widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), num_classes=10, image_size=32),
    "resnet18": dict(
        widths=(64, 128, 256, 512), blocks=(2, 2, 2, 2), num_classes=1000, image_size=224,
        stem_kernel=7, stem_stride=2,
    ),
    "resnet34": dict(
        widths=(64, 128, 256, 512), blocks=(3, 4, 6, 3), num_classes=1000, image_size=224,
        stem_kernel=7, stem_stride=2,
    ),
}


@dataclass
class CNNConfig:
    """Stage ``i`` has ``blocks[i]`` basic blocks of width ``widths[i]``; stages after the first halve H, W."""

    in_channels: int = 3
    widths: tuple[int, ...] = (8, 16)
    blocks: tuple[int, ...] = (1, 1)
    num_classes: int = 10
    image_size: int = 16
    stem_kernel: int = 3
    stem_stride: int = 1
    dtype: torch.dtype = torch.float32

    @classmethod
    def preset(cls, name: str = "tiny", **overrides) -> "CNNConfig":
        """The named size from ``PRESETS`` with ``overrides`` applied."""
        if name not in PRESETS:
            raise KeyError(f"unknown CNN preset {name!r}; choose from {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _conv(cin: int, cout: int, k: int, stride: int, dtype: torch.dtype) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False, dtype=dtype)


class BasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut(x))``; 1x1 conv+BN shortcut on shape change."""

    def __init__(self, cin: int, cout: int, stride: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv1 = _conv(cin, cout, 3, stride, dtype)
        self.bn1 = nn.BatchNorm2d(cout, dtype=dtype)
        self.conv2 = _conv(cout, cout, 3, 1, dtype)
        self.bn2 = nn.BatchNorm2d(cout, dtype=dtype)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv(cin, cout, 1, stride, dtype), nn.BatchNorm2d(cout, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return F.relu(out + skip)


class ResNet(nn.Module):
    """Images ``[B, C, H, W]`` -> logits ``[B, num_classes]``; ``forward`` returns the mean loss."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        if len(cfg.widths) != len(cfg.blocks):
            raise ValueError(f"widths {cfg.widths} and blocks {cfg.blocks} differ in length")
        self.cfg = cfg
        w0 = cfg.widths[0]
        self.conv1 = _conv(cfg.in_channels, w0, cfg.stem_kernel, cfg.stem_stride, cfg.dtype)
        self.bn1 = nn.BatchNorm2d(w0, dtype=cfg.dtype)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = w0
        for i, (width, n) in enumerate(zip(cfg.widths, cfg.blocks)):  # torchvision names: layer1, ...
            stride = 1 if i == 0 else 2
            blocks = [BasicBlock(cin if j == 0 else width, width, stride if j == 0 else 1, cfg.dtype) for j in range(n)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
            cin = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, cfg.num_classes, dtype=cfg.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter and BatchNorm statistic (e.g. after ``to_empty``)."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear, nn.BatchNorm2d)):
                m.reset_parameters()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]`` for float images ``[B, in_channels, H, W]``."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(len(self.cfg.widths)):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy against int64 class ``targets [B]``."""
        return F.cross_entropy(self.logits(x), targets)


def build(cfg: CNNConfig, device: torch.device | str | None = None) -> ResNet:
    """Construct a ``ResNet`` directly on ``device`` (``"meta"`` allocates nothing)."""
    return build_on(ResNet, cfg, device)


def example_inputs(
    cfg: CNNConfig, batch: int = 2, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images [batch, C, image_size, image_size] float, targets [batch] int64)``, seed 0."""
    return labelled((batch, cfg.in_channels, cfg.image_size, cfg.image_size), cfg.dtype, cfg.num_classes, device)


make = family_make(CNNConfig, build, example_inputs, has_seq=False)
