"""Rules for the CNN ops: convolution, pooling and batch norm (with their backwards).

Spatial dims never split (a split would need a halo exchange); the batch and channel dims do.
Grouped convolutions split whole groups (the local op runs with the local group count). Kernels
that crash or misbehave on empty blocks (a dim smaller than the mesh axis) are bypassed: an empty
block contributes zeros.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from autopar.ir.graph import Ref
from autopar.ir.placement import B
from autopar.ir.rules.base import LocalCtx, OpCall, register, substitute
from autopar.ir.rules.dimmap import DimMap, Dims, Signature, split_signature
from autopar.ir.rules.generic import _all_outputs, _float_flags, _lin
from autopar.ir.rules.special import _by_position, _zeros, tensor_positions


def free_splits(dm: DimMap, free: dict[str, set[int]]) -> list[Signature]:
    """Splits a DimMap cannot say: outputs ``free[f]`` do not depend on factor ``f`` at all, so a
    split of ``f`` leaves them ``B`` (every device computes them whole from unsplit inputs)."""
    out = []
    for f, outs in free.items():
        if f not in dm.sizes or dm.sizes[f] < 2 or not outs or split_signature(dm, f) is not None:
            continue
        tmp = dataclasses.replace(dm, outputs=[None if j in outs else d for j, d in enumerate(dm.outputs)])
        sig = split_signature(tmp, f)
        if sig is not None:
            placed = tuple(B if j in outs else p for j, p in enumerate(sig.outputs))
            out.append(Signature(sig.inputs, placed, sig.tag))
    return out


def _empty_outputs(call: OpCall) -> set[int]:
    return {j for j, s in enumerate(call.out_specs) if s is not None and s.numel == 0}


def _any_empty(xs: list) -> bool:
    return any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in xs)


def _plain(ctx: LocalCtx, xs: list, **over):
    """The op on local blocks with the named positional arguments (by index) replaced."""
    args, kwargs = substitute(ctx.call, xs)
    args = list(args)
    for pos, value in over.items():
        args[int(pos[1:])] = value
    return ctx.call.target(*args, **kwargs)


def _guarded_local(ctx: LocalCtx, xs: list):
    """Zeros for every output when some input block is empty (the outputs then are empty too, or
    ``P`` addends); else the op itself."""
    if _any_empty(xs):
        return tuple(None if s is None else _zeros(ctx, j) for j, s in enumerate(ctx.call.out_specs))
    return _plain(ctx, xs)


def _dm(ins, outs, sizes, no_split=frozenset(), **kw) -> DimMap:
    """A DimMap whose ``_``-named factors (spatial dims, empty statistics) never split."""
    fixed = frozenset(f for f in sizes if f.startswith("_"))
    return DimMap(ins, outs, sizes, no_split=fixed | frozenset(no_split), **kw)


def _spatial(prefix: str, k: int) -> Dims:
    return [(f"_{prefix}{i}",) for i in range(k)]


# ---------------------------------------------------------------------------------------------
# Convolution: x [n, (g ci), *sp], w [(g co), ci, *k] (transposed: [(g ci), co, *k]), y [n, (g co), *sp']


def _conv_layout(call: OpCall, x_shape, w_shape, transposed: bool, groups: int):
    k = len(x_shape) - 2
    cig = x_shape[1] // groups
    cog = w_shape[1] if transposed else w_shape[0] // groups
    sizes = {"n": x_shape[0], "g": groups, "ci": cig, "co": cog}
    x: Dims = [("n",), ("g", "ci")] + _spatial("x", k)
    w: Dims = ([("g", "ci"), ("co",)] if transposed else [("g", "co"), ("ci",)]) + _spatial("k", k)
    y: Dims = [("n",), ("g", "co")] + _spatial("y", k)
    return x, w, y, [("g", "co")], sizes


def _sizes_with(sizes: dict, dims_shapes) -> dict:
    out = dict(sizes)
    for dims, shape in dims_shapes:
        for fs, n in zip(dims, shape):
            for f in fs:
                out.setdefault(f, n)
    return out


def _conv_local(ctx: LocalCtx, xs: list):
    call = ctx.call
    x = xs[0]
    cig = call.in_specs[0].shape[1] // call.args[8]
    if _any_empty(xs):
        out = _zeros(ctx, 0)
        bias = xs[2] if len(xs) > 2 else None
        if bias is not None and bias.numel() and out.numel():
            out = out + bias.reshape([1, -1] + [1] * (out.ndim - 2))
        return out
    return _plain(ctx, xs, a8=x.shape[1] // cig)


@register("aten.convolution.default", local=_conv_local)
def _convolution(call: OpCall) -> DimMap:
    # (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    xs, ws = call.in_specs[0].shape, call.in_specs[1].shape
    x, w, y, b, sizes = _conv_layout(call, xs, ws, bool(call.args[6]), call.args[8])
    ins = _by_position(call, {0: x, 1: w, 2: b})
    sizes = _sizes_with(sizes, [(x, xs), (w, ws), (y, call.out_specs[0].shape)])
    fi, fo = _float_flags(call)
    bias = [tensor_positions(call)[2]] if isinstance(call.args[2], Ref) else []
    return _dm(
        ins, [y], sizes, reduce={"ci": "sum"}, additive=frozenset(bias),
        linear=[_lin([0] + bias, [0]), _lin([1] + bias, [0])], float_inputs=fi, float_outputs=fo,
    )


def _conv_bw_local(ctx: LocalCtx, xs: list):
    call = ctx.call
    g_out = xs[0]
    if _any_empty(xs):
        outs = [None if s is None else _zeros(ctx, j) for j, s in enumerate(call.out_specs)]
        if call.out_specs[2] is not None:  # grad_bias needs only grad_out: may be B on a ci split
            outs[2] = g_out.sum([d for d in range(g_out.ndim) if d != 1])
        return tuple(outs)
    cig = call.in_specs[1].shape[1] // call.args[9]
    bias_sizes = None if call.args[3] is None else [g_out.shape[1]]
    return _plain(ctx, xs, a3=bias_sizes, a9=xs[1].shape[1] // cig)


def _conv_bw_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    return free_splits(dm, {"ci": {2} if call.out_specs[2] is not None else set()})


@register("aten.convolution_backward.default", extra=_conv_bw_extra, local=_conv_bw_local)
def _convolution_backward(call: OpCall) -> DimMap:
    # (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
    #  groups, output_mask) -> (grad_input, grad_weight, grad_bias); the batch and the output
    # channels are summed over (P) in the gradients that lack them.
    gs, xs, ws = (s.shape for s in call.in_specs)
    x, w, y, b, sizes = _conv_layout(call, xs, ws, bool(call.args[7]), call.args[9])
    sizes = _sizes_with(sizes, [(x, xs), (w, ws), (y, gs)])
    outs = [None if s is None else d for s, d in zip(call.out_specs, [x, w, b])]
    lin = [_lin([0], _all_outputs(call))]
    lin += [_lin([1], [1])] if outs[1] is not None else []
    lin += [_lin([2], [0])] if outs[0] is not None else []
    fi, fo = _float_flags(call)
    return _dm(
        [y, x, w], outs, sizes, reduce={"n": "sum", "co": "sum"}, linear=lin, float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# Pooling: leading (batch, channel) dims pass through; the pooled dims stay whole.


def _pool_dims(ndim: int, k: int, prefix: str) -> Dims:
    return [(f"d{i}",) for i in range(ndim - k)] + _spatial(prefix, k)


def _pool_map(call: OpCall, k: int, ins: list[tuple[int, str]], outs: list[str], linear: bool) -> DimMap:
    """``ins``: (tensor index, spatial prefix) per tensor input; ``outs``: spatial prefix per output."""
    dims: list[Optional[Dims]] = [None] * len(call.in_specs)
    for i, prefix in ins:
        dims[i] = _pool_dims(call.in_specs[i].ndim, k, prefix)
    odims: list[Optional[Dims]] = [_pool_dims(s.ndim, k, p) for s, p in zip(call.out_specs, outs)]
    sizes = _sizes_with({}, [(d, s.shape) for d, s in zip(dims, call.in_specs) if d is not None])
    sizes = _sizes_with(sizes, [(d, s.shape) for d, s in zip(odims, call.out_specs)])
    fi, fo = _float_flags(call)
    return _dm(dims, odims, sizes, linear=[_lin([0], [0])] if linear else [], float_inputs=fi, float_outputs=fo)


def _pool_k(call: OpCall) -> int:
    """Pooled dims: 2 or 3 by the op's name (a kernel size of one entry applies to all of them)."""
    return 3 if "3d" in call.op else 2


@register("aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default", local=_guarded_local)
def _max_pool(call: OpCall) -> DimMap:
    # (self, kernel_size, stride, padding, dilation, ceil_mode) -> (out, indices into each plane)
    return _pool_map(call, _pool_k(call), [(0, "x")], ["y", "y"], False)


@register(
    "aten.max_pool2d_with_indices_backward.default", "aten.max_pool3d_with_indices_backward.default",
    local=_guarded_local,
)
def _max_pool_backward(call: OpCall) -> DimMap:
    # (grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices): linear in grad
    return _pool_map(call, _pool_k(call), [(0, "y"), (1, "x"), (2, "y")], ["x"], True)


@register("aten.avg_pool2d.default", "aten.avg_pool3d.default", local=_guarded_local)
def _avg_pool(call: OpCall) -> DimMap:
    return _pool_map(call, _pool_k(call), [(0, "x")], ["y"], True)


@register("aten.avg_pool2d_backward.default", "aten.avg_pool3d_backward.default", local=_guarded_local)
def _avg_pool_backward(call: OpCall) -> DimMap:
    return _pool_map(call, _pool_k(call), [(0, "y"), (1, "x")], ["x"], True)


@register("aten._adaptive_avg_pool2d.default", "aten._adaptive_avg_pool3d.default", local=_guarded_local)
def _adaptive_avg_pool(call: OpCall) -> DimMap:
    return _pool_map(call, _pool_k(call), [(0, "x")], ["y"], True)


@register(
    "aten._adaptive_avg_pool2d_backward.default", "aten._adaptive_avg_pool3d_backward.default", local=_guarded_local
)
def _adaptive_avg_pool_backward(call: OpCall) -> DimMap:
    return _pool_map(call, _pool_k(call), [(0, "y"), (1, "x")], ["x"], True)


# ---------------------------------------------------------------------------------------------
# Batch norm: with batch statistics only the channel dim splits; with running statistics (eval)
# the op is pointwise per channel, and its weight/bias gradients sum over the other dims.


def _bn_dims(call: OpCall, x_index: int, per_arg: dict[int, str], outs: list[str], batch_stats: bool):
    x = call.in_specs[x_index]
    names = [f"d{i}" for i in range(x.ndim)]
    full: Dims = [(n,) for n in names]
    chan: Dims = [("d1",)]
    other = frozenset(n for n in names if n != "d1")
    pick = {"x": full, "c": chan}
    ins = _by_position(call, {p: pick[v] for p, v in per_arg.items()})
    sizes = dict(zip(names, x.shape))
    for i, s in enumerate(call.in_specs):  # an absent statistic is an empty tensor: never split
        if ins[i] is not None and s.numel == 0:
            ins[i], sizes[f"_i{i}"] = [(f"_i{i}",)], 0
    odims: list[Optional[Dims]] = []
    for j, (s, kind) in enumerate(zip(call.out_specs, outs)):
        if s is not None and s.numel == 0 and kind == "c":
            odims.append([(f"_o{j}",)])
            sizes[f"_o{j}"] = 0
        else:
            odims.append(None if s is None else pick[kind])
    return ins, odims, sizes, other if batch_stats else frozenset(), other


def _bn_affine(call: OpCall) -> list:
    pos = tensor_positions(call)
    wb = [pos[p] for p in (1, 2) if p in pos]
    return [_lin(wb, [0])] if 1 in pos else []


def _bn_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    return free_splits(dm, {f: _empty_outputs(call) for f in dm.factors()})


@register("aten._native_batch_norm_legit_functional.default", extra=_bn_extra, local=_guarded_local)
def _batch_norm(call: OpCall) -> DimMap:
    # (input, weight?, bias?, running_mean, running_var, training, momentum, eps)
    #   -> (out, save_mean, save_invstd, new_running_mean, new_running_var)
    ins, outs, sizes, no, _ = _bn_dims(call, 0, {0: "x", 1: "c", 2: "c", 3: "c", 4: "c"}, ["x", "c", "c", "c", "c"], bool(call.args[5]))
    fi, fo = _float_flags(call)
    return _dm(ins, outs, sizes, no_split=no, linear=_bn_affine(call), float_inputs=fi, float_outputs=fo)


@register("aten._native_batch_norm_legit_no_training.default", extra=_bn_extra, local=_guarded_local)
def _batch_norm_eval(call: OpCall) -> DimMap:
    # (input, weight?, bias?, running_mean, running_var, momentum, eps) -> (out, empty, empty)
    ins, outs, sizes, _, _ = _bn_dims(call, 0, {0: "x", 1: "c", 2: "c", 3: "c", 4: "c"}, ["x", "c", "c"], False)
    fi, fo = _float_flags(call)
    return _dm(ins, outs, sizes, linear=_bn_affine(call), float_inputs=fi, float_outputs=fo)


@register("aten.native_batch_norm_backward.default", local=_guarded_local)
def _batch_norm_backward(call: OpCall) -> DimMap:
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps,
    #  output_mask) -> (grad_input, grad_weight, grad_bias)
    train = bool(call.args[7])
    per = {0: "x", 1: "x", 2: "c", 3: "c", 4: "c", 5: "c", 6: "c"}
    ins, outs, sizes, no, other = _bn_dims(call, 0, per, ["x", "c", "c"], train)
    reduce = {} if train else {f: "sum" for f in other}
    fi, fo = _float_flags(call)
    return _dm(
        ins, outs, sizes, reduce=reduce, no_split=no, linear=[_lin([0], _all_outputs(call))],
        float_inputs=fi, float_outputs=fo,
    )
