"""Rules for the mixture-of-experts routing ops: allocations shaped by an argument (``new_zeros``)
and index-driven data movement (``scatter``, ``scatter_add``, ``index_add``, ``gather``,
``index_select``).

Index values are global positions along ``dim``, so the indexed tensor never splits along ``dim``
(except in the masked gathers below). On the other dims positions are matched elementwise, so an
index shares a factor with the tensor it indexes where their sizes are equal and otherwise both stay
whole. Accumulating ops (``scatter_add``, ``index_add``) sum over the index's ``dim``: splitting
the index and source there leaves the output partial, with ``self`` as the addend (``P`` too).
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.ir.placement import B, P, Split
from autopar.ir.rules.base import LocalCtx, OpCall, register, substitute
from autopar.ir.rules.dimmap import DimMap, Dims, Linear, Signature
from autopar.ir.rules.generic import float_flags, linear_in, norm_dim
from autopar.ir.rules.special import _by_position, _masked_ids, _splits_dim, _zeros, tensor_positions

# ---------------------------------------------------------------------------------------------
# new_zeros & co.: the output's dims come from the size argument; the input only supplies the
# dtype and device, so it is read whole. Zeros are a valid partial sum (every addend zero).


@register("aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default", size_args=((1, "size", 0),))
def _new_factory(call: OpCall) -> DimMap:
    out = call.out_specs[0]
    names = [f"d{i}" for i in range(out.ndim)]
    fi, fo = float_flags(call)
    zeros = call.op == "aten.new_zeros.default" and fo[0]
    return DimMap(
        [None] * len(call.in_specs), [[(n,) for n in names]], dict(zip(names, out.shape)),
        linear=[Linear(frozenset(), frozenset({0}))] if zeros else [], float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# scatter / scatter_add / index_add: out is self with (sums of) source elements placed at indices.


def _indexed(self_shape, dim: int, others: list, along: str) -> tuple[list[Dims], set[str], dict[str, int]]:
    """Dims of ``others`` (index-like tensors that must agree elementwise: index, src) against
    ``self_shape``. Equal-sized dims share self's factor; at ``dim`` they share ``along`` where their
    sizes agree; everything else stays whole. Returns dims, self's factors that must stay whole, sizes."""
    dims: list[Dims] = [[] for _ in others]
    whole, sizes = {f"d{dim}"}, {}
    for k in range(len(others[0])):
        agree = all(o[k] == others[0][k] for o in others)
        shared = k != dim and agree and others[0][k] == self_shape[k]
        if not shared and k != dim:
            whole.add(f"d{k}")
        for i, o in enumerate(others):
            f = f"d{k}" if shared else (along if k == dim and agree else f"_x{i}_{k}")
            dims[i].append((f,))
            sizes.setdefault(f, o[k])
    return dims, whole, sizes


def _scatter_like(call: OpCall, others_pos: list[int], accumulate: bool, linear: list[int]) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    pos = tensor_positions(call)
    shapes = [call.in_specs[pos[p]].shape for p in others_pos]
    if call.op == "aten.index_add.default":  # the index is 1-D along dim; source is shaped like self
        shapes = [[shapes[0][0] if k == dim else x.shape[k] for k in range(x.ndim)], shapes[1]]
    dims, whole, sizes = _indexed(x.shape, dim, shapes, "t")
    if call.op == "aten.index_add.default":
        dims[0] = [dims[0][dim]]
    sizes.update(zip(names, x.shape))
    reduce = {"t": "sum"} if accumulate and "t" in sizes else {}
    no = whole | {f for f in sizes if f.startswith("_") or f == "t" and not reduce}
    fi, fo = float_flags(call)
    lin = [linear_in([pos[p] for p in linear], [0])] if linear else []
    return DimMap(
        _by_position(call, {0: [(n,) for n in names], **dict(zip(others_pos, dims))}), [[(n,) for n in names]],
        sizes, reduce=reduce, additive=frozenset({0}) if accumulate else frozenset(), linear=lin,
        no_split=frozenset(no), float_inputs=fi, float_outputs=fo,
    )


@register("aten.scatter.src")
def _scatter_src(call: OpCall) -> DimMap:
    # scatter(self, dim, index, src): linear in self and src together (the index selects the same
    # positions on every device).
    return _scatter_like(call, [2, 3], False, [0, 3])


@register("aten.scatter.value")
def _scatter_value(call: OpCall) -> DimMap:
    # scatter(self, dim, index, value): linear in self only when the value written is 0
    return _scatter_like(call, [2], False, [0] if call.arg(3, "value") == 0 else [])


@register("aten.scatter_add.default")
def _scatter_add(call: OpCall) -> DimMap:
    return _scatter_like(call, [2, 3], True, [0, 3])


@register("aten.index_add.default")
def _index_add(call: OpCall) -> DimMap:
    # index_add(self, dim, index, source, alpha): self + alpha * source rows added at index
    return _scatter_like(call, [2, 3], True, [0, 3])


# ---------------------------------------------------------------------------------------------
# gather / index_select: out takes the index's shape; with self whole, the index splits along dim.
# The masked split ("rows"): self split along dim, each device picks the rows it holds
# and zeros elsewhere, so the output is a partial sum (as a vocabulary-split embedding).


def _rows_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    if not x.is_float or x.ndim == 0 or x.shape[dim] < 2:
        return []
    return [Signature((Split(dim),) + (B,) * (len(call.in_specs) - 1), (P,), "rows")]


def _rows_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    call = ctx.call
    x, index = xs[0], xs[1]
    dim = norm_dim(call.arg(1, "dim"), max(call.in_specs[0].ndim, 1))
    if call.in_specs[0].ndim == 0 or not _splits_dim(ctx, 0, dim):
        args, kwargs = substitute(call, xs)
        return call.target(*args, **kwargs)
    start, length = ctx.in_range(0, dim)
    if length == 0:
        return _zeros(ctx, 0)
    local, valid = _masked_ids(index, start, length)
    if call.op == "aten.gather.default":
        return torch.gather(x, dim, local) * valid.to(x.dtype)
    shape = [1] * x.ndim
    shape[dim] = -1
    return torch.index_select(x, dim, local.reshape(-1)) * valid.reshape(shape).to(x.dtype)


@register("aten.gather.default", extra=_rows_extra, local=_rows_local)
def _gather(call: OpCall) -> DimMap:
    # gather(self, dim, index, sparse_grad) -> out shaped like index; linear in self
    x, idx = call.in_specs[0], call.in_specs[1]
    dim = norm_dim(call.arg(1, "dim"), max(x.ndim, 1))
    names = [f"d{i}" for i in range(x.ndim)]
    # along dim the index is free; elsewhere positions match self's, so sizes must agree to split
    idims: Dims = [("i" if k == dim else names[k] if n == x.shape[k] else f"_i{k}",) for k, n in enumerate(idx.shape)]
    sizes = dict(zip(names, x.shape)) | {f: n for (f,), n in zip(idims, idx.shape)}
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names], idims], [idims], sizes, no_split=frozenset(f for f in sizes if f.startswith("_")),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.index_select.default", extra=_rows_extra, local=_rows_local)
def _index_select(call: OpCall) -> DimMap:
    # index_select(self, dim, index [k]) -> self with dim replaced by k; linear in self
    x, idx = call.in_specs[0], call.in_specs[1]
    dim = norm_dim(call.arg(1, "dim"), max(x.ndim, 1))
    names = [f"d{i}" for i in range(x.ndim)]
    out: list[tuple[str, ...]] = [(n,) if k != dim else ("i",) for k, n in enumerate(names)]
    idims: Optional[Dims] = [("i",)] if idx.ndim == 1 else []
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names], idims], [out], dict(zip(names, x.shape)) | {"i": idx.numel},
        no_split=frozenset(names[dim : dim + 1]), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )

