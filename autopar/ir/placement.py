"""SBP placements: how one tensor lies on one mesh axis, and tuples of them over a whole mesh.

Per mesh axis a tensor is ``S(d)`` (split along tensor dim ``d``), ``B`` (broadcast: every device
holds all of it) or ``P`` (partial: every device holds an addend; ``P(max)``/``P(min)`` for the other
reductions). These are one-to-one with DTensor's ``Shard``, ``Replicate`` and ``Partial``.

Uneven sizes follow DTensor's ``Shard``: every piece is ``ceil(size / n)`` long except at the end,
which holds the remainder and then empty pieces (5 over 4 devices: 2, 2, 1, 0). ``S(0), S(0)`` on two
axes is nested in mesh-axis order: split over axis 0, then each piece over axis 1.

``Z(d)`` (``Balanced``) is the load-balanced split of a causal sequence: dim ``d`` is cut into
``2n`` equal chunks and the device of rank ``r`` holds chunks ``r`` and ``2n-1-r``, in that order
(one from the front, its mirror from the back), so every device holds the same causal attention
work. It is ``S(d)`` of the tensor with its chunks reordered (``zigzag``), which is how every
shape and volume computation treats it (``Balanced`` is a ``Split``); the offsets differ, so code
that reads a device's offset along ``d`` refuses it. It splits a dim over one mesh axis only, into
equal chunks.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence, Union

from autopar.errors import PlacementError


@dataclass(frozen=True, order=True)
class Split:
    """``S(dim)``: the tensor is cut along ``dim`` across the axis's devices."""

    dim: int

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True, order=True)
class Broadcast:
    """``B``: every device on the axis holds the whole tensor."""

    def __str__(self) -> str:
        return "B"


REDUCE_OPS = ("sum", "max", "min")


@dataclass(frozen=True, order=True)
class Partial:
    """``P``: every device holds a part; the tensor is their reduction (``sum``, ``max`` or ``min``)."""

    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in REDUCE_OPS:
            raise PlacementError(f"Partial reduce must be one of {REDUCE_OPS}, got {self.reduce!r}")

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


Placement = Union[Split, Broadcast, Partial]
#: A placement over every axis of a mesh, in mesh-axis order.
Placements = tuple[Placement, ...]


@dataclass(frozen=True, order=True)
class Balanced(Split):
    """``Z(dim)``: ``dim`` cut into ``2n`` chunks; rank ``r`` holds chunks ``r`` and ``2n-1-r``."""

    def __str__(self) -> str:
        return f"Z({self.dim})"


B = Broadcast()
P = Partial()
S = Split


# ---------------------------------------------------------------------------------------------
# Text form


_ONE = re.compile(r"^\s*(?:S\s*\(\s*(-?\d+)\s*\)|(B)|(R)|P\s*(?:\(\s*(sum|max|min)\s*\))?|Z\s*\(\s*(-?\d+)\s*\))\s*$")


def parse_one(text: str) -> Placement:
    """Parse one axis's placement: ``S(1)``, ``B`` (``R`` is accepted as DTensor's name), ``P``,
    ``P(max)``, ``Z(1)`` (the load-balanced split)."""
    m = _ONE.match(text)
    if not m:
        raise PlacementError(
            f"cannot parse placement {text.strip()!r}: expected S(<dim>), Z(<dim>), B or P (or P(max), P(min))"
        )
    if m.group(5) is not None:
        return Balanced(int(m.group(5)))
    if m.group(1) is not None:
        return Split(int(m.group(1)))
    if m.group(2) or m.group(3):
        return B
    return Partial(m.group(4) or "sum")


def split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (``"S(0), B"`` -> ``["S(0)", " B"]``)."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse(text: str | Sequence, axis_names: Sequence[str] | None = None, ndim: int | None = None) -> Placements:
    """Parse a placement for a whole mesh.

    Positional form: ``"S(0), B"``, one entry per mesh axis in mesh order. By-name form:
    ``"dp=S(0)"`` or ``"dp=S(0), tp=S(1)"``; axes not named are ``B``, so an annotation in model code
    does not tie the model to one mesh shape. ``axis_names`` is needed for the by-name form; ``ndim``
    (or ``len(axis_names)``) checks the positional form's length. A sequence of placement objects or
    DTensor placements is accepted as well.
    """
    if not isinstance(text, str):
        return normalize(text, ndim if ndim is not None else (len(axis_names) if axis_names else None))
    n = ndim if ndim is not None else (len(axis_names) if axis_names is not None else None)
    parts = [p for p in split_top_level(text)]
    if not text.strip():
        raise PlacementError("empty placement string: expected e.g. 'S(0), B' or 'dp=S(0)'")
    named = ["=" in p for p in parts]
    if any(named):
        if not all(named):
            raise PlacementError(f"placement {text!r} mixes named (axis=...) and positional entries")
        if axis_names is None:
            raise PlacementError(f"placement {text!r} names mesh axes, but no mesh axis names are known here")
        out: list[Placement] = [B] * len(axis_names)
        seen = set()
        for p in parts:
            name, _, value = p.partition("=")
            name = name.strip()
            if name not in axis_names:
                raise PlacementError(
                    f"placement {text!r} names mesh axis {name!r}; the mesh has axes {list(axis_names)}"
                )
            if name in seen:
                raise PlacementError(f"placement {text!r} names mesh axis {name!r} twice")
            seen.add(name)
            out[list(axis_names).index(name)] = parse_one(value)
        return tuple(out)
    out = tuple(parse_one(p) for p in parts)
    if n is not None and len(out) != n:
        raise PlacementError(
            f"placement {text!r} has {len(out)} entries but the mesh has {n} axes"
            + (f" ({', '.join(axis_names)})" if axis_names else "")
            + "; give one entry per axis, or name axes as 'axis=S(0)'"
        )
    return out


def format_placements(placements: Sequence[Placement]) -> str:
    """The positional text form, ``"S(0), B"``; ``parse`` reads it back."""
    return ", ".join(str(p) for p in placements)


# ---------------------------------------------------------------------------------------------
# DTensor conversion


def to_dtensor(placements: Sequence[Placement], blocks: Sequence[tuple[int, int]] = ()) -> tuple:
    """Our placements as DTensor placements (``Shard``, ``Replicate``, ``Partial``); a split of a
    dim of ``c`` blocks (``TensorSpec.blocks``) is ``_StridedShard(dim, split_factor=c)`` on every
    axis that splits it (each axis cuts every block of the block it sees)."""
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard

    from autopar._torch_compat import strided_shard

    count = dict(blocks)
    out = []
    for p in placements:
        if isinstance(p, Balanced):
            raise PlacementError(f"{p} (the load-balanced split) has no DTensor placement; reshard it to "
                                 f"S({p.dim}) or B first")
        if isinstance(p, Split) and count.get(p.dim, 1) > 1:
            out.append(strided_shard(p.dim, count[p.dim]))
        elif isinstance(p, Split):
            out.append(Shard(p.dim))
        elif isinstance(p, Broadcast):
            out.append(Replicate())
        elif isinstance(p, Partial):
            out.append(DPartial(p.reduce))
        else:
            raise PlacementError(f"not a placement: {p!r}")
    return tuple(out)


def from_dtensor(placements: Sequence) -> Placements:
    """DTensor placements as ours. ``_StridedShard`` and other exotic kinds are rejected by name."""
    from torch.distributed.tensor import Partial as DPartial
    from torch.distributed.tensor import Replicate, Shard

    out: list[Placement] = []
    for p in placements:
        if type(p) is Shard:
            out.append(Split(p.dim))
        elif isinstance(p, Replicate):
            out.append(B)
        elif isinstance(p, DPartial):
            op = p.reduce_op if isinstance(p.reduce_op, str) else str(p.reduce_op)
            if op == "avg":
                raise PlacementError("DTensor Partial('avg') has no SBP equivalent; use Partial('sum')")
            out.append(Partial(op))
        else:
            raise PlacementError(f"DTensor placement {p!r} has no SBP equivalent (only Shard, Replicate, Partial)")
    return tuple(out)


def normalize(value, ndim: int | None = None) -> Placements:
    """Accept our placements, DTensor placements or a string; return our tuple."""
    if isinstance(value, str):
        return parse(value, ndim=ndim)
    items = tuple(value)
    out: list[Placement] = []
    for p in items:
        if isinstance(p, (Split, Broadcast, Partial)):  # Balanced is a Split
            out.append(p)
        elif isinstance(p, str):
            out.append(parse_one(p))
        else:
            out.extend(from_dtensor([p]))
    if ndim is not None and len(out) != ndim:
        raise PlacementError(f"placement {format_placements(out)!r} has {len(out)} entries but the mesh has {ndim} axes")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# Shard geometry (DTensor's Shard semantics)


def chunk_range(size: int, n: int, i: int) -> tuple[int, int]:
    """Start and length of piece ``i`` of ``n`` when ``size`` elements are split as DTensor's ``Shard``."""
    step = -(-size // n) if size else 0
    start = min(i * step, size)
    stop = min(start + step, size)
    return start, stop - start


def shard_range(size: int, splits: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """Start and length along one dim after nested splits ``[(n_axis, coord), ...]`` in mesh-axis order."""
    start, length = 0, size
    for n, coord in splits:
        off, length = chunk_range(length, n, coord)
        start += off
    return start, length


def local_range(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coords: Sequence[int]
) -> list[tuple[int, int]]:
    """Per tensor dim, the ``(start, length)`` of the block the device at ``coords`` holds."""
    out = []
    for d, size in enumerate(shape):
        splits = [(mesh_shape[a], coords[a]) for a, p in enumerate(placements) if isinstance(p, Split) and p.dim == d]
        out.append(shard_range(size, splits))
    return out


def local_shape(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coords: Sequence[int]
) -> tuple[int, ...]:
    """The shape of the block the device at ``coords`` holds."""
    return tuple(length for _, length in local_range(shape, placements, mesh_shape, coords))


def local_block(t, placements: Sequence[Placement], mesh_shape: Sequence[int], coords: Sequence[int],
                blocks: Sequence[tuple[int, int]] = ()):
    """The block of the whole tensor ``t`` that the device at ``coords`` holds. A ``Partial`` axis
    keeps the value on its first device and the reduction's identity on the others. ``blocks``
    (``TensorSpec.blocks``): dims whose splits cut every block alike."""
    import torch

    if any(isinstance(p, Balanced) for p in placements):
        t, placements = balanced_as_split(t, placements, mesh_shape)
    if blocks:
        check_blocks(t.shape, placements, mesh_shape, blocks)
        shape, inner = expand_blocks(t.shape, placements, blocks)
        out = local_block(t.reshape(shape), inner, mesh_shape, coords)
        return out.reshape(local_shape(t.shape, placements, mesh_shape, coords))
    for d, (start, length) in enumerate(local_range(t.shape, placements, mesh_shape, coords)):
        if length != t.shape[d]:
            t = t.narrow(d, start, length)
    for a, p in enumerate(placements):
        if isinstance(p, Partial) and coords[a] != 0 and p.reduce == "sum":
            t = torch.zeros_like(t)
    return t.contiguous()


# ---------------------------------------------------------------------------------------------
# Dims of equal blocks (``TensorSpec.blocks``)


def expand_blocks(shape: Sequence[int], placements: Sequence[Placement],
                  blocks: Sequence[tuple[int, int]]) -> tuple[tuple[int, ...], Placements]:
    """``shape`` with each dim of ``c`` blocks written as two dims ``(c, size / c)``, and
    ``placements`` with that dim's split moved to the inner one (later dims shift by one): a split
    of a block dim is a plain split of the expanded tensor, so every shard function applies."""
    out, pl = list(shape), list(placements)
    for d, c in sorted(blocks, reverse=True):
        out[d:d + 1] = [c, out[d] // c]
        pl = [type(p)(p.dim + 1) if isinstance(p, Split) and p.dim >= d else p for p in pl]  # S or Z
    return tuple(out), tuple(pl)


def blocks_fit(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
               blocks: Sequence[tuple[int, int]]) -> bool:
    """Whether every split of a block dim cuts each block into equal pieces (the local shape is then
    the plain split's; uneven pieces of blocks are not supported), on one mesh axis at most:
    DTensor (torch 2.13) reassembles two ``_StridedShard`` axes on one dim wrongly."""
    for d, c in blocks:
        axes = [n for p, n in zip(placements, mesh_shape) if isinstance(p, Split) and p.dim == d]
        if len(axes) > 1 or shape[d] % (c * math.prod(axes)):
            return False
    return True


def check_blocks(shape, placements, mesh_shape, blocks) -> None:
    """Fail when the dims of equal blocks ``blocks`` cannot be split as ``placements`` asks."""
    if not blocks_fit(shape, placements, mesh_shape, blocks):
        raise PlacementError(
            f"placement {format_placements(placements)} cuts the blocks {list(blocks)} of a tensor of shape "
            f"{tuple(shape)} into unequal pieces")


# ---------------------------------------------------------------------------------------------
# The load-balanced split (``Balanced``, ``Z(d)``)


def zigzag_order(n: int) -> list[int]:
    """The ``2n`` chunks in the order ``Z`` lays them on ``n`` devices: ``0, 2n-1, 1, 2n-2, ...``."""
    return [c for r in range(n) for c in (r, 2 * n - 1 - r)]


def zigzag(t, dim: int, n: int, inverse: bool = False):
    """``t`` with dim ``dim``'s ``2n`` chunks reordered as ``Z`` lays them (``inverse``: back)."""
    import torch

    order = zigzag_order(n)
    if inverse:
        order = sorted(range(2 * n), key=order.__getitem__)
    chunks = t.chunk(2 * n, dim=dim)
    return torch.cat([chunks[c] for c in order], dim=dim)


def balanced_fits(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """Every ``Z(d)`` cuts ``d`` into ``2n`` equal chunks on its axis alone."""
    for a, p in enumerate(placements):
        if isinstance(p, Balanced):
            if p.dim >= len(shape) or shape[p.dim] % (2 * mesh_shape[a]):
                return False
            if any(isinstance(q, Split) and q.dim == p.dim for b, q in enumerate(placements) if b != a):
                return False
    return True


def balanced_as_split(t, placements: Sequence[Placement], mesh_shape: Sequence[int]):
    """``(t', placements')``: the whole tensor with each ``Z`` dim's chunks reordered, and ``S``
    for ``Z`` (a device's ``Z`` block of ``t`` is its ``S`` block of ``t'``)."""
    if not balanced_fits(t.shape, placements, mesh_shape):
        raise PlacementError(f"placement {format_placements(placements)} cannot lay a tensor of shape "
                             f"{tuple(t.shape)} out balanced: Z(d) needs 2n equal chunks on one mesh axis")
    out = []
    for a, p in enumerate(placements):
        if isinstance(p, Balanced):
            t = zigzag(t, p.dim, mesh_shape[a])
            p = Split(p.dim)
        out.append(p)
    return t, tuple(out)
