"""Grouped-query attention split on the query heads with the keys and values whole ("kv-shared").

With fewer key/value heads than the devices of an axis, the heads cannot split together (a split of
the kv heads leaves devices without a head), so a head split of the attention, which all-to-all
(Ulysses) context parallelism needs, has no signature. This one splits the query heads alone and
keeps k and v whole (``B``) on the axis: each device attends its query heads against the kv heads
they share, selected locally. The key/value gradients are then partial sums (``P``): each device
fills the rows of the kv heads its query heads use. The all-gather of k and v that this asks of a
sequence-split producer moves ``1/g`` of what repeating them to every query head would.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.ir.placement import B, P, Split
from autopar.ir.rules.base import LocalCtx, OpCall
from autopar.ir.rules.dimmap import DimMap, Signature

TAG = "kv-shared"

__all__ = ["TAG", "composes", "select_kv", "shared_kv_fwd", "shared_kv_bwd", "scatter_kv_grads"]


def _grouped(call: OpCall, q_index: int) -> bool:
    q, k = call.in_specs[q_index], call.in_specs[q_index + 1]
    return k.shape[1] < q.shape[1] and len(call.in_specs) == (6 if q_index else 3)  # no explicit mask


def shared_kv_fwd(call: OpCall, dm: DimMap) -> list[Signature]:
    """``(q S(1), k B, v B) -> (out S(1), logsumexp S(1))`` for grouped-query attention without a mask."""
    if not _grouped(call, 0):
        return []
    h = Split(1)
    return [Signature((h, B, B), (h, h), TAG)]


def shared_kv_bwd(call: OpCall, dm: DimMap) -> list[Signature]:
    """``(grad S(1), q S(1), k B, v B, out S(1), lse S(1)) -> (dq S(1), dk P, dv P)``."""
    if not _grouped(call, 1):
        return []
    h = Split(1)
    return [Signature((h, h, B, B, h, h), (h, P, P), TAG)]


def composes(strategy, q_index: int) -> bool:
    """Whether a composed strategy's kv-shared axes hold: where one axis keeps k and v whole for
    split query heads, no other axis may split the kv heads (the kv head a query head block needs
    would then sit on another device; ``select_kv`` only picks heads among its own)."""
    if not any(sig.tag == TAG for sig in strategy):
        return True
    return not any(sig.tag != TAG and sig.inputs[q_index + 1] == Split(1) for sig in strategy)


def select_kv(ctx: LocalCtx, xs: list, q_index: int) -> tuple[list, Optional[torch.Tensor]]:
    """``xs`` with this device's k and v replaced by one kv head per local query head, where the
    local kv heads are not exactly those of the local query heads (else ``xs`` as is and None);
    the second item indexes the local kv block's heads, per local query head."""
    q, k = ctx.call.in_specs[q_index], ctx.call.in_specs[q_index + 1]
    g = q.shape[1] // k.shape[1]
    qs, qn = ctx.in_range(q_index, 1)
    ks, kn = ctx.in_range(q_index + 1, 1)
    if qs % g == 0 and qn % g == 0 and ks == qs // g and kn == qn // g:
        return xs, None  # the kernel's own grouping lines up
    device = xs[q_index].device
    idx = torch.arange(qs, qs + qn, device=device) // g - ks
    xs = list(xs)
    xs[q_index + 1] = xs[q_index + 1].index_select(1, idx)
    xs[q_index + 2] = xs[q_index + 2].index_select(1, idx)
    return xs, idx


def scatter_kv_grads(ctx: LocalCtx, outs: tuple, idx: torch.Tensor) -> tuple:
    """The backward's ``(dq, dk, dv)`` with dk and dv (one per local query head) summed back into
    this device's kv block (zeros where its query heads use no kv head)."""
    dq, dk, dv = outs
    full_k = dk.new_zeros(ctx.out_shape(1)).index_add_(1, idx, dk)
    full_v = dv.new_zeros(ctx.out_shape(2)).index_add_(1, idx, dv)
    return dq, full_k, full_v
