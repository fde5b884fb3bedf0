"""Packing a gradient bucket into one flat buffer and cutting it back, as lowered programs call it.

A bucket of n gradients written op by op costs 2n + 2 program ops per step (a reshape of each
gradient, the concatenation, the split and a reshape of each piece), a Python-level dispatch each
on CPU. These two calls do the same in one call each: ``flatten`` is torch's C++
``flatten_dense_tensors`` (each gradient made contiguous and concatenated as a flat vector: the one
copy a bucket needs), ``unflatten`` cuts the reduced buffer into views of the gradients' shapes.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def flatten(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new flat buffer holding ``xs`` one after another (each as a contiguous vector). Always a
    new tensor, never a view of an input: callers reduce it in place."""
    if len(xs) == 1:  # torch returns a view of a lone tensor
        return xs[0].reshape(-1).clone()
    return torch._C._nn.flatten_dense_tensors(list(xs))


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat``, one per shape, cut in order (the inverse of ``flatten``)."""
    pieces = flat.split([math.prod(s) for s in shapes])
    return [p.view(s) for p, s in zip(pieces, shapes)]


__all__ = ["flatten", "unflatten"]
