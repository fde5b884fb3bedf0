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
from autopar.ir.rules.generic import all_outputs, float_flags, linear_in
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


def _any_empty(ctx: LocalCtx, xs: list) -> bool:
    """Whether some input block is empty here though the whole input is not."""
    return any(x.numel() == 0 and s.numel > 0 for x, s in zip(xs, ctx.call.in_specs))


def _plain(ctx: LocalCtx, xs: list, over: Optional[dict] = None):
    """The op on local blocks, with the positional arguments in ``over`` (index -> value) replaced."""
    args, kwargs = substitute(ctx.call, xs)
    args = [(over or {}).get(i, a) for i, a in enumerate(args)]
    return ctx.call.target(*args, **kwargs)


def _guarded_local(ctx: LocalCtx, xs: list):
    """Zeros for every output when some input block is empty (the outputs then are empty too, or
    ``P`` addends); else the op itself."""
    if _any_empty(ctx, xs):
        return tuple(None if s is None else _zeros(ctx, j) for j, s in enumerate(ctx.call.out_specs))
    return _plain(ctx, xs)


def _dm(call: OpCall, ins, outs, sizes: dict, no_split=frozenset(), **kw) -> DimMap:
    """A DimMap with the sizes of its unmerged factors read off the shapes; ``_``-named factors
    (spatial dims, empty statistics) never split."""
    sizes = dict(sizes)
    for dims, spec in list(zip(ins, call.in_specs)) + list(zip(outs, call.out_specs)):
        for fs, n in zip(dims or [], spec.shape if spec is not None else []):
            if len(fs) == 1:
                sizes.setdefault(fs[0], n)
    fixed = frozenset(f for f in sizes if f.startswith("_"))
    fi, fo = float_flags(call)
    return DimMap(ins, outs, sizes, no_split=fixed | frozenset(no_split), float_inputs=fi, float_outputs=fo, **kw)


def _spatial(prefix: str, k: int) -> Dims:
    return [(f"_{prefix}{i}",) for i in range(k)]


# ---------------------------------------------------------------------------------------------
# Convolution: x [n, (g ci), *sp], w [(g co), ci, *k] (transposed: [(g ci), co, *k]), y [n, (g co), *sp']


def _conv_layout(x_shape, w_shape, transposed: bool, groups: int):
    k = len(x_shape) - 2
    cig = x_shape[1] // groups
    cog = w_shape[1] if transposed else w_shape[0] // groups
    sizes = {"n": x_shape[0], "g": groups, "ci": cig, "co": cog}
    x: Dims = [("n",), ("g", "ci")] + _spatial("x", k)
    w: Dims = ([("g", "ci"), ("co",)] if transposed else [("g", "co"), ("ci",)]) + _spatial("k", k)
    y: Dims = [("n",), ("g", "co")] + _spatial("y", k)
    return x, w, y, [("g", "co")], sizes


def _local_groups(call: OpCall, x_local: torch.Tensor, x_index: int, g_pos: int) -> int:
    """Groups on this device: a split of grouped channels splits whole groups (ci never splits then)."""
    groups = call.args[g_pos]
    return groups if groups == 1 else x_local.shape[1] // (call.in_specs[x_index].shape[1] // groups)


def _conv_local(ctx: LocalCtx, xs: list):
    call = ctx.call
    if _any_empty(ctx, xs):  # an empty block of input channels still adds its bias addend (P)
        out = _zeros(ctx, 0)
        if len(xs) > 2 and xs[2].numel() and out.numel():
            out = out + xs[2].reshape([1, -1] + [1] * (out.ndim - 2))
        return out
    return _plain(ctx, xs, {8: _local_groups(call, xs[0], 0, 8)})


@register("aten.convolution.default", local=_conv_local)
def _convolution(call: OpCall) -> DimMap:
    # (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    xs, ws = call.in_specs[0].shape, call.in_specs[1].shape
    x, w, y, b, sizes = _conv_layout(xs, ws, bool(call.args[6]), call.args[8])
    bias = [tensor_positions(call)[2]] if isinstance(call.args[2], Ref) else []
    return _dm(
        call, _by_position(call, {0: x, 1: w, 2: b}), [y], sizes, reduce={"ci": "sum"}, additive=frozenset(bias),
        linear=[linear_in([0] + bias, [0]), linear_in([1] + bias, [0])],
    )


def _conv_bw_local(ctx: LocalCtx, xs: list):
    call = ctx.call
    g_out = xs[0]
    if _any_empty(ctx, xs):
        outs = [None if s is None else _zeros(ctx, j) for j, s in enumerate(call.out_specs)]
        if call.out_specs[2] is not None:  # grad_bias needs only grad_out: may be B on a ci split
            outs[2] = g_out.sum([d for d in range(g_out.ndim) if d != 1])
        return tuple(outs)
    bias_sizes = None if call.args[3] is None else [g_out.shape[1]]
    return _plain(ctx, xs, {3: bias_sizes, 9: _local_groups(call, xs[1], 1, 9)})


def _conv_bw_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    return free_splits(dm, {"ci": {2} if call.out_specs[2] is not None else set()})


@register("aten.convolution_backward.default", extra=_conv_bw_extra, local=_conv_bw_local)
def _convolution_backward(call: OpCall) -> DimMap:
    # (grad_out, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
    #  groups, output_mask) -> (grad_input, grad_weight, grad_bias); the batch and the output
    # channels are summed over (P) in the gradients that lack them.
    _, xs, ws = (s.shape for s in call.in_specs)
    x, w, y, b, sizes = _conv_layout(xs, ws, bool(call.args[7]), call.args[9])
    outs = [None if s is None else d for s, d in zip(call.out_specs, [x, w, b])]
    lin = [linear_in([0], all_outputs(call))]
    lin += [linear_in([1], [1])] if outs[1] is not None else []
    lin += [linear_in([2], [0])] if outs[0] is not None else []
    return _dm(call, [y, x, w], outs, sizes, reduce={"n": "sum", "co": "sum"}, linear=lin)


# ---------------------------------------------------------------------------------------------
# Pooling: leading (batch, channel) dims pass through; the 2 or 3 pooled dims stay whole.

#: op name (``{}``: 2d or 3d) -> (spatial prefix per tensor input, per output; linear in input 0)
POOLS = {
    "max_pool{}_with_indices": (["x"], ["y", "y"], False),  # -> (out, indices into each plane)
    "max_pool{}_with_indices_backward": (["y", "x", "y"], ["x"], True),  # (grad, self, indices)
    "avg_pool{}": (["x"], ["y"], True),
    "avg_pool{}_backward": (["y", "x"], ["x"], True),
    "_adaptive_avg_pool{}": (["x"], ["y"], True),
    "_adaptive_avg_pool{}_backward": (["y", "x"], ["x"], True),
}


def _pool(call: OpCall) -> DimMap:
    k = 3 if "3d" in call.op else 2
    ins, outs, linear = POOLS[call.op[5:].rsplit(".", 1)[0].replace(f"{k}d", "{}")]
    lead = [[(f"d{i}",) for i in range(s.ndim - k)] for s in call.in_specs + call.out_specs]
    dims: list[Optional[Dims]] = [d + _spatial(p, k) for d, p in zip(lead, ins + outs)]
    return _dm(call, dims[: len(ins)], dims[len(ins) :], {}, linear=[linear_in([0], [0])] if linear else [])


def _pool_local(ctx: LocalCtx, xs: list):
    """The kernels trust that blocks agree (planes, indices inside a plane): a mismatch would corrupt memory."""
    k = 3 if "3d" in ctx.call.op else 2
    if any(t.shape[:-k] != xs[0].shape[:-k] for t in xs):
        raise RuntimeError(f"pooling blocks do not match: {[tuple(t.shape) for t in xs]}")
    if len(xs) == 3 and xs[2].numel():  # max pool backward: (grad, self, indices)
        if xs[2].shape != xs[0].shape or xs[2].min() < 0 or xs[2].max() >= xs[1].shape[-k:].numel():
            raise RuntimeError("max pool indices do not match their blocks")
    return _guarded_local(ctx, xs)


register(*[f"aten.{n.format(k)}.default" for n in POOLS for k in ("2d", "3d")], local=_pool_local)(_pool)


# ---------------------------------------------------------------------------------------------
# Batch norm: with batch statistics only the channel dim splits; with running statistics (eval)
# the op is pointwise per channel, and its weight/bias gradients sum over the other dims.


def _bn_map(call: OpCall, kinds: str, out_kinds: str, batch_stats: bool, linear: list, sums: bool = False) -> DimMap:
    """``kinds``/``out_kinds``: per positional tensor argument / output, ``x`` (input-shaped) or ``c``
    (per channel). An absent statistic is an empty tensor that never splits; with batch statistics
    only the channel splits; ``sums``: outputs lacking a dim sum over it (eval-mode gradients)."""
    names = [f"d{i}" for i in range(call.in_specs[0].ndim)]
    pick: dict[str, Dims] = {"x": [(n,) for n in names], "c": [("d1",)]}
    ins = _by_position(call, {p: pick[k] for p, k in enumerate(kinds)})
    sizes: dict[str, int] = {}
    specs = list(zip(ins, call.in_specs)) + list(zip([pick[k] for k in out_kinds], call.out_specs))
    dims: list[Optional[Dims]] = []
    for i, (d, s) in enumerate(specs):
        if s is not None and d is not None and s.numel == 0:
            d, sizes[f"_e{i}"] = [(f"_e{i}",)], 0
        dims.append(None if s is None else d)
    other = frozenset(names) - {"d1"}
    return _dm(
        call, dims[: len(ins)], dims[len(ins) :], sizes, no_split=other if batch_stats else frozenset(),
        reduce={f: "sum" for f in other} if sums and not batch_stats else {}, linear=linear,
    )


def _bn_affine(call: OpCall) -> list:
    """``out = xhat * weight + bias``: linear in weight and bias together."""
    pos = tensor_positions(call)
    return [linear_in([pos[p] for p in (1, 2) if p in pos], [0])] if 1 in pos else []


def _bn_local(ctx: LocalCtx, xs: list):
    """The kernels do not check per-channel tensors against the input (a mismatch corrupts memory)."""
    x = xs[0]
    for t, s in zip(xs, ctx.call.in_specs):
        if (t.ndim == x.ndim and t.shape != x.shape) or (t.ndim == 1 and s.numel and t.numel() != x.shape[1]):
            raise RuntimeError(f"batch norm blocks do not match: {tuple(t.shape)} against input {tuple(x.shape)}")
    return _guarded_local(ctx, xs)


def _bn_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    empty = {j for j, s in enumerate(call.out_specs) if s is not None and s.numel == 0}
    return free_splits(dm, {f: empty for f in dm.factors()})


@register("aten._native_batch_norm_legit_functional.default", extra=_bn_extra, local=_bn_local)
def _batch_norm(call: OpCall) -> DimMap:
    # (input, weight?, bias?, running_mean, running_var, training, momentum, eps)
    #   -> (out, save_mean, save_invstd, new_running_mean, new_running_var)
    return _bn_map(call, "xcccc", "xcccc", bool(call.args[5]), _bn_affine(call))


@register("aten._native_batch_norm_legit_no_training.default", extra=_bn_extra, local=_bn_local)
def _batch_norm_eval(call: OpCall) -> DimMap:
    # (input, weight?, bias?, running_mean, running_var, momentum, eps) -> (out, empty, empty)
    return _bn_map(call, "xcccc", "xcc", False, _bn_affine(call))


@register("aten.native_batch_norm_backward.default", local=_bn_local)
def _batch_norm_backward(call: OpCall) -> DimMap:
    # (grad_out, input, weight?, running_mean?, running_var?, save_mean?, save_invstd?, train, eps,
    #  output_mask) -> (grad_input, grad_weight, grad_bias); linear in grad_out
    return _bn_map(call, "xxccccc", "xcc", bool(call.args[7]), [linear_in([0], all_outputs(call))], True)
