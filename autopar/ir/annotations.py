"""Annotations that arrive as DTensors: a parameter or example input that already is a ``DTensor``
keeps its placements, as a hard constraint like a hint (``hints=`` or ``autopar.hint``).

``dtensor_hints`` reads them into the ``hints=`` form (FQN or input key -> placement text);
``merge_hints`` joins them with the user's, refusing contradictions. Capture sees a DTensor as a
tensor of its global shape, so nothing else needs to know.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from autopar.ir.placement import format_placements, from_dtensor, normalize


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def dtensor_hints(model: torch.nn.Module, args: tuple, kwargs: Mapping, mesh_shape: tuple[int, ...]) -> dict[str, str]:
    """Hints for every parameter, buffer and top-level example input that is a DTensor."""
    from autopar.errors import HintError

    found: dict[str, Any] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if _is_dtensor(t):
            found[name] = t
    for i, a in enumerate(args):
        if _is_dtensor(a):
            found[f"input:{i}"] = a
    for k, v in kwargs.items():
        if _is_dtensor(v):
            found[k] = v
    out = {}
    for key, t in sorted(found.items()):
        shape = tuple(t.device_mesh.shape)
        if shape != tuple(mesh_shape):
            raise HintError(f"{key!r} is a DTensor on a device mesh of shape {shape}, but the plan's mesh is "
                            f"{tuple(mesh_shape)}: redistribute it onto a mesh of the plan's shape, or pass a plain tensor")
        out[key] = format_placements(from_dtensor(t.placements))
    return out


def merge_hints(user: Optional[Mapping[str, Any]], extra: Mapping[str, str]) -> Optional[dict]:
    """The user's hints plus ``extra``; the same key with different placements is an error."""
    from autopar.errors import HintError

    if not extra:
        return dict(user) if user else user
    merged = dict(user or {})
    for key, text in extra.items():
        if key in merged and normalize(merged[key]) != normalize(text):
            raise HintError(f"{key!r} is a DTensor placed {text!r}, but hints= asks for "
                            f"{format_placements(normalize(merged[key]))!r}: drop one of the two")
        merged[key] = text
    return merged


__all__ = ["dtensor_hints", "merge_hints"]
