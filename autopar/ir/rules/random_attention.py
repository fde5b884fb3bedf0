"""Attention with dropout as one fused, head-splittable op, its mask from the counter-based draw.

Torch's CPU kernels have no fused attention with dropout, so ``F.scaled_dot_product_attention``
with ``dropout_p > 0`` would be captured as the unfused math path (scores of ``b*h*s*t`` in memory,
a softmax with no rule of its own). ``fused_dropout_attention`` makes capture record the fused
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward) with ``dropout_p`` kept as
an argument: the attention rules (``special.py``: batch, heads, query positions) and the cost model
(fused attention, flash on the GPU presets) apply unchanged. Lowered, both ops run the math below
on the device's blocks, the dropout mask drawn at each score's global ``(b, h, s, t)`` index with
the forward node's key, so the backward redraws the forward's mask and every placement agrees.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.graph import Graph, Node, Ref
from autopar.ir.rules.base import LocalCtx
from autopar.ir.rules.random_ops import draw_local, global_index, is_random, uniform53
from autopar.ir.rules.shared_kv import scatter_kv_grads, select_kv
from autopar.ir.rules.special import _causal_mask

#: op -> (position of dropout_p, of is_causal, index of q among the tensor inputs)
_ARGS = {ATTN_FWD: (3, 4, 0), ATTN_BWD: (6, 7, 1)}
#: Ops that pass a value through unchanged: a backward may read the forward's logsumexp through them.
_IDENTITIES = ("aten.detach.default", "aten.alias.default", "aten.clone.default")


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default):
    return args[pos] if pos < len(args) else kwargs.get(name, default)


def attention_dropout(op: str, args: tuple, kwargs: dict) -> float:
    """The dropout probability of a fused attention op (0.0 for any other op)."""
    if op not in _ARGS:
        return 0.0
    return float(_arg(args, kwargs, _ARGS[op][0], "dropout_p", 0.0) or 0.0)


def is_random_call(op: str, args: tuple, kwargs: dict) -> bool:
    """Whether this op instance draws random numbers: a random op, or attention with dropout."""
    return is_random(op) or attention_dropout(op, args, kwargs) > 0


def key_node(graph: Graph, node: Node) -> str:
    """The IR node whose name keys ``node``'s draw: the node itself, or for an attention backward
    the forward attention whose logsumexp it reads (so it redraws the forward's mask)."""
    if node.op != ATTN_BWD:
        return node.name
    ref = node.args[5]
    while isinstance(ref, Ref):
        src = graph.node(ref.node)
        if src.op == ATTN_FWD:
            return src.name
        if src.op not in _IDENTITIES or not src.inputs:
            break
        ref = src.inputs[0]
    raise ValueError(f"{graph.user_name(node)} reads no forward attention's logsumexp: its dropout mask has no key")


def random_local(ctx: LocalCtx, inputs: Sequence[torch.Tensor], key: int) -> list:
    """This device's outputs of the random op instance ``ctx.call``, drawn with ``key``."""
    if ctx.call.op in _ARGS:
        return attention_local(ctx, list(inputs), key)
    return draw_local(ctx, inputs, key)


# -- the math -----------------------------------------------------------------------------------

def _scores(ctx: LocalCtx, q: torch.Tensor, k: torch.Tensor, mask: Optional[torch.Tensor], qi: int,
            scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        start, length = ctx.in_range(qi, 2)
        s = s + _causal_mask(start, length, k.shape[2], s.dtype, s.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return s


def keep_mask(ctx: LocalCtx, qi: int, t: int, key: int, p: float, device: Optional[torch.device]) -> torch.Tensor:
    """This device's block of the attention dropout mask (True where a score is kept, with
    probability ``1 - p``), drawn with ``key`` at the scores' ``[b h s t]`` indices in the whole
    ``[B H S T]``: ``qi`` is the query's input position, ``t`` the key length."""
    q = ctx.call.in_specs[qi]
    shape = tuple(q.shape[:3]) + (t,)
    blocks = tuple((d, c) for d, c in q.blocks if d < 3)
    index = global_index(shape, ctx.in_placements(qi)[:], ctx.mesh_shape, ctx.coords, blocks, ctx.offset_scale,
                         device)
    return uniform53(key, index) >= round(p * 2.0 ** 53)


def attention_local(ctx: LocalCtx, xs: list, key: int) -> list:
    """Fused attention (forward: ``(out, logsumexp)``; backward: ``(dq, dk, dv)``) with dropout on
    this device's blocks, the mask drawn with ``key``."""
    call = ctx.call
    p_pos, c_pos, qi = _ARGS[call.op]
    p = float(_arg(call.args, call.kwargs, p_pos, "dropout_p", 0.0))
    causal = bool(_arg(call.args, call.kwargs, c_pos, "is_causal", False))
    n_fixed = 3 if call.op == ATTN_FWD else 6
    mask = xs[n_fixed] if len(xs) > n_fixed else None
    xs, kv_heads = select_kv(ctx, xs, qi)  # grouped-query heads split with k/v whole (kv-shared)
    q, k, v = xs[qi:qi + 3]
    scale = call.kwargs.get("scale")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    g = q.shape[1] // max(k.shape[1], 1)
    ke, ve = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
    s = _scores(ctx, q, ke, mask, qi, scale, causal)
    keep = keep_mask(ctx, qi, k.shape[2], key, p, q.device).to(q.dtype) * (1.0 / (1.0 - p) if p < 1 else 0.0)
    if call.op == ATTN_FWD:
        lse = torch.logsumexp(s, -1)
    else:
        lse = xs[5].to(s.dtype)
    prob = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    dropped = prob * keep
    if call.op == ATTN_FWD:
        out = torch.matmul(dropped, ve)
        lse_spec = call.out_specs[1]
        return [out, lse.to(lse_spec.dtype if lse_spec is not None else lse.dtype)]
    grad, out = xs[0], xs[4]
    d_dropped = torch.matmul(grad, ve.transpose(-1, -2))
    d_prob = d_dropped * keep
    ds = prob * (d_prob - (grad * out).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    dv = torch.matmul(dropped.transpose(-1, -2), grad)
    if g > 1:  # the query heads sharing a key head add up
        dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], g)).sum(2)
    return list(scatter_kv_grads(ctx, (dq, dk, dv), kv_heads)) if kv_heads is not None else [dq, dk, dv]


# -- capture ------------------------------------------------------------------------------------

@contextlib.contextmanager
def fused_dropout_attention() -> Iterator[None]:
    """While capturing: ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` records the fused
    attention op with its ``dropout_p`` instead of torch's unfused math path (looked up at call
    time, as ``F.scaled_dot_product_attention`` by models and libraries alike)."""
    import torch.nn.functional as F

    orig = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        # the fused backward has no gradient for the mask: a learned one (T5's position bias) takes
        # torch's math path, its dropout drawn as ``native_dropout``
        learned_mask = attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled()
        fusable = query.dim() == 4 and not (is_causal and attn_mask is not None) and not learned_mask
        if dropout_p > 0 and fusable and (enable_gqa or query.shape[1] == key.shape[1]):
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return orig(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig


__all__ = ["ATTN_BWD", "ATTN_FWD", "attention_dropout", "attention_local", "fused_dropout_attention",
           "is_random_call", "keep_mask", "key_node", "random_local"]
