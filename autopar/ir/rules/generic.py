"""Rules for the ops that are pure data: pointwise, reductions, matmuls, views and layout ops.

Each builder turns an ``OpCall`` into a ``DimMap``; the tables below say which ops use which
builder and in which inputs each op is linear (where ``P`` passes through).
"""

from __future__ import annotations

from typing import Optional, Sequence

from autopar.ir.rules.base import OpCall, register
from autopar.ir.rules.dimmap import DimMap, Dims, Linear, from_spec


def _float_flags(call: OpCall) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    return (
        tuple(s.is_float for s in call.in_specs),
        tuple(s is not None and s.is_float for s in call.out_specs),
    )


def _lin(inputs: Sequence[int], outputs: Sequence[int], kind: str = "sum") -> Linear:
    return Linear(frozenset(inputs), frozenset(outputs), kind)


def _all_outputs(call: OpCall) -> list[int]:
    return [j for j, s in enumerate(call.out_specs) if s is not None]


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---------------------------------------------------------------------------------------------
# Pointwise ops (with broadcasting)


def pointwise_map(call: OpCall, linear: list[Linear]) -> DimMap:
    """Output dims are factors ``d0..``; an input dim of size 1 facing a larger output dim is broadcast."""
    out = call.out_specs[0]
    assert out is not None
    nd = out.ndim
    names = [f"d{i}" for i in range(nd)]
    sizes = {n: s for n, s in zip(names, out.shape)}
    ins: list[Dims] = []
    for spec in call.in_specs:
        off = nd - spec.ndim
        dims: Dims = []
        for k, size in enumerate(spec.shape):
            if off + k < 0:
                dims.append(())
            elif size == out.shape[off + k]:
                dims.append((names[off + k],))
            else:
                dims.append(())
        ins.append(dims)
    outs: list[Optional[Dims]] = []
    for spec in call.out_specs:
        outs.append(None if spec is None else [(n,) for n in names[nd - spec.ndim :]])
    fi, fo = _float_flags(call)
    return DimMap(ins, outs, sizes, linear=linear, float_inputs=fi, float_outputs=fo)


def _n_tensor_operands(call: OpCall, n_operands: int) -> bool:
    """Whether the first ``n_operands`` positional arguments are all tensors (no Python scalars)."""
    from autopar.ir.graph import Ref

    return all(isinstance(a, Ref) for a in call.args[:n_operands])


# Ops with no linearity at all (P never passes).
NONLINEAR_POINTWISE = [
    "aten.gelu.default", "aten.relu.default", "aten.silu.default", "aten.sigmoid.default",
    "aten.tanh.default", "aten.exp.default", "aten.log.default", "aten.rsqrt.default",
    "aten.sqrt.default", "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.cos.default",
    "aten.sin.default", "aten.abs.default", "aten.reciprocal.default", "aten.erf.default",
    "aten.eq.Scalar", "aten.eq.Tensor", "aten.ne.Scalar", "aten.ne.Tensor", "aten.lt.Scalar",
    "aten.lt.Tensor", "aten.le.Scalar", "aten.le.Tensor", "aten.gt.Scalar", "aten.gt.Tensor",
    "aten.ge.Scalar", "aten.ge.Tensor", "aten.logical_not.default", "aten.logical_and.default",
    "aten.logical_or.default", "aten.bitwise_not.default", "aten.bitwise_and.Tensor",
    "aten.bitwise_or.Tensor", "aten.maximum.default", "aten.minimum.default", "aten.clamp.default",
    "aten.clamp_min.default", "aten.clamp_max.default", "aten.sign.default", "aten.floor.default",
    "aten.ceil.default", "aten.round.default", "aten.remainder.Scalar", "aten.fmod.Scalar",
    "aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.log1p.default",
    "aten.expm1.default", "aten.square.default", "aten.isnan.default", "aten.pow.Scalar",
    "aten.relu6.default", "aten.hardtanh.default", "aten.leaky_relu.default",
    "aten.elu.default", "aten.softplus.default", "aten.mish.default", "aten.hardswish.default",
    "aten.logical_xor.default", "aten.exp2.default", "aten.atan.default",
]

# Linear in their first input only (a gradient, scaled by things that are not partial).
FIRST_LINEAR_POINTWISE = [
    "aten.neg.default", "aten.clone.default", "aten.detach.default", "aten.alias.default",
    "aten._to_copy.default", "aten.lift_fresh_copy.default", "aten.gelu_backward.default",
    "aten.threshold_backward.default", "aten.silu_backward.default", "aten.sigmoid_backward.default",
    "aten.tanh_backward.default", "aten.relu_backward.default", "aten.hardtanh_backward.default",
    "aten.leaky_relu_backward.default", "aten.elu_backward.default", "aten.softplus_backward.default",
    "aten.mul.Scalar", "aten.div.Scalar", "aten.copy.default", "aten.contiguous.default",
    "aten.hardswish_backward.default", "aten.mish_backward.default",
    "autopar.hint.default",  # an identity; the placement it asks for is a constraint, not a rule
]


@register(*NONLINEAR_POINTWISE)
def _nonlinear(call: OpCall) -> DimMap:
    return pointwise_map(call, [])


@register(*FIRST_LINEAR_POINTWISE)
def _first_linear(call: OpCall) -> DimMap:
    return pointwise_map(call, [_lin([0], _all_outputs(call))])


@register("aten.add.Tensor", "aten.sub.Tensor")
def _add(call: OpCall) -> DimMap:
    # Affine, not linear, when one operand is a Python scalar: x + 2 on P addends adds 2 n times.
    lin = [_lin(range(len(call.in_specs)), [0])] if _n_tensor_operands(call, 2) else []
    return pointwise_map(call, lin)


@register("aten.mul.Tensor")
def _mul(call: OpCall) -> DimMap:
    n = len(call.in_specs)
    return pointwise_map(call, [_lin([i], [0]) for i in range(n)])


@register("aten.div.Tensor")
def _div(call: OpCall) -> DimMap:
    from autopar.ir.graph import Ref

    lin = [_lin([0], [0])] if isinstance(call.args[0], Ref) else []
    return pointwise_map(call, lin)


@register("aten.where.self")
def _where(call: OpCall) -> DimMap:
    from autopar.ir.graph import Ref

    # where(cond, a, b) is linear in a and b jointly (cond selects addends consistently).
    refs = [i for i, a in enumerate(call.args[:3]) if isinstance(a, Ref)]
    if len(refs) == 3:
        return pointwise_map(call, [_lin([1, 2], [0])])
    return pointwise_map(call, [])


@register("aten.masked_fill.Scalar")
def _masked_fill(call: OpCall) -> DimMap:
    # Filling with 0 keeps linearity in the first input; any other value does not.
    value = call.arg(2, "value")
    return pointwise_map(call, [_lin([0], [0])] if value == 0 else [])


# ---------------------------------------------------------------------------------------------
# Reductions


def reduction_map(call: OpCall, dims: Optional[Sequence[int]], keepdim: bool, kind: Optional[str], linear: bool) -> DimMap:
    """Input dims ``d0..``; reduced dims are factors of ``kind`` (``None``: may not be split)."""
    x = call.in_specs[0]
    nd = x.ndim
    red = set(range(nd)) if dims is None or len(dims) == 0 else {_norm_dim(d, nd) for d in dims}
    names = [f"d{i}" for i in range(nd)]
    sizes = {n: s for n, s in zip(names, x.shape)}
    outs: list[Optional[Dims]] = []
    for spec in call.out_specs:
        if spec is None:
            outs.append(None)
        elif keepdim:
            outs.append([() if i in red else (names[i],) for i in range(nd)])
        else:
            outs.append([(names[i],) for i in range(nd) if i not in red])
    reduce = {names[i]: kind for i in red} if kind else {}
    no_split = frozenset() if kind else frozenset(names[i] for i in red)
    fi, fo = _float_flags(call)
    lin = [_lin([0], [0], kind or "sum")] if linear else []
    ins: list[Dims] = [[(n,) for n in names]]
    ins += [None] * (len(call.in_specs) - 1)  # type: ignore[list-item]
    return DimMap(ins, outs, sizes, reduce=reduce, no_split=no_split, linear=lin, float_inputs=fi, float_outputs=fo)


@register("aten.sum.dim_IntList")
def _sum_dim(call: OpCall) -> DimMap:
    return reduction_map(call, call.arg(1, "dim"), bool(call.arg(2, "keepdim", False)), "sum", True)


@register("aten.sum.default")
def _sum_all(call: OpCall) -> DimMap:
    return reduction_map(call, None, False, "sum", True)


def _extreme_local(ctx, xs):
    """amax/amin of an empty block is the reduction's identity (-inf/+inf), not an error."""
    import torch

    call = ctx.call
    if xs[0].numel() == 0:
        fill = float("-inf") if call.op == "aten.amax.default" else float("inf")
        return torch.full(ctx.out_shape(0), fill, dtype=call.out_specs[0].dtype)
    return call.target(xs[0], *call.args[1:], **call.kwargs)


@register("aten.amax.default", local=_extreme_local)
def _amax(call: OpCall) -> DimMap:
    return reduction_map(call, call.arg(1, "dim", []), bool(call.arg(2, "keepdim", False)), "max", True)


@register("aten.amin.default", local=_extreme_local)
def _amin(call: OpCall) -> DimMap:
    return reduction_map(call, call.arg(1, "dim", []), bool(call.arg(2, "keepdim", False)), "min", True)


@register("aten.any.dim", "aten.all.dim", "aten.argmax.default", "aten.argmin.default", "aten.prod.dim_int")
def _whole_reduction(call: OpCall) -> DimMap:
    dim = call.arg(1, "dim")
    return reduction_map(call, None if dim is None else [dim], bool(call.arg(2, "keepdim", False)), None, False)


@register("aten.max.dim", "aten.min.dim")
def _max_dim(call: OpCall) -> DimMap:
    return reduction_map(call, [call.arg(1, "dim")], bool(call.arg(2, "keepdim", False)), None, False)


# mean over a split dim is a sum divided by the global count: a local rewrite (see mean_local).
def _mean_local(ctx, xs):
    import torch

    call = ctx.call
    x = xs[0]
    nd = call.in_specs[0].ndim
    dims = call.arg(1, "dim") if call.op != "aten.mean.default" else None
    keepdim = bool(call.arg(2, "keepdim", False)) if call.op != "aten.mean.default" else False
    red = list(range(nd)) if not dims else [_norm_dim(d, nd) for d in dims]
    count = 1
    for d in red:
        count *= call.in_specs[0].shape[d]
    dtype = call.out_specs[0].dtype
    return torch.sum(x, dim=red, keepdim=keepdim, dtype=dtype) / count


@register("aten.mean.dim", local=_mean_local)
def _mean_dim(call: OpCall) -> DimMap:
    return reduction_map(call, call.arg(1, "dim"), bool(call.arg(2, "keepdim", False)), "sum", True)


@register("aten.mean.default", local=_mean_local)
def _mean_all(call: OpCall) -> DimMap:
    return reduction_map(call, None, False, "sum", True)


# ---------------------------------------------------------------------------------------------
# Matmuls


@register("aten.mm.default")
def _mm(call: OpCall) -> DimMap:
    fi, fo = _float_flags(call)
    return from_spec(
        "m k, k n -> m n", [s.shape for s in call.in_specs], [call.out_specs[0].shape],
        reduce={"k": "sum"}, linear=[_lin([0], [0]), _lin([1], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.bmm.default")
def _bmm(call: OpCall) -> DimMap:
    fi, fo = _float_flags(call)
    return from_spec(
        "b m k, b k n -> b m n", [s.shape for s in call.in_specs], [call.out_specs[0].shape],
        reduce={"k": "sum"}, linear=[_lin([0], [0]), _lin([1], [0])], float_inputs=fi, float_outputs=fo,
    )


def _bias_dims(bias_shape: Sequence[int], out_names: Sequence[str], out_shape: Sequence[int]) -> str:
    off = len(out_shape) - len(bias_shape)
    return " ".join(
        out_names[off + k] if size == out_shape[off + k] and size != 1 else "1" for k, size in enumerate(bias_shape)
    )


@register("aten.addmm.default")
def _addmm(call: OpCall) -> DimMap:
    # addmm(bias, a, b) = bias + a @ b: bias is an addend, so it is P whenever the product is.
    out = call.out_specs[0].shape
    spec = f"{_bias_dims(call.in_specs[0].shape, ['m', 'n'], out)}, m k, k n -> m n"
    fi, fo = _float_flags(call)
    return from_spec(
        spec, [s.shape for s in call.in_specs], [out], reduce={"k": "sum"}, additive=frozenset({0}),
        linear=[_lin([0, 1], [0]), _lin([0, 2], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.baddbmm.default")
def _baddbmm(call: OpCall) -> DimMap:
    out = call.out_specs[0].shape
    spec = f"{_bias_dims(call.in_specs[0].shape, ['b', 'm', 'n'], out)}, b m k, b k n -> b m n"
    fi, fo = _float_flags(call)
    return from_spec(
        spec, [s.shape for s in call.in_specs], [out], reduce={"k": "sum"}, additive=frozenset({0}),
        linear=[_lin([0, 1], [0]), _lin([0, 2], [0])], float_inputs=fi, float_outputs=fo,
    )


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
    fi, fo = _float_flags(call)
    return DimMap(
        [ins], [outs], sizes, no_split=frozenset(no_split), linear=[_lin([0], [0])], float_inputs=fi, float_outputs=fo
    )


@register("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", size_args=((1, "size", 0),))
def _view(call: OpCall) -> DimMap:
    return view_map(call, call.in_specs[0].shape, call.out_specs[0].shape)


def permute_map(call: OpCall, perm: Sequence[int]) -> DimMap:
    x = call.in_specs[0]
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = _float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(names[p],) for p in perm]], dict(zip(names, x.shape)),
        linear=[_lin([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.permute.default")
def _permute(call: OpCall) -> DimMap:
    nd = call.in_specs[0].ndim
    return permute_map(call, [_norm_dim(d, nd) for d in call.arg(1, "dims")])


@register("aten.transpose.int")
def _transpose(call: OpCall) -> DimMap:
    nd = call.in_specs[0].ndim
    perm = list(range(nd))
    a, b = _norm_dim(call.arg(1, "dim0"), nd), _norm_dim(call.arg(2, "dim1"), nd)
    perm[a], perm[b] = perm[b], perm[a]
    return permute_map(call, perm)


@register("aten.t.default")
def _t(call: OpCall) -> DimMap:
    return permute_map(call, list(reversed(range(call.in_specs[0].ndim))))


@register("aten.expand.default", size_args=((1, "size", 0),))
def _expand(call: OpCall) -> DimMap:
    # A dim the input holds at size 1 is new in the output: the output may split it, the input stays B.
    return pointwise_map(call, [_lin([0], [0])])


@register("aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def _squeeze(call: OpCall) -> DimMap:
    return view_map(call, call.in_specs[0].shape, call.out_specs[0].shape)


@register("aten.slice.Tensor")
def _slice(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(1, "dim", 0), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    out_names = list(names)
    full = call.out_specs[0].shape[dim] == x.shape[dim]
    if not full:
        out_names[dim] = "sliced"
    fi, fo = _float_flags(call)
    sizes = dict(zip(names, x.shape))
    sizes["sliced"] = call.out_specs[0].shape[dim]
    return DimMap(
        [[(n,) for n in names]], [[(n,) for n in out_names]], sizes,
        no_split=frozenset() if full else frozenset({names[dim], "sliced"}),
        linear=[_lin([0], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.select.int")
def _select(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(1, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = _float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(n,) for i, n in enumerate(names) if i != dim]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), linear=[_lin([0], [0])], float_inputs=fi, float_outputs=fo,
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
        if o is not None:
            sizes.setdefault(f"_out{j}", call.out_specs[j].shape[dim])
    fi, fo = _float_flags(call)
    no = frozenset(f for f in sizes if f.startswith("_")) | {names[dim]}
    return DimMap(ins, outs, sizes, no_split=no, linear=[_lin(range(n_in), _all_outputs(call))], float_inputs=fi, float_outputs=fo)


@register("aten.cat.default")
def _cat(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(1, "dim", 0), x.ndim)
    n = len(call.in_specs)
    return _shared_except(
        call, dim, n, lambda names: [[(nm,) if i != dim else ("_out0",) for i, nm in enumerate(names)]]
    )


@register("aten.split.Tensor", "aten.split_with_sizes.default", "aten.unbind.int")
def _split(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(2, "dim", 0) if call.op != "aten.unbind.int" else call.arg(1, "dim", 0), x.ndim)
    unbind = call.op == "aten.unbind.int"

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
    dim = _norm_dim(call.arg(1, "dim", 0), x.ndim + 1)
    names = [f"d{i}" for i in range(x.ndim)]
    out = [(n,) for n in names]
    out.insert(dim, ("_stack",))
    fi, fo = _float_flags(call)
    sizes = dict(zip(names, x.shape))
    sizes["_stack"] = len(call.in_specs)
    return DimMap(
        [[(n,) for n in names] for _ in call.in_specs], [out], sizes, no_split=frozenset({"_stack"}),
        linear=[_lin(range(len(call.in_specs)), [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten._softmax.default", "aten._log_softmax.default")
def _softmax(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(1, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = _float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[(n,) for n in names]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), float_inputs=fi, float_outputs=fo,
    )


@register("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
def _softmax_backward(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    dim = _norm_dim(call.arg(2, "dim"), x.ndim)
    names = [f"d{i}" for i in range(x.ndim)]
    fi, fo = _float_flags(call)
    return DimMap(
        [[(n,) for n in names], [(n,) for n in names]], [[(n,) for n in names]], dict(zip(names, x.shape)),
        no_split=frozenset({names[dim]}), linear=[_lin([0], [0])], float_inputs=fi, float_outputs=fo,
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
    fi, fo = _float_flags(call)
    ins: list[Optional[Dims]] = [[(n,) for n in names]] + [None] * (len(call.in_specs) - 1)
    del out
    return DimMap(
        ins, outs, sizes, no_split=frozenset({names[dim]}) | {f for f in sizes if f.startswith("_")},
        linear=[_lin([0], _all_outputs(call))] if linear else [], float_inputs=fi, float_outputs=fo,
    )


@register("aten.cumsum.default")
def _cumsum(call: OpCall) -> DimMap:
    return along_dim_map(call, _norm_dim(call.arg(1, "dim"), call.in_specs[0].ndim), True)


@register("aten.topk.default")
def _topk(call: OpCall) -> DimMap:
    return along_dim_map(call, _norm_dim(call.arg(2, "dim", -1), call.in_specs[0].ndim), False)


@register("aten.sort.default")
def _sort(call: OpCall) -> DimMap:
    return along_dim_map(call, _norm_dim(call.arg(1, "dim", -1), call.in_specs[0].ndim), False)
