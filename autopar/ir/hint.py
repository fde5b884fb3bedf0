"""``autopar.hint(x, placements)``: a placement constraint written inside a model's forward.

The hint is a custom op, ``autopar::hint(Tensor x, str placements) -> Tensor``, so it survives
capture as a node of the graph (``autopar.hint.default``) carrying its placement string. Run eagerly
on one device it is an identity (a copy: custom ops may not return an alias of an input), and its
gradient passes through unchanged.

``placements`` is a positional string (``"S(0), B"``, one entry per mesh axis), a by-name string
(``"dp=S(0)"``, axes not named are ``B``) or a sequence of our placement objects or DTensor
placements. It is normalised to a canonical string at the call and its syntax checked there: a
malformed string raises :class:`autopar.ir.placement.PlacementError` in the user's forward, not
later in the planner. The mesh is not known yet, so the number of entries and the axis names are
checked when the plan is made.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from autopar.errors import ArgumentError
from autopar.ir.placement import PlacementError, format_placements, normalize, parse_one, split_top_level

__all__ = ["hint", "canonical_placements"]


@torch.library.custom_op("autopar::hint", mutates_args=())
def _hint_op(x: torch.Tensor, placements: str) -> torch.Tensor:
    return x.clone()


@_hint_op.register_fake
def _hint_fake(x: torch.Tensor, placements: str) -> torch.Tensor:
    return torch.empty_like(x)


def _hint_backward(ctx, grad: torch.Tensor):
    return grad, None


_hint_op.register_autograd(_hint_backward)


def canonical_placements(placements: Union[str, Sequence]) -> str:
    """The canonical text of ``placements``: ``"S(0), B"`` or ``"dp=S(0), tp=B"``.

    Raises PlacementError for anything that is not a placement."""
    if isinstance(placements, str):
        if not placements.strip():
            raise PlacementError("empty placement string: expected e.g. 'S(0), B' or 'dp=S(0)'")
        parts = split_top_level(placements)
        named = ["=" in p for p in parts]
        if any(named):
            if not all(named):
                raise PlacementError(f"placement {placements!r} mixes named (axis=...) and positional entries")
            out, seen = [], set()
            for p in parts:
                name, _, value = p.partition("=")
                name = name.strip()
                if not name.isidentifier():
                    raise PlacementError(f"placement {placements!r}: {name!r} is not a mesh axis name")
                if name in seen:
                    raise PlacementError(f"placement {placements!r} names mesh axis {name!r} twice")
                seen.add(name)
                out.append(f"{name}={parse_one(value)}")
            return ", ".join(out)
        return format_placements([parse_one(p) for p in parts])
    try:
        return format_placements(normalize(placements))
    except PlacementError:
        raise
    except Exception as e:  # not iterable, unknown objects
        raise PlacementError(
            f"cannot use {placements!r} as placements: give a string like 'S(0), B' or 'dp=S(0)', "
            "or a sequence of placements (autopar S/B/P or DTensor Shard/Replicate/Partial)"
        ) from e


def hint(tensor: torch.Tensor, placements: Union[str, Sequence]) -> torch.Tensor:
    """Constrain ``tensor`` to ``placements`` in the plan; returns a tensor equal to ``tensor``.

    Use the returned value (``x = autopar.hint(x, "dp=S(0)")``): the constraint applies to it.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentError(f"autopar.hint expects a tensor, got {type(tensor).__name__}: hint a tensor of forward, "
                            "x = autopar.hint(x, 'dp=S(0)')")
    return torch.ops.autopar.hint(tensor, canonical_placements(placements))
