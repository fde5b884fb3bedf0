"""A small zoo of configurable test models (MLP, GPT, LLaMA, ResNet, MoE, dropless MoE; ``llama_loop``: LLaMA written
with its layer code in the parent's ``forward``, as user code often is).

Each family module has a ``@dataclass`` config with ``PRESETS``, ``build(cfg, device)``,
``example_inputs(cfg, batch, ...)`` and ``make(size, batch, ...)``; every model's
``forward(inputs, targets)`` returns a scalar mean loss and traces with static shapes.

    model, inputs = autopar.models.make("gpt", size="tiny", batch=4)
    loss = model(*inputs)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from . import cnn, gpt, llama, llama_loop, mlp, moe, moe_dropless
from .cnn import CNNConfig, ResNet
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import MLP, MLPConfig
from .moe import MoEConfig, MoEModel
from .moe_dropless import DroplessConfig, DroplessModel

MODELS: dict[str, Callable[..., tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": mlp.make,
    "gpt": gpt.make,
    "llama": llama.make,
    "llama_loop": llama_loop.make,
    "cnn": cnn.make,
    "moe": moe.make,
    "moe_dropless": moe_dropless.make,
}

PRESETS: dict[str, dict[str, dict]] = {
    "mlp": mlp.PRESETS,
    "gpt": gpt.PRESETS,
    "llama": llama.PRESETS,
    "llama_loop": llama_loop.PRESETS,
    "cnn": cnn.PRESETS,
    "moe": moe.PRESETS,
    "moe_dropless": moe_dropless.PRESETS,
}


def make(
    family: str,
    size: str = "tiny",
    batch: int = 2,
    seq: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model, example_inputs)`` for ``family`` at preset ``size``; ``overrides`` edit the config.

    ``device="meta"`` builds the model without allocating and returns the (small) inputs on CPU;
    pass ``input_device=`` to place the inputs elsewhere. ``seq`` is ignored by "mlp" and "cnn".
    """
    if family not in MODELS:
        raise KeyError(f"unknown model family {family!r}; choose from {sorted(MODELS)}")
    return MODELS[family](size=size, batch=batch, seq=seq, device=device, dtype=dtype, **overrides)


def num_params(model: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once); works on meta."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "MODELS", "PRESETS", "make", "num_params",
    "mlp", "gpt", "llama", "llama_loop", "cnn", "moe", "moe_dropless",
    "MLP", "MLPConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig",
    "ResNet", "CNNConfig", "MoEModel", "MoEConfig", "DroplessModel", "DroplessConfig",
]
