"""Rules whose local implementation needs this device's offsets, or whose DimMap needs care:
embeddings split on the vocabulary, loss-parallel cross-entropy, attention split on the query
sequence under a causal mask, norms, factory ops (``arange``, ``full``) and ``tril``/``triu``.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.graph import Ref
from autopar.ir.placement import B, P, Split
from autopar.ir.rules.base import LocalCtx, OpCall, register, substitute
from autopar.ir.rules.dimmap import DimMap, Dims, Linear, Signature
from autopar.ir.rules.generic import all_outputs, float_flags, linear_in, pointwise_map
from autopar.ir.rules.shared_kv import scatter_kv_grads, select_kv, shared_kv_bwd, shared_kv_fwd

aten = torch.ops.aten


def tensor_positions(call: OpCall) -> dict[int, int]:
    """Positional argument index -> index among the tensor inputs (top-level Refs only)."""
    out, k = {}, 0
    for pos, a in enumerate(call.args):
        if isinstance(a, Ref):
            out[pos] = k
            k += 1
        elif isinstance(a, (list, tuple)):
            k += sum(isinstance(x, Ref) for x in a)
    return out


def _splits_dim(ctx: LocalCtx, i: int, dim: int) -> bool:
    return any(isinstance(p, Split) and p.dim == dim for p in ctx.in_placements(i))


def _zeros(ctx: LocalCtx, j: int) -> torch.Tensor:
    spec = ctx.call.out_specs[j]
    assert spec is not None
    return torch.zeros(ctx.out_shape(j), dtype=spec.dtype, device=ctx.device)


def _masked_ids(ids: torch.Tensor, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids shifted into this device's vocabulary block, and where they fall inside it."""
    local = ids - start
    valid = (local >= 0) & (local < length)
    return torch.where(valid, local, torch.zeros_like(local)), valid


# ---------------------------------------------------------------------------------------------
# Embedding: a vocabulary split gathers only local rows; the others contribute zeros (output P).


def _embedding_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    if not call.in_specs[0].is_float or call.in_specs[0].shape[0] < 2:
        return []
    return [Signature((Split(0), B), (P,), "vocab")]


def _embedding_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    w, ids = xs
    if not _splits_dim(ctx, 0, 0):
        return aten.embedding.default(w, ids, *ctx.call.args[2:])
    start, length = ctx.in_range(0, 0)
    if length == 0:
        return _zeros(ctx, 0)
    local, valid = _masked_ids(ids, start, length)
    return aten.embedding.default(w, local) * valid.unsqueeze(-1).to(w.dtype)


@register("aten.embedding.default", extra=_embedding_extra, local=_embedding_local, balanced_ok=True)
def _embedding(call: OpCall) -> DimMap:
    w, ids = call.in_specs
    idn = [f"i{k}" for k in range(ids.ndim)]
    sizes = {"v": w.shape[0], "e": w.shape[1], **dict(zip(idn, ids.shape))}
    fi, fo = float_flags(call)
    return DimMap(
        [[("v",), ("e",)], [(n,) for n in idn]], [[(n,) for n in idn] + [("e",)]], sizes,
        no_split=frozenset({"v"}), linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


def _embedding_backward_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    grad, ids = xs
    num_weights, padding_idx, scale = ctx.call.args[2], ctx.call.args[3], ctx.call.args[4]
    start, length = ctx.out_range(0, 0)
    if length == num_weights:
        return aten.embedding_dense_backward.default(grad, ids, num_weights, padding_idx, scale)
    if length == 0:
        return _zeros(ctx, 0)
    local, valid = _masked_ids(ids, start, length)
    grad = grad * valid.unsqueeze(-1).to(grad.dtype)
    pad = padding_idx - start if 0 <= padding_idx - start < length else -1
    return aten.embedding_dense_backward.default(grad, local, length, pad, scale)


@register("aten.embedding_dense_backward.default", local=_embedding_backward_local, balanced_ok=True)
def _embedding_backward(call: OpCall) -> DimMap:
    # Token dims are summed into the weight gradient (P); a vocabulary split keeps local rows.
    grad, ids = call.in_specs
    idn = [f"i{k}" for k in range(ids.ndim)]
    sizes = {"v": call.out_specs[0].shape[0], "e": grad.shape[-1], **dict(zip(idn, ids.shape))}
    fi, fo = float_flags(call)
    no = frozenset({"v"}) if call.args[4] else frozenset()  # scale_grad_by_freq counts globally
    return DimMap(
        [[(n,) for n in idn] + [("e",)], [(n,) for n in idn]], [[("v",), ("e",)]], sizes,
        reduce={n: "sum" for n in idn}, linear=[linear_in([0], [0])], no_split=no, float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# nll_loss: batch split (sum reduction: capture rewrites mean into sum / total_weight) and the
# loss-parallel class split, where each device scores only the targets in its class block.


def _nll_reduction(call: OpCall) -> int:
    return call.arg(3, "reduction", 1)


def _has_weight(call: OpCall) -> bool:
    """Whether the forward ``nll_loss_forward(self, target, weight, ...)`` weighs the classes."""
    return isinstance(call.arg(2, "weight"), Ref)


def _has_weight_bw(call: OpCall) -> bool:
    """Whether ``nll_loss_backward(grad_output, self, target, weight, ...)`` weighs the classes."""
    return isinstance(call.arg(3, "weight"), Ref)


def _nll_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    if _has_weight(call) or call.in_specs[0].ndim != 2 or call.in_specs[0].shape[1] < 2:
        return []
    return [Signature((Split(1), B), (P, B), "classes")]


def _nll_local(ctx: LocalCtx, xs: list) -> tuple:
    call = ctx.call
    reduction, ignore = _nll_reduction(call), call.arg(4, "ignore_index", -100)
    if call.in_specs[0].ndim != 2 or not _splits_dim(ctx, 0, 1):
        args, kwargs = substitute(call, xs)
        return call.target(*args, **kwargs)
    logp, target = xs[0], xs[1]
    start, length = ctx.in_range(0, 1)
    counted = target != ignore
    total = counted.sum().to(logp.dtype)
    local, valid = _masked_ids(target, start, length)
    valid = valid & counted
    picked = -torch.gather(logp, 1, local.unsqueeze(1)).squeeze(1) if length else torch.zeros(
        target.shape, dtype=logp.dtype, device=logp.device
    )
    picked = picked * valid.to(logp.dtype)
    if reduction == 0:
        return picked, total
    out = picked.sum()
    return (out / total if reduction == 1 else out), total


@register("aten.nll_loss_forward.default", extra=_nll_extra, local=_nll_local)
def _nll_forward(call: OpCall) -> DimMap:
    x = call.in_specs[0]
    red = _nll_reduction(call)
    batch = ("n",) if x.ndim == 2 else ()
    dims_x: Dims = [batch, ("c",)] if x.ndim == 2 else [("c",)]
    ins: list[Optional[Dims]] = [dims_x, [batch] if x.ndim == 2 else []]
    if _has_weight(call):
        ins.append([("c",)])
    out: Dims = [batch] if red == 0 and x.ndim == 2 else []
    sizes = {"c": x.shape[-1], "n": x.shape[0] if x.ndim == 2 else 1}
    # total_weight sums over the batch too, so a batch split leaves both outputs partial.
    reduce = {"n": "sum"} if red in (0, 2) else {}
    fi, fo = float_flags(call)
    return DimMap(
        ins, [out, []], sizes, reduce=reduce, no_split=frozenset({"c"}) | (frozenset() if reduce else {"n"}),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


def _nll_backward_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    if _has_weight_bw(call) or call.in_specs[1].ndim != 2 or call.in_specs[1].shape[1] < 2:
        return []
    ins = [B] * len(call.in_specs)
    ins[1] = Split(1)
    return [Signature(tuple(ins), (Split(1),), "classes")]


def _nll_backward_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    call = ctx.call
    if call.in_specs[1].ndim != 2 or not _splits_dim(ctx, 1, 1):
        args, kwargs = substitute(call, xs)
        return call.target(*args, **kwargs)
    grad, logp, target, total = xs[0], xs[1], xs[2], xs[-1]
    reduction, ignore = _nll_reduction_bw(call), call.arg(5, "ignore_index", -100)
    start, length = ctx.in_range(1, 1)
    local, valid = _masked_ids(target, start, length)
    valid = valid & (target != ignore)
    scale = -grad if reduction == 0 else -grad.expand(target.shape)
    if reduction == 1:
        scale = scale / total
    out = torch.zeros_like(logp)
    if length:
        out.scatter_(1, local.unsqueeze(1), (scale * valid.to(logp.dtype)).unsqueeze(1))
    return out


def _nll_reduction_bw(call: OpCall) -> int:
    return call.arg(4, "reduction", 1)


@register("aten.nll_loss_backward.default", extra=_nll_backward_extra, local=_nll_backward_local)
def _nll_backward(call: OpCall) -> DimMap:
    # (grad_output, self, target, weight?, reduction, ignore_index, total_weight)
    x = call.in_specs[1]
    red = _nll_reduction_bw(call)
    two = x.ndim == 2
    batch = ("n",) if two else ()
    ins: list[Optional[Dims]] = [[batch] if red == 0 and two else [], [batch, ("c",)] if two else [("c",)], [batch] if two else []]
    if _has_weight_bw(call):
        ins.append([("c",)])
    ins.append([])  # total_weight
    sizes = {"c": x.shape[-1], "n": x.shape[0] if two else 1}
    fi, fo = float_flags(call)
    return DimMap(
        ins, [[batch, ("c",)] if two else [("c",)]], sizes, no_split=frozenset({"c"}),
        linear=[linear_in([0], [0])], float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# Fused attention (CPU flash kernel, as captured on fake CPU tensors). Batch and heads split
# freely; the query sequence splits too, and under a causal mask each device's block of queries
# needs its row offset in the mask.


def _causal_mask(q_start: int, q_len: int, kv_len: int, dtype: torch.dtype,
                 device: Optional[torch.device] = None) -> torch.Tensor:
    rows = torch.arange(q_start, q_start + q_len, device=device).unsqueeze(1)
    cols = torch.arange(kv_len, device=device).unsqueeze(0)
    return torch.zeros(q_len, kv_len, dtype=dtype, device=device).masked_fill(cols > rows, float("-inf"))


def _attention_dims(call: OpCall, n_lead: int, mask_index: int) -> tuple[list[Optional[Dims]], Dims, Dims, dict[str, int]]:
    """Dims of q, k, v (and an explicit mask), the query-side ``[b heads s e]`` and key-side heads.

    With grouped-query attention (k/v with fewer heads), q's heads are the merged dim
    ``(hk g)``: splitting ``hk`` splits q and k/v heads together and keeps the grouping; ``g``
    (the queries sharing one kv head) splits q alone, which only lines up when ``hk`` is 1.
    """
    q, k, v = call.in_specs[n_lead : n_lead + 3]
    h, hk = q.shape[1], k.shape[1]
    qh: tuple[str, ...] = ("h",) if h == hk else ("hk", "g")
    kh: tuple[str, ...] = ("h",) if h == hk else ("hk",)
    sizes = {"b": q.shape[0], "h": h, "hk": hk, "g": h // max(hk, 1), "s": q.shape[2], "t": k.shape[2],
             "d": q.shape[3], "e": v.shape[3]}
    ins: list[Optional[Dims]] = [
        [("b",), qh, ("s",), ("d",)],
        [("b",), kh, ("t",), ("d",)],
        [("b",), kh, ("t",), ("e",)],
    ]
    if len(call.in_specs) > mask_index:  # an explicit mask, broadcast against [b heads s t]
        m = call.in_specs[mask_index]
        full, full_sizes = [("b",), qh, ("s",), ("t",)], [sizes["b"], h, sizes["s"], sizes["t"]]
        off = 4 - m.ndim
        ins.append([full[off + i] if size == full_sizes[off + i] and size != 1 else () for i, size in enumerate(m.shape)])
    return ins, [("b",), qh, ("s",), ("e",)], [("b",), kh], sizes


def _is_causal(call: OpCall, pos: int) -> bool:
    return bool(call.arg(pos, "is_causal", False))


def _attention_local_call(ctx: LocalCtx, xs: list, q_index: int, causal_pos: int, backward: bool):
    call = ctx.call
    out_shapes_empty = any(0 in ctx.out_shape(j) for j in range(len(call.out_specs)) if call.out_specs[j] is not None)
    q = xs[q_index]
    if q.numel() == 0 or xs[q_index + 1].numel() == 0 or out_shapes_empty:
        # The CPU kernel crashes (SIGFPE) on empty blocks; an empty block contributes zeros.
        return tuple(_zeros(ctx, j) for j in range(len(call.out_specs)))
    xs, kv_heads = select_kv(ctx, xs, q_index)  # grouped-query heads split with k/v whole
    _check_attention_blocks(xs, q_index, backward)
    args, kwargs = substitute(call, xs)
    if _is_causal(call, causal_pos) and _splits_dim(ctx, q_index, 2):
        # torch's is_causal aligns the mask top-left, i.e. assumes this block starts at query 0.
        start, length = ctx.in_range(q_index, 2)
        args = list(args)
        if causal_pos < len(args):
            args[causal_pos] = False
        else:
            kwargs["is_causal"] = False
        kwargs["attn_mask"] = _causal_mask(start, length, xs[q_index + 1].shape[2], q.dtype, q.device)
        args = tuple(args)
    out = call.target(*args, **kwargs)
    return scatter_kv_grads(ctx, out, kv_heads) if backward and kv_heads is not None else out


def _check_attention_blocks(xs: list, q_index: int, backward: bool) -> None:
    """The CPU kernel does not check its operands and dies (SIGFPE) on inconsistent blocks: check here."""
    q, k, v = xs[q_index : q_index + 3]
    ok = q.ndim == k.ndim == v.ndim == 4 and q.shape[0] == k.shape[0] == v.shape[0] and k.shape[1] == v.shape[1]
    ok = ok and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0  # grouped-query attention
    ok = ok and q.shape[3] == k.shape[3] and k.shape[2] == v.shape[2]
    if backward:
        grad, out, lse = xs[0], xs[4], xs[5]
        ok = ok and grad.shape == out.shape == q.shape[:3] + v.shape[3:] and lse.shape == q.shape[:3]
    if not ok:
        shapes = ", ".join(str(tuple(x.shape)) for x in xs)
        raise RuntimeError(f"attention blocks have inconsistent shapes: {shapes}")


def _attention_fwd_local(ctx: LocalCtx, xs: list):
    return _attention_local_call(ctx, xs, 0, 4, False)


def _attention_bwd_local(ctx: LocalCtx, xs: list):
    return _attention_local_call(ctx, xs, 1, 7, True)


@register(ATTN_FWD, extra=shared_kv_fwd, local=_attention_fwd_local)
def _attention(call: OpCall) -> DimMap:
    # (q, k, v, dropout_p, is_causal, *, attn_mask, scale) -> (out [b h s e], logsumexp [b h s])
    ins, qside, _, sizes = _attention_dims(call, 0, 3)
    fi, fo = float_flags(call)
    return DimMap(
        ins, [qside, qside[:3]], sizes, no_split=frozenset({"t", "d", "e"}), float_inputs=fi, float_outputs=fo
    )


@register(ATTN_BWD, extra=shared_kv_bwd, local=_attention_bwd_local)
def _attention_backward(call: OpCall) -> DimMap:
    # (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)
    ins, qside, kside, sizes = _attention_dims(call, 1, 6)
    all_ins: list[Optional[Dims]] = [qside] + ins[:3] + [qside, qside[:3]] + ins[3:]
    fi, fo = float_flags(call)
    # dK and dV sum over query positions (and over the query heads sharing a kv head): a split
    # there leaves them partial.
    return DimMap(
        all_ins, [ins[0], kside + [("t",), ("d",)], kside + [("t",), ("e",)]], sizes,
        reduce={"s": "sum", "g": "sum"}, no_split=frozenset({"t", "d", "e"}),
        linear=[linear_in([0], [0, 1, 2])], float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# Layer norm: the normalised dims stay whole; the weight and bias gradients sum over the rest.


def _norm_layout(call: OpCall, x_index: int, shape_pos: int):
    x = call.in_specs[x_index]
    k = len(call.arg(shape_pos, "normalized_shape"))
    names = [f"d{i}" for i in range(x.ndim)]
    lead, normed = names[: x.ndim - k], names[x.ndim - k :]
    stat: Dims = [(n,) for n in lead] + [() for _ in normed]
    return x, names, lead, normed, stat


def _by_position(call: OpCall, per_arg: dict[int, Dims]) -> list[Optional[Dims]]:
    pos = tensor_positions(call)
    out: list[Optional[Dims]] = [None] * len(call.in_specs)
    for p, k in pos.items():
        out[k] = per_arg.get(p)
    return out


@register("aten.native_layer_norm.default")
def _layer_norm(call: OpCall) -> DimMap:
    # (input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)
    x, names, lead, normed, stat = _norm_layout(call, 0, 1)
    full: Dims = [(n,) for n in names]
    ins = _by_position(call, {0: full, 2: [(n,) for n in normed], 3: [(n,) for n in normed]})
    fi, fo = float_flags(call)
    return DimMap(
        ins, [full, stat, stat], dict(zip(names, x.shape)), no_split=frozenset(normed), float_inputs=fi, float_outputs=fo
    )


@register("aten.native_layer_norm_backward.default")
def _layer_norm_backward(call: OpCall) -> DimMap:
    # (grad_out, input, normalized_shape, mean, rstd, weight?, bias?, output_mask) -> (dx, dw, db)
    x, names, lead, normed, stat = _norm_layout(call, 1, 2)
    full: Dims = [(n,) for n in names]
    w: Dims = [(n,) for n in normed]
    ins = _by_position(call, {0: full, 1: full, 3: stat, 4: stat, 5: w, 6: w})
    outs = [None if s is None else d for s, d in zip(call.out_specs, [full, w, w])]
    fi, fo = float_flags(call)
    return DimMap(
        ins, outs, dict(zip(names, x.shape)), reduce={n: "sum" for n in lead}, no_split=frozenset(normed),
        linear=[linear_in([0], all_outputs(call))], float_inputs=fi, float_outputs=fo,
    )


# ---------------------------------------------------------------------------------------------
# Factory ops and masks


def _arange_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    call = ctx.call
    spec = call.out_specs[0]
    if call.op == "aten.arange.default":
        start, step = 0, 1
    else:
        start, step = call.args[0], call.arg(2, "step", 1) if call.op == "aten.arange.start_step" else 1
    off, length = ctx.out_range(0, 0)
    lo = start + step * off
    return torch.arange(lo, lo + step * length, step, dtype=spec.dtype, device=ctx.device)[:length]


def _factory_map(call: OpCall) -> DimMap:
    out = call.out_specs[0]
    names = [f"d{i}" for i in range(out.ndim)]
    _, fo = float_flags(call)
    zeros = call.op == "aten.zeros.default" and fo[0]  # zeros are a valid partial sum (every addend zero)
    return DimMap([], [[(n,) for n in names]], dict(zip(names, out.shape)), float_outputs=fo,
                  linear=[Linear(frozenset(), frozenset({0}))] if zeros else [])


register("aten.arange.default", "aten.arange.start", "aten.arange.start_step", local=_arange_local)(_factory_map)
register(
    "aten.full.default", "aten.zeros.default", "aten.ones.default", "aten.empty.memory_format", size_args=((0, "size", 0),)
)(_factory_map)
register("aten.scalar_tensor.default")(_factory_map)


@register("aten.zeros_like.default")
def _zeros_like(call: OpCall) -> DimMap:
    return pointwise_map(call, [linear_in([0], [0])])


@register("aten.ones_like.default", "aten.full_like.default", "aten.empty_like.default")
def _ones_like(call: OpCall) -> DimMap:
    return pointwise_map(call, [])


def _tri_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    call = ctx.call
    nd = call.in_specs[0].ndim
    diagonal = call.arg(1, "diagonal", 0)
    r0, _ = ctx.in_range(0, nd - 2)
    c0, _ = ctx.in_range(0, nd - 1)
    return call.target(xs[0], diagonal + r0 - c0)


@register("aten.tril.default", "aten.triu.default", local=_tri_local)
def _tri(call: OpCall) -> DimMap:
    return pointwise_map(call, [linear_in([0], [0])])


__all__ = ["tensor_positions"]
