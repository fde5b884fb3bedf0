"""Fused attention kernels chosen as ``F.scaled_dot_product_attention`` chooses them (torch 2.13).

``F.scaled_dot_product_attention`` asks ``torch._fused_sdp_choice`` (which honours an
``torch.nn.attention.sdpa_kernel`` choice in force and the backend flags) for a backend, then calls
that backend's aten op, but returns only the output. autopar's attention op (``autopar.ir.attention``)
also needs the logsumexp and an explicit backward, so it repeats that dispatch here with the backends'
own ops. On a torch upgrade check: the ops' schemas and output tuples in ``native_functions.yaml``
(``_scaled_dot_product_{flash,efficient,cudnn}_attention`` and their ``_backward``), the padding and
mask preprocessing of ``scaled_dot_product_attention`` in ``aten/src/ATen/native/transformers/
attention.cpp``, and the layout of each backend's logsumexp (flash ``[b h s]``; efficient
``[b h ceil32(s)]``; cuDNN ``[b h s 1]``).

Every backend's logsumexp is the natural-log logsumexp of the scaled scores per query row, so the
backward may run on another backend than the forward did (it chooses again, from its own inputs).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

aten = torch.ops.aten

#: the aten ops the CUDA dispatch below may call (checked against the CUDA kernel registry by the tests)
CUDA_OPS = (
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_efficient_attention_backward.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_cudnn_attention_backward.default",
)


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], dropout_p: float,
                is_causal: bool, scale: Optional[float]) -> str:
    """The backend ``F.scaled_dot_product_attention`` would run for these operands: ``"flash"``,
    ``"efficient"``, ``"cudnn"`` or ``"math"`` (anything else, an override included, runs as math)."""
    gqa = q.shape[-3] != k.shape[-3]
    choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=gqa)
    return {SDPBackend.FLASH_ATTENTION.value: "flash", SDPBackend.EFFICIENT_ATTENTION.value: "efficient",
            SDPBackend.CUDNN_ATTENTION.value: "cudnn"}.get(int(choice), "math")


def _pad8(x: torch.Tensor) -> torch.Tensor:
    """Flash on CUDA wants a head dim that is a multiple of 8 (``attention.cpp`` pads it the same way)."""
    pad = -x.shape[-1] % 8
    return F.pad(x, (0, pad)) if pad else x


def _narrow(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[..., :n]`` (as an aten call, so that it also runs on fake CUDA tensors of a CPU build)."""
    return x if x.shape[-1] == n else aten.slice.Tensor(x, -1, 0, n)


def _bias(mask: Optional[torch.Tensor], q: torch.Tensor, t: int) -> Optional[torch.Tensor]:
    """A mask as the efficient and cuDNN kernels take it: additive, in q's dtype, its last dim's
    storage padded to a multiple of 16 (``attention.cpp``'s ``preprocess_mask``)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        mask = aten.masked_fill.Scalar(zeros, aten.logical_not.default(mask), float("-inf"))
    mask = mask.to(q.dtype).expand(q.shape[0], q.shape[1], q.shape[2], t)
    pad = -t % 16
    return _narrow(F.pad(mask, (0, pad)), t) if pad else mask


def fused_forward(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  is_causal: bool, scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, logsumexp [b h s] fp32)`` from ``backend``'s kernel, without dropout."""
    s = q.shape[2]
    if backend == "flash":
        e = v.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        res = aten._scaled_dot_product_flash_attention.default(_pad8(q), _pad8(k), _pad8(v), 0.0, is_causal,
                                                                False, scale=scale)
        return _narrow(res[0], e), res[1]
    if backend == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention.default(q, k, v, _bias(mask, q, k.shape[2]), True,
                                                                       0.0, is_causal, scale=scale)[:2]
        return out, _narrow(lse, s)
    if backend == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention.default(q, k, v, _bias(mask, q, k.shape[2]), True, 0.0,
                                                              is_causal, False, scale=scale)
        return res[0], res[1].reshape(q.shape[:3])
    raise ValueError(f"no fused attention backend {backend!r}")


def fused_backward(backend: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, mask: Optional[torch.Tensor], is_causal: bool,
                   scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from ``backend``'s backward kernel, without dropout; ``lse`` is ``[b h s]``."""
    s, t = q.shape[2], k.shape[2]
    lse = lse.to(torch.float32)
    if not lse.is_contiguous():  # (an aten clone: ``contiguous()`` fails on fake CUDA tensors of a CPU build)
        lse = aten.clone.default(lse, memory_format=torch.contiguous_format)
    if backend == "flash":
        d, e = q.shape[-1], v.shape[-1]
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
        offset = torch.zeros((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward.default(
            _pad8(grad), _pad8(q), _pad8(k), _pad8(v), _pad8(out), lse, None, None, s, t, 0.0, is_causal, seed,
            offset, scale=scale)
        return _narrow(dq, d), _narrow(dk, d), _narrow(dv, e)
    if backend == "efficient":
        padded = F.pad(lse, (0, -s % 32))
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        bias = _bias(mask, q, t)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward.default(
            grad, q, k, v, bias, out, padded, seed, seed, 0.0, [True, True, True, False], is_causal, scale=scale)
        return dq, dk, dv
    if backend == "cudnn":
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward.default(
            grad, q, k, v, out, lse.unsqueeze(-1), seed, seed, _bias(mask, q, t), None, None, s, t, 0.0, is_causal,
            scale=scale)
        return dq, dk, dv
    raise ValueError(f"no fused attention backend {backend!r}")


__all__ = ["CUDA_OPS", "fused_backward", "fused_forward", "sdpa_choice"]
