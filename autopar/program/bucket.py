"""Packing a gradient bucket into one flat buffer and cutting it back, and the same for a group of
parameter shards gathered together (``pack_shards``, ``cut_gathered``), as lowered programs call it.

A bucket of n gradients written op by op costs 2n + 2 program ops per step (a reshape of each
gradient, the concatenation, the split and a reshape of each piece), a Python-level dispatch each
on CPU. Here a ``Bucket`` module call copies one gradient into the flat vector (the one copy a
bucket needs), and ``unflatten`` cuts the reduced buffer into views of their shapes.

``Bucket`` packs into a buffer it keeps between steps, as DDP keeps its buckets: a new buffer
every step is fresh memory to allocate and touch (0.7 ms of a 42 ms step of one rank's program, for
the 4-layer GPT's 14 MB of gradients on CPU). The gradients the program returns
are views of that buffer, so it is reused only when no tensor but the ``Bucket``'s own still views
its storage (the gradients were dropped: ``zero_grad(set_to_none=True)``, the default); otherwise
a new one is made, so a gradient still held is never overwritten.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from autopar import _torch_compat as tc


class Bucket(torch.nn.Module):
    """A bucket's flat buffer, kept between steps (see the module's docstring): each call copies
    one gradient into it, so a lowered program packs each gradient as soon as the backward makes
    it and frees the gradient's own memory at once (packing all at the end would hold every
    gradient twice for a moment). The buffer is never a view of an input: callers reduce it in place."""

    def __init__(self) -> None:
        super().__init__()
        self._buf: torch.Tensor | None = None

    def forward(self, buf: torch.Tensor | None, x: torch.Tensor, offset: int, total: int) -> torch.Tensor:
        """``x`` copied into the flat buffer at element ``offset``; the buffer is returned. The first
        gradient of a step passes ``buf=None`` and gets the kept buffer of ``total`` elements (a new
        one when its size or dtype differs, or when something still views it)."""
        if buf is None and torch.compiler.is_compiling():
            # a compiled program packs into a buffer of its own step: the kept one is state that
            # the compiled graph cannot own (and that dynamo cannot check for other holders)
            buf = torch.empty(total, dtype=x.dtype, device=x.device)
        elif buf is None:
            buf = self._buf
            if buf is None or buf.numel() != total or buf.dtype != x.dtype or buf.device != x.device \
                    or not _only_held_here(buf):
                buf = self._buf = torch.empty(total, dtype=x.dtype, device=x.device)
        buf.narrow(0, offset, x.numel()).view(x.shape).copy_(x)
        return buf

    def pack(self, xs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Every gradient of ``xs`` packed in order (what a step's calls do one by one)."""
        total, buf, offset = sum(x.numel() for x in xs), None, 0
        for x in xs:
            buf = self(buf, x, offset, total)
            offset += x.numel()
        assert buf is not None
        return buf


def _only_held_here(buf: torch.Tensor) -> bool:
    """Whether no tensor but ``buf`` itself uses ``buf``'s memory."""
    return tc.storage_use_count(buf) <= 1


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat``, one per shape, cut in order (the inverse of ``flatten``)."""
    pieces = flat.split([math.prod(s) for s in shapes])
    return [p.view(s) for p, s in zip(pieces, shapes)]


#: How one tensor of a gathered group is laid out: (dim gathered, piece: the padded length of that
#: dim on each rank, the tensor's local shape before, the gathered length of that dim, its shape after).
Layout = tuple[int, int, Sequence[int], int, Sequence[int]]


def pack_shards(xs: Sequence[torch.Tensor], layouts: Sequence[Layout]) -> torch.Tensor:
    """One flat buffer of the group's local shards for an all-gather on dim 0: each shard with its
    gathered dim moved first and padded to its piece (equal on every rank), flattened, in order."""
    flat = []
    for x, (d, piece, have, _, _) in zip(xs, layouts):
        t = x.reshape(have).movedim(d, 0)
        if t.shape[0] != piece:
            t = torch.cat([t, t.new_zeros((piece - t.shape[0],) + tuple(t.shape[1:]))])
        flat.append(t.reshape(-1))
    return torch.cat(flat)


def cut_gathered(buf: torch.Tensor, n: int, layouts: Sequence[Layout]) -> list[torch.Tensor]:
    """The group's tensors out of the all-gathered buffer of ``pack_shards`` (``n`` ranks' buffers
    one after another): each one's pieces of every rank joined along its gathered dim, trimmed of
    padding, in its shape after the gather (a dense copy: FSDP's copy-out)."""
    rows = buf.view(n, -1)
    out, at = [], 0
    for d, piece, have, size, after in layouts:
        rest = [s for i, s in enumerate(have) if i != d]
        k = piece * math.prod(rest)
        t = rows[:, at:at + k].reshape([n * piece] + rest)
        at += k
        if size != n * piece:
            t = t[:size]
        out.append(t.movedim(0, d).contiguous().view(after))
    return out


__all__ = ["Bucket", "Layout", "cut_gathered", "pack_shards", "unflatten"]
