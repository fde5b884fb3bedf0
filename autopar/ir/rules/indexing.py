"""Rules for writing into and reading out of tensors by position: the backward of ``select``, the
scatters that in-place slice assignment becomes (``x[..., 0] = v``, ``x[..., 1:] = y``), ``fill``,
and advanced indexing (``w[ids]``, its backward ``index_put``) as Hugging Face's batched experts
and label shifting write them.

A dim that is written or read at given positions stays whole (positions are global); every other
dim is shared between the tensors, one to one. The index tensors' own dims (``w[ids]`` has
``ids``' shape in front) split freely; under ``index_put(..., accumulate=True)`` they are summed
over, so splitting them leaves the output partial with ``self`` as the addend.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.ir.graph import Ref
from autopar.ir.rules.base import OpCall, register
from autopar.ir.rules.dimmap import DimMap, Dims
from autopar.ir.rules.generic import float_flags, linear_in, norm_dim, pointwise_map


@register("aten.select_backward.default", size_args=((1, "input_sizes", 0),))
def _select_backward(call: OpCall) -> DimMap:
    # (grad, input_sizes, dim, index): grad placed at ``index`` along ``dim`` of zeros
    out = call.out_specs[0]
    dim = norm_dim(call.arg(2, "dim"), out.ndim)
    names = [f"d{i}" for i in range(out.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for i, n in enumerate(names) if i != dim]], [[(n,) for n in names]], dict(zip(names, out.shape)),
        no_split=frozenset({names[dim]}), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.select_scatter.default")
def _select_scatter(call: OpCall) -> DimMap:
    # (self, src, dim, index): self with src written at ``index`` along ``dim``
    x = call.in_specs[0]
    dim = norm_dim(call.arg(2, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names], [(n,) for i, n in enumerate(names) if i != dim]], [[(n,) for n in names]],
        dict(zip(names, x.shape)), no_split=frozenset({names[dim]}), linear=[linear_in([0, 1], [0])],
        float_inputs=fi, float_outputs=fo,
    )


@register("aten.slice_scatter.default")
def _slice_scatter(call: OpCall) -> DimMap:
    # (self, src, dim, start, end, step): self with src written over a slice of ``dim``
    x, src = call.in_specs[0], call.in_specs[1]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    sizes = dict(zip(names, x.shape)) | {"_src": src.shape[dim]}
    src_dims = [(n,) if i != dim else ("_src",) for i, n in enumerate(names)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names], src_dims], [[(n,) for n in names]], sizes, no_split=frozenset({names[dim], "_src"}),
        linear=[linear_in([0, 1], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.fill.Tensor")
def _fill_tensor(call: OpCall) -> DimMap:
    # fill(self, value): value (0-d) everywhere; self only gives the shape, so P value -> P output
    return pointwise_map(call, [linear_in([1], [0])])


@register("aten.fill.Scalar")
def _fill_scalar(call: OpCall) -> DimMap:
    return pointwise_map(call, [])


# ---------------------------------------------------------------------------------------------
# Advanced indexing: index(self, [None, ids, ...]) and index_put(self, indices, values, accumulate)


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(torch.broadcast_shapes(*[torch.Size(s) for s in shapes]))


def _indexing_dims(call: OpCall) -> tuple[Dims, list[Dims], Dims, dict[str, int], set[str]]:
    """``(self dims, dims of each index tensor, dims of the indexed result, sizes, dims kept whole)``.

    The index tensors broadcast together to factors ``i0..``; the result holds them where the
    indexed dims were (when those are adjacent) or in front (when they are not), as torch does."""
    x = call.in_specs[0]
    indices = list(call.arg(1, "indices"))
    indexed = [d for d, a in enumerate(indices) if isinstance(a, Ref)]
    idx_specs = call.in_specs[1 : 1 + len(indexed)]
    shape = _broadcast([s.shape for s in idx_specs])
    inames = [f"i{k}" for k in range(len(shape))]
    sizes = dict(zip(inames, shape))
    names = [f"d{i}" if i not in indexed else f"_k{i}" for i in range(x.ndim)]
    sizes |= dict(zip(names, x.shape))
    idx_dims: list[Dims] = []
    for s in idx_specs:
        off = len(shape) - s.ndim
        idx_dims.append([(inames[off + k],) if n == shape[off + k] else () for k, n in enumerate(s.shape)])
    rest = [(n,) for i, n in enumerate(names) if i not in indexed]
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    if adjacent:
        lead = [(n,) for n in names[: indexed[0]]]
        result = lead + [(n,) for n in inames] + [(n,) for n in names[indexed[-1] + 1 :]]
    else:
        result = [(n,) for n in inames] + rest
    return [(n,) for n in names], idx_dims, result, sizes, {n for n in names if n.startswith("_")}


@register("aten.index.Tensor")
def _index(call: OpCall) -> DimMap:
    self_dims, idx_dims, result, sizes, whole = _indexing_dims(call)
    fi, fo = float_flags(call)
    return DimMap(
        [self_dims] + idx_dims, [result], sizes, no_split=frozenset(whole), linear=[linear_in([0], [0])],
        float_inputs=fi, float_outputs=fo,
    )


@register("aten.index_put.default")
def _index_put(call: OpCall) -> DimMap:
    self_dims, idx_dims, result, sizes, whole = _indexing_dims(call)
    values = call.in_specs[-1]
    accumulate = bool(call.arg(3, "accumulate", False))
    # values broadcast against the indexed result's shape
    rshape = [sizes[d[0]] for d in result]
    off = len(rshape) - values.ndim
    vdims: Dims = [result[off + k] if n == rshape[off + k] else () for k, n in enumerate(values.shape)]
    inames = {d[0] for dims in idx_dims for d in dims}
    reduce = {f: "sum" for f in inames} if accumulate else {}
    no: set[str] = whole | (set() if accumulate else inames)
    fi, fo = float_flags(call)
    v = len(call.in_specs) - 1
    return DimMap(
        [self_dims] + idx_dims + [vdims], [self_dims], sizes, reduce=reduce,
        additive=frozenset({0}) if accumulate else frozenset(), no_split=frozenset(no),
        linear=[linear_in([0, v], [0])], float_inputs=fi, float_outputs=fo,
    )
