"""Rules for views and layout ops: view/reshape, permute, expand, squeeze, slicing, cat/split/stack,
softmax-like ops and ops that run along one dim (cumsum, topk, sort).

A view maps factors between two shapes: a dim split into several on the other side becomes a
merged dim, and only its leading factor may be split (see ``dimmap.compose_ok``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from autopar.ir.graph import TensorSpec
from autopar.ir.rules.base import LocalCtx, OpCall, register
from autopar.ir.rules.dimmap import DimMap, Dims, Linear
from autopar.ir.rules.generic import all_outputs, float_flags, linear_in, norm_dim, pointwise_map

# ---------------------------------------------------------------------------------------------
# Views and layout


def view_groups(src: Sequence[int], dst: Sequence[int]) -> Optional[list[tuple[list[int], list[int]]]]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims of equal product (size-1 dims apart)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            return None
        a, b = [i], [j]
        pa, pb = src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(src):
                    return None
                pa *= src[i]
                a.append(i)
                i += 1
            else:
                if j >= len(dst):
                    return None
                pb *= dst[j]
                b.append(j)
                j += 1
        groups.append((a, b))
    return groups


def view_map(call: OpCall, src: Sequence[int], dst: Sequence[int], src_is_input: bool = True) -> DimMap:
    """Factors of a view: a dim split into several becomes a merged dim on the other side.

    A run of dims that neither splits nor merges cleanly ((6, 4) -> (4, 6)) is kept whole.
    """
    groups = view_groups(src, dst) or []
    src_dims: Dims = [() for _ in src]
    dst_dims: Dims = [() for _ in dst]
    sizes: dict[str, int] = {}
    no_split: set[str] = set()
    for g, (a, b) in enumerate(groups):
        if not a or not b:
            continue
        if len(a) == 1 or len(b) == 1:
            many, one = (b, a) if len(a) == 1 else (a, b)
            many_dims = dst_dims if len(a) == 1 else src_dims
            one_dims = src_dims if len(a) == 1 else dst_dims
            many_shape = dst if len(a) == 1 else src
            names = [f"g{g}_{k}" for k in range(len(many))]
            for k, d in enumerate(many):
                many_dims[d] = (names[k],)
                sizes[names[k]] = many_shape[d]
            one_dims[one[0]] = tuple(names)
        else:
            name = f"g{g}"
            no_split.add(name)
            sizes[name] = 1
            for d in a:
                src_dims[d] = (name,)
            for d in b:
                dst_dims[d] = (name,)
    ins, outs = (src_dims, dst_dims) if src_is_input else (dst_dims, src_dims)
    fi, fo = float_flags(call)
    return DimMap(
        [ins], [outs], sizes, no_split=frozenset(no_split), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo
    )


@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", size_args=((1, "size", 0),))
def _view(call: OpCall) -> DimMap:
    return view_map(call, call.in_specs[0].shape, call.out_specs[0].shape)


def permute_map(call: OpCall, perm: Sequence[int]) -> DimMap:
    """The DimMap of a permutation: output dim i is input dim ``perm[i]``."""
    x = call.in_specs[0]
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(names[p],) for p in perm]], dict(zip(names, x.shape)),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.permute.default")
def _permute(call: OpCall) -> DimMap:
    nd = call.in_specs[0].ndim
    return permute_map(call, [norm_dim(d, nd) for d in call.arg(1, "dims")])


@register("aten.transpose.int")
def _transpose(call: OpCall) -> DimMap:
    nd = call.in_specs[0].ndim
    perm = list(range(nd))
    a, b = norm_dim(call.arg(1, "dim0"), nd), norm_dim(call.arg(2, "dim1"), nd)
    perm[a], perm[b] = perm[b], perm[a]
    return permute_map(call, perm)


@register("aten.t.default")
def _t(call: OpCall) -> DimMap:
    return permute_map(call, list(reversed(range(call.in_specs[0].ndim))))


@register("aten.expand.default", size_args=((1, "size", 0),))
def _expand(call: OpCall) -> DimMap:
    # A dim the input holds at size 1 is new in the output: the output may split it, the input stays B.
    return pointwise_map(call, [linear_in([0], [0])])


@register("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def _squeeze(call: OpCall) -> DimMap:
    return view_map(call, call.in_specs[0].shape, call.out_specs[0].shape)


@register("aten.slice.Tensor")
def _slice(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    out_names = list(names)
    full = call.out_specs[0].shape[dim] == x.shape[dim]
    if not full:
        out_names[dim] = "sliced"
    fi, fo = float_flags(call)
    sizes = dict(zip(names, x.shape))
    sizes["sliced"] = call.out_specs[0].shape[dim]
    return DimMap(
        [[(n,) for n in names]], [[(n,) for n in out_names]], sizes,
        no_split=frozenset() if full else frozenset({names[dim], "sliced"}),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.slice_backward.default", size_args=((1, "input_sizes", 0),))
def _slice_backward(call: OpCall) -> DimMap:
    # (grad, input_sizes, dim, start, end, step): zero-pads grad back to input_sizes along dim.
    out = call.out_specs[0]
    dim = norm_dim(call.arg(2, "dim"), out.ndim)
    names = [f"d{i}" for i in range(out.ndim)]
    sizes = dict(zip(names, out.shape))
    sizes["sliced"] = call.in_specs[0].shape[dim]
    ins = [[(n,) if i != dim else ("sliced",) for i, n in enumerate(names)]]
    fi, fo = float_flags(call)
    return DimMap(
        ins, [[(n,) for n in names]], sizes, no_split=frozenset({names[dim], "sliced"}),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.constant_pad_nd.default")
def _constant_pad(call: OpCall) -> DimMap:
    # pad lists (left, right) pairs from the last dim backwards; padded dims stay whole.
    x, out = call.in_specs[0], call.out_specs[0]
    pad = list(call.arg(1, "pad"))
    padded = {x.ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
    names = [f"d{i}" for i in range(x.ndim)]
    sizes = dict(zip(names, x.shape))
    outs: list[tuple[str, ...]] = []
    for i, n in enumerate(names):
        if i in padded:
            sizes[f"_p{i}"] = out.shape[i]
            outs.append((f"_p{i}",))
        else:
            outs.append((n,))
    fi, fo = float_flags(call)
    value = call.arg(2, "value", 0)
    return DimMap(
        [[(n,) for n in names]], [outs], sizes,
        no_split=frozenset(names[i] for i in padded) | {f for f in sizes if f.startswith("_")},
        linear=[linear_in([0], [0])] if value == 0 else [], float_inputs=fi, float_outputs=fo,
    )


@register("aten.select.int")
def _select(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(n,) for i, n in enumerate(names) if i != dim]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


def _shared_except(call: OpCall, dim: int, n_in: int, out_dims_fn) -> DimMap:
    """All inputs share every dim but ``dim``, which must stay whole."""
    x = call.in_specs[0]
    names = [f"d{i}" for i in range(x.ndim)]
    sizes = dict(zip(names, x.shape))
    ins = [[(n,) if i != dim else (f"_in{k}",) for i, n in enumerate(names)] for k in range(n_in)]
    for k in range(n_in):
        sizes[f"_in{k}"] = call.in_specs[k].shape[dim]
    outs = out_dims_fn(names)
    for j, o in enumerate(outs):
        if o is not None and (f"_out{j}",) in o:  # unbind's outputs lack the dim
            sizes.setdefault(f"_out{j}", call.out_specs[j].shape[dim])
    fi, fo = float_flags(call)
    no = frozenset(f for f in sizes if f.startswith("_")) | {names[dim]}
    return DimMap(ins, outs, sizes, no_split=no, linear=[linear_in(range(n_in), all_outputs(call))], float_inputs=fi, float_outputs=fo)


def _equal_pieces(call: OpCall, dim: int, whole: TensorSpec, pieces: list) -> DimMap:
    """``cat`` of (``split`` into) ``n`` equal pieces along ``dim``: the whole tensor's dim is the
    merged ``(_n, blk)``, each piece's is ``blk``. Splitting ``blk`` is valid only where the whole
    tensor's dim is ``n`` blocks (``TensorSpec.blocks``): each device then holds its piece of every
    piece, and the op is local (a fused ``qkv`` split into whole heads of q, k and v)."""
    names = [f"d{i}" for i in range(whole.ndim)]
    sizes = dict(zip(names, whole.shape))
    sizes["blk"], sizes["_n"] = pieces[0].shape[dim], len(pieces)
    part = [(nm,) if i != dim else ("blk",) for i, nm in enumerate(names)]
    full = [(nm,) if i != dim else ("_n", "blk") for i, nm in enumerate(names)]
    fi, fo = float_flags(call)
    cat = call.op == "aten.cat.default"
    ins, outs = ([part] * len(pieces), [full]) if cat else ([full], [part] * len(pieces))
    return DimMap(ins, outs, sizes, no_split=frozenset({"_n"}),
                  linear=[linear_in(range(len(ins)), all_outputs(call))], float_inputs=fi, float_outputs=fo)


def _is_equal_pieces(whole: TensorSpec, pieces: list, dim: int) -> bool:
    return (len(pieces) >= 2 and all(p is not None and p.ndim == whole.ndim for p in pieces)
            and len({p.shape for p in pieces}) == 1 and pieces[0].shape[dim] * len(pieces) == whole.shape[dim])


def _legacy_empty(call: OpCall) -> list[int]:
    """Inputs of ``cat`` that are empty 1-D tensors next to a tensor of more dims: torch skips them
    (its legacy rule), as Hugging Face's empty key/value cache ``torch.cat([cache, key])``."""
    out = call.out_specs[0]
    if out is None or out.ndim <= 1:
        return []
    return [k for k, s in enumerate(call.in_specs) if s.ndim == 1 and s.numel == 0]


@register("aten.cat.default")
def _cat(call: OpCall) -> DimMap:
    skipped = _legacy_empty(call)
    if skipped and len(skipped) < len(call.in_specs):
        # the others' map; a skipped input is read whole and adds nothing (outside any partial sum)
        kept = [k for k in range(len(call.in_specs)) if k not in skipped]
        dm = _cat(replace(call, in_specs=[call.in_specs[k] for k in kept]))
        inputs: list = [None] * len(call.in_specs)
        for pos, k in enumerate(kept):
            inputs[k] = dm.inputs[pos]
        dm.inputs = inputs
        dm.linear = [Linear(frozenset(kept[i] for i in lin.inputs), lin.outputs, lin.kind) for lin in dm.linear]
        dm.float_inputs = float_flags(call)[0]
        return dm
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    n = len(call.in_specs)
    if call.out_specs[0] is not None and _is_equal_pieces(call.out_specs[0], call.in_specs, dim):
        return _equal_pieces(call, dim, call.out_specs[0], call.in_specs)
    return _shared_except(
        call, dim, n, lambda names: [[(nm,) if i != dim else ("_out0",) for i, nm in enumerate(names)]]
    )


def _split_sizes(ctx: LocalCtx, args: list, kwargs: dict) -> None:
    """``split``'s sizes as this device's: along a dim split block by block, its piece of each."""
    spec = ctx.call.in_specs[0]
    dim = norm_dim(ctx.call.arg(2, "dim", 0), spec.ndim)
    local = [ctx.out_shape(j)[dim] for j, o in enumerate(ctx.call.out_specs) if o is not None]
    if len(local) != len(ctx.call.out_specs):
        return  # an output that is not a tensor: sizes stay as recorded (the dim is never split then)
    value = local[0] if ctx.call.op == "aten.split.Tensor" else local
    if len(args) > 1:
        args[1] = value
    else:
        kwargs["split_size" if ctx.call.op == "aten.split.Tensor" else "split_sizes"] = value


@register("aten.split.Tensor", "aten.split_with_sizes.default", arg_fix=_split_sizes)
@register("aten.unbind.int")
def _split(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(2, "dim", 0) if call.op != "aten.unbind.int" else call.arg(1, "dim", 0), x.ndim)
    unbind = call.op == "aten.unbind.int"
    if not unbind and _is_equal_pieces(x, call.out_specs, dim):
        return _equal_pieces(call, dim, x, call.out_specs)

    def outs(names):
        res = []
        for j, spec in enumerate(call.out_specs):
            if spec is None:
                res.append(None)
            elif unbind:
                res.append([(nm,) for i, nm in enumerate(names) if i != dim])
            else:
                res.append([(nm,) if i != dim else (f"_out{j}",) for i, nm in enumerate(names)])
        return res

    return _shared_except(call, dim, 1, outs)


@register("aten.stack.default")
def _stack(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim + 1)
    names = [f"d{i}" for i in range(x.ndim)]
    out = [(n,) for n in names]
    out.insert(dim, ("_stack",))
    fi, fo = float_flags(call)
    sizes = dict(zip(names, x.shape))
    sizes["_stack"] = len(call.in_specs)
    return DimMap(
        [[(n,) for n in names] for _ in call.in_specs], [out], sizes, no_split=frozenset({"_stack"}),
        linear=[linear_in(range(len(call.in_specs)), [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten._softmax.default", "aten._log_softmax.default", "aten._safe_softmax.default")
def _softmax(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(n,) for n in names]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), float_inputs=fi, float_outputs=fo,
    )


@register("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def _softmax_backward(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = norm_dim(call.arg(2, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names], [(n,) for n in names]], [[(n,) for n in names]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


def along_dim_map(call: OpCall, dim: int, linear: bool) -> DimMap:
    """Every input shaped like the output; ``dim`` must stay whole (cumsum, sort, topk, ...)."""
    out = call.out_specs[0]
    nd = call.in_specs[0].ndim
    names = [f"d{i}" for i in range(nd)]
    sizes = dict(zip(names, call.in_specs[0].shape))
    outs: list[Optional[Dims]] = []
    for j, spec in enumerate(call.out_specs):
        if spec is None:
            outs.append(None)
        else:
            outs.append([(n,) if i != dim else (f"_o{j}",) for i, n in enumerate(names)])
            sizes[f"_o{j}"] = spec.shape[dim]
    fi, fo = float_flags(call)
    ins: list[Optional[Dims]] = [[(n,) for n in names]] + [None] * (len(call.in_specs) - 1)
    del out
    return DimMap(
        ins, outs, sizes, no_split=frozenset({names[dim]}) | {f for f in sizes if f.startswith("_")},
        linear=[linear_in([0], all_outputs(call))] if linear else [], float_inputs=fi, float_outputs=fo,
    )


@register("aten.cumsum.default")
def _cumsum(call: OpCall) -> DimMap:
    return along_dim_map(call, norm_dim(call.arg(1, "dim"), call.in_specs[0].ndim), True)


@register("aten.topk.default")
def _topk(call: OpCall) -> DimMap:
    return along_dim_map(call, norm_dim(call.arg(2, "dim", -1), call.in_specs[0].ndim), False)


@register("aten.sort.default")
def _sort(call: OpCall) -> DimMap:
    return along_dim_map(call, norm_dim(call.arg(1, "dim", -1), call.in_specs[0].ndim), False)
