"""What every family of the model zoo shares: building on a device, example inputs, ``make``."""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

Device = Optional[torch.device | str]


def build_on(model_cls: type, cfg, device: Device):
    """Construct ``model_cls(cfg)`` directly on ``device`` (``"meta"`` allocates nothing)."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return model_cls(cfg)


def token_pair(vocab: int, batch: int, seq: int, device: Device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, targets)``: int64 ``[batch, seq]`` ids below ``vocab``, from a generator seeded 0."""
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, vocab, (batch, seq), generator=g, device="cpu")
    tgt = torch.randint(0, vocab, (batch, seq), generator=g, device="cpu")
    return tok.to(device or "cpu"), tgt.to(device or "cpu")


def labelled(shape: tuple[int, ...], dtype: torch.dtype, classes: int, device: Device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, targets)``: float ``x`` of ``shape`` and int64 class ids ``[shape[0]]``, seeded 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=dtype, device="cpu")
    y = torch.randint(0, classes, (shape[0],), generator=g, device="cpu")
    return x.to(device or "cpu"), y.to(device or "cpu")


def family_make(config_cls: type, build: Callable, example_inputs: Callable, has_seq: bool) -> Callable:
    """The family's ``make(size, batch, seq, device, dtype, input_device, **overrides)``.

    Inputs of a model built on ``meta`` stay on CPU (they are small, and capture needs values);
    ``input_device`` puts them elsewhere.
    """

    def make(
        size: str = "tiny",
        batch: int = 2,
        seq: int | None = None,
        device: Device = None,
        dtype: torch.dtype = torch.float32,
        input_device: Device = None,
        **overrides,
    ):
        cfg = config_cls.preset(size, dtype=dtype, **overrides)
        if input_device is None:
            input_device = "cpu" if device is not None and torch.device(device).type == "meta" else device
        extra = (seq,) if has_seq else ()
        return build(cfg, device), example_inputs(cfg, batch, *extra, device=input_device)

    make.__doc__ = f"``(model, example_inputs)`` for a {config_cls.__name__} preset" + (
        "." if has_seq else "; ``seq`` is ignored (no sequence dim)."
    )
    return make
