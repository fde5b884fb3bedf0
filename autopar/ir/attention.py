"""Fused attention as one device-neutral op: ``autopar::attention`` and ``autopar::attention_backward``.

Capture runs on fake CPU tensors, where ``F.scaled_dot_product_attention`` fuses into
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), an op with a CPU kernel only.
Capture keeps torch's own choice of fused against unfused attention (the CPU dispatch decides, as for
any model), then ``device_neutral`` retargets those two nodes to the ops below. They take the same
arguments in the same order (``attn_mask`` may also be passed by position: ``register_autograd``
refuses keyword-only tensors), so node names, arguments and every rule's positions are unchanged,
and they carry what every backend needs: the forward returns ``(out, logsumexp [b h s] fp32)``,
the backward takes both. With ``dropout_p > 0`` the lowered program draws autopar's own
placement-invariant mask (``ir.rules.random_attention``) and never calls these kernels.
Grouped-query attention is read from the head counts (k/v with fewer heads), as the CPU kernel does.

They are ``torch.library`` custom ops, a mechanism torch maintains, rather than a rewrite of the
lowered program: the kernel is bound when the op runs, from the tensors' device, so the same IR and
plan run on any device (on CUDA the backend ``F.scaled_dot_product_attention`` itself would pick, an
``sdpa_kernel`` choice honoured: ``_torch_compat.sdpa``; on CPU the CPU kernel, so CPU numbers are
the captured op's own), their fake kernels are the CPU op's meta (shapes and strides as captured on
any device), and their registered autograd formula lets the ops run, and be captured again, eagerly.
A capture on fake CUDA tensors is no alternative: the CPU build cannot trace a CUDA backward, and the
backend it recorded would depend on the GPU the plan was made for.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from autopar._torch_compat import sdpa

__all__ = ["ATTN_BWD", "ATTN_FWD", "CPU_ATTN_BWD", "CPU_ATTN_FWD", "LEGACY_NAMES", "attention", "attention_backward",
           "device_neutral"]

ATTN_FWD = "autopar.attention.default"
ATTN_BWD = "autopar.attention_backward.default"
#: the CPU-only ops torch records on fake CPU tensors, which ``device_neutral`` replaces
CPU_ATTN_FWD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
CPU_ATTN_BWD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"

#: device-neutral op -> the name schema versions 1-7 of a plan (and their graph fingerprints) gave it
LEGACY_NAMES = {ATTN_FWD: CPU_ATTN_FWD, ATTN_BWD: CPU_ATTN_BWD}

_cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@torch.library.custom_op("autopar::attention", mutates_args=())
def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
               is_causal: bool = False, attn_mask: Optional[torch.Tensor] = None, *,
               scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's ``(out, logsumexp [b h s] fp32)``: on a device without a kernel below, the math
    (without dropout)."""
    _no_dropout(dropout_p, query)
    return _math_forward(query, key, value, attn_mask, is_causal, scale)


@_attention.register_kernel("cpu")
def _attention_cpu(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, *, scale=None):
    out, lse = _cpu_fwd(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse


@_attention.register_kernel("cuda")
def _attention_cuda(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, *, scale=None):
    _no_dropout(dropout_p, query)
    backend = sdpa.sdpa_choice(query, key, value, attn_mask, 0.0, is_causal, scale)
    if backend == "math":
        return _math_forward(query, key, value, attn_mask, is_causal, scale)
    return sdpa.fused_forward(backend, query, key, value, attn_mask, is_causal, scale)


@_attention.register_fake
def _attention_fake(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, *, scale=None):
    out, lse = _cpu_fwd(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out, lse


@torch.library.custom_op("autopar::attention_backward", mutates_args=())
def _attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        out: torch.Tensor, logsumexp: torch.Tensor, dropout_p: float, is_causal: bool,
                        attn_mask: Optional[torch.Tensor] = None, *,
                        scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``autopar::attention``: on a device without a kernel below, the math."""
    _no_dropout(dropout_p, query)
    return _math_backward(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale)


@_attention_backward.register_kernel("cpu")
def _attention_backward_cpu(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, *,
                            scale=None):
    dq, dk, dv = _cpu_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
                          scale=scale)
    return dq, dk, dv


@_attention_backward.register_kernel("cuda")
def _attention_backward_cuda(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, *,
                             scale=None):
    _no_dropout(dropout_p, query)
    backend = sdpa.sdpa_choice(query, key, value, attn_mask, 0.0, is_causal, scale)
    if backend == "math":
        return _math_backward(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale)
    return sdpa.fused_backward(backend, grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale)


@_attention_backward.register_fake
def _attention_backward_fake(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, *,
                             scale=None):
    dq, dk, dv = _cpu_bwd(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=attn_mask,
                          scale=scale)
    return dq, dk, dv


def _setup_context(ctx, inputs, keyword_only_inputs, output) -> None:
    q, k, v, dropout_p, is_causal, attn_mask = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.dropout_p, ctx.is_causal, ctx.attn_mask = dropout_p, is_causal, attn_mask
    ctx.scale = keyword_only_inputs.get("scale")


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    dq, dk, dv = torch.ops.autopar.attention_backward.default(grad_out, q, k, v, out, lse, ctx.dropout_p, ctx.is_causal,
                                    attn_mask=ctx.attn_mask, scale=ctx.scale)
    return dq, dk, dv, None, None, None


_attention.register_autograd(_backward, setup_context=_setup_context)

#: the ops, as called: ``attention(q, k, v, dropout_p, is_causal, attn_mask=, scale=)``
attention = torch.ops.autopar.attention.default
attention_backward = torch.ops.autopar.attention_backward.default


def device_neutral(gm: torch.fx.GraphModule) -> None:
    """Retarget a captured graph's CPU-only fused attention nodes to the device-neutral ops, in place."""
    table = {_cpu_fwd: torch.ops.autopar.attention.default, _cpu_bwd: torch.ops.autopar.attention_backward.default}
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in table:
            n.target = table[n.target]
            changed = True
    if changed:
        gm.recompile()


# -- math, for devices and operands without a fused kernel ----------------------------------------

def _no_dropout(dropout_p: float, q: torch.Tensor) -> None:
    if dropout_p > 0:
        raise NotImplementedError(
            f"autopar.attention with dropout_p={dropout_p} on {q.device.type}: the dropout mask is autopar's own "
            "draw (ir.rules.random_attention), which a lowered program runs; call F.scaled_dot_product_attention "
            "for torch's dropout")


def _scores(q, k, v, mask, is_causal, scale):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[1] // max(k.shape[1], 1)
    k, v = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if is_causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    return s, k, v, scale, g


def _math_forward(q, k, v, mask, is_causal, scale):
    s, _, ve, _, _ = _scores(q, k, v, mask, is_causal, scale)
    lse = torch.logsumexp(s, -1)
    prob = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    return torch.matmul(prob, ve.float()).to(q.dtype), lse


def _math_backward(grad, q, k, v, out, lse, mask, is_causal, scale):
    s, ke, ve, scale, g = _scores(q, k, v, mask, is_causal, scale)
    lse = lse.float()
    prob = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
    grad = grad.float()
    d_prob = torch.matmul(grad, ve.float().transpose(-1, -2))
    ds = prob * (d_prob - (grad * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ke.float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    dv = torch.matmul(prob.transpose(-1, -2), grad)
    if g > 1:  # the query heads sharing a key head add up
        dk = dk.unflatten(1, (k.shape[1], g)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], g)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
