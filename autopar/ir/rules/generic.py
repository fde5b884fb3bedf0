"""Rules for the ops that are pure data: pointwise ops, reductions and matmuls (views and layout
ops are in ``layout.py``).

Each builder turns an ``OpCall`` into a ``DimMap``; the tables below say which ops use which
builder and in which inputs each op is linear (where ``P`` passes through).
"""

from __future__ import annotations

from typing import Optional, Sequence

from autopar.ir.rules.base import OpCall, register
from autopar.ir.rules.dimmap import DimMap, Dims, Linear, from_spec


def float_flags(call: OpCall) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Which of the call's inputs and outputs are floating point (only those may be partial sums)."""
    return (
        tuple(s.is_float for s in call.in_specs),
        tuple(s is not None and s.is_float for s in call.out_specs),
    )


def linear_in(inputs: Sequence[int], outputs: Sequence[int], kind: str = "sum") -> Linear:
    """The op is jointly linear in the inputs ``inputs``: when they all hold partial sums (of ``kind``),
    so do the outputs ``outputs``."""
    return Linear(frozenset(inputs), frozenset(outputs), kind)


def all_outputs(call: OpCall) -> list[int]:
    """Every output index of the call."""
    return [j for j, s in enumerate(call.out_specs) if s is not None]


def norm_dim(d: int, ndim: int) -> int:
    """A possibly negative dim index made non-negative for a tensor of ``ndim`` dims."""
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
    fi, fo = float_flags(call)
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
    "aten.floor_divide.default", "aten.floor_divide.Scalar",
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
    return pointwise_map(call, [linear_in([0], all_outputs(call))])


@register("aten.add.Tensor", "aten.sub.Tensor")
def _add(call: OpCall) -> DimMap:
    # Affine, not linear, when one operand is a Python scalar: x + 2 on P addends adds 2 n times.
    lin = [linear_in(range(len(call.in_specs)), [0])] if _n_tensor_operands(call, 2) else []
    return pointwise_map(call, lin)


@register("aten.mul.Tensor")
def _mul(call: OpCall) -> DimMap:
    n = len(call.in_specs)
    return pointwise_map(call, [linear_in([i], [0]) for i in range(n)])


@register("aten.div.Tensor")
def _div(call: OpCall) -> DimMap:
    from autopar.ir.graph import Ref

    lin = [linear_in([0], [0])] if isinstance(call.args[0], Ref) else []
    return pointwise_map(call, lin)


@register("aten.where.self")
def _where(call: OpCall) -> DimMap:
    from autopar.ir.graph import Ref

    # where(cond, a, b) is linear in a and b jointly (cond selects addends consistently).
    refs = [i for i, a in enumerate(call.args[:3]) if isinstance(a, Ref)]
    if len(refs) == 3:
        return pointwise_map(call, [linear_in([1, 2], [0])])
    return pointwise_map(call, [])


@register("aten.masked_fill.Scalar")
def _masked_fill(call: OpCall) -> DimMap:
    # Filling with 0 keeps linearity in the first input; any other value does not.
    value = call.arg(2, "value")
    return pointwise_map(call, [linear_in([0], [0])] if value == 0 else [])


# ---------------------------------------------------------------------------------------------
# Reductions


def reduction_map(call: OpCall, dims: Optional[Sequence[int]], keepdim: bool, kind: Optional[str], linear: bool) -> DimMap:
    """Input dims ``d0..``; reduced dims are factors of ``kind`` (``None``: may not be split)."""
    x = call.in_specs[0]
    nd = x.ndim
    red = set(range(nd)) if dims is None or len(dims) == 0 else {norm_dim(d, nd) for d in dims}
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
    fi, fo = float_flags(call)
    lin = [linear_in([0], [0], kind or "sum")] if linear else []
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
        return torch.full(ctx.out_shape(0), fill, dtype=call.out_specs[0].dtype, device=xs[0].device)
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
    red = list(range(nd)) if not dims else [norm_dim(d, nd) for d in dims]
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
    fi, fo = float_flags(call)
    return from_spec(
        "m k, k n -> m n", [s.shape for s in call.in_specs], [call.out_specs[0].shape],
        reduce={"k": "sum"}, linear=[linear_in([0], [0]), linear_in([1], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.bmm.default")
def _bmm(call: OpCall) -> DimMap:
    fi, fo = float_flags(call)
    return from_spec(
        "b m k, b k n -> b m n", [s.shape for s in call.in_specs], [call.out_specs[0].shape],
        reduce={"k": "sum"}, linear=[linear_in([0], [0]), linear_in([1], [0])], float_inputs=fi, float_outputs=fo,
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
    fi, fo = float_flags(call)
    return from_spec(
        spec, [s.shape for s in call.in_specs], [out], reduce={"k": "sum"}, additive=frozenset({0}),
        linear=[linear_in([0, 1], [0]), linear_in([0, 2], [0])], float_inputs=fi, float_outputs=fo,
    )


@register("aten.baddbmm.default")
def _baddbmm(call: OpCall) -> DimMap:
    out = call.out_specs[0].shape
    spec = f"{_bias_dims(call.in_specs[0].shape, ['b', 'm', 'n'], out)}, b m k, b k n -> b m n"
    fi, fo = float_flags(call)
    return from_spec(
        spec, [s.shape for s in call.in_specs], [out], reduce={"k": "sum"}, additive=frozenset({0}),
        linear=[linear_in([0, 1], [0]), linear_in([0, 2], [0])], float_inputs=fi, float_outputs=fo,
    )
