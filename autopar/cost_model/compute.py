"""Compute cost: a roofline per op, on the local shapes one device sees under a strategy.

``flops_and_bytes`` counts an op's FLOPs and the bytes it moves through memory (inputs read once,
outputs written once); ``compute_time`` turns them into seconds on a ``Hardware``. Views and other
ops that launch no kernel cost nothing.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from autopar.cost_model import efficiency as eff
from autopar.cost_model.hardware import Hardware
from autopar.cost_model.precision import Precision, element_bytes
from autopar.ir.attention import ATTN_BWD, ATTN_FWD
from autopar.ir.rules.base import OpCall

Shape = tuple[int, ...]

#: Ops that launch no kernel (views, aliases, graph plumbing), by name without overload ...
_FREE_KEYS = frozenset(
    {
        "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.permute", "aten.expand",
        "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.alias", "aten.split",
        "aten.split_with_sizes", "aten.lift_fresh_copy", "autopar.hint",
    }
)
#: ... and by full name where only some overloads are views.
_FREE_OPS = frozenset(
    {
        "aten.transpose.int", "aten.slice.Tensor", "aten.select.int", "aten.unbind.int",
        "get_attr", "placeholder", "output",
    }
)

#: flash attention's backward recomputes the scores: about 2.5x the forward's FLOPs
FLASH_BACKWARD_FACTOR = 2.5


def _op_key(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def is_free(op: str) -> bool:
    """Whether ``op`` (``"aten.view.default"``) launches no kernel: views, aliases, placeholders."""
    return op in _FREE_OPS or _op_key(op) in _FREE_KEYS


def _numel(shape: Optional[Sequence[int]]) -> int:
    return 0 if shape is None else math.prod(shape)


def _float_dtype(call: OpCall) -> torch.dtype:
    for spec in list(call.out_specs) + list(call.in_specs):
        if spec is not None and spec.dtype.is_floating_point:
            return spec.dtype
    return torch.float32


def _io_bytes(call: OpCall, in_shapes, out_shapes, precision: Precision) -> float:
    total = 0
    for spec, shape in zip(call.in_specs, in_shapes):
        total += _numel(shape) * element_bytes(spec.dtype, "activation", precision)
    for spec, shape in zip(call.out_specs, out_shapes):
        if spec is not None and shape is not None:
            total += _numel(shape) * element_bytes(spec.dtype, "activation", precision)
    return float(total)


def _attention_flops(q: Shape, k: Shape, v: Shape, causal: bool) -> float:
    """QK^T and PV: 2 b h s t (d + e) (= 4 b h s t d when d == e); halved when causal."""
    b, h, s, d = q
    t, e = k[2], v[3]
    f = 2.0 * b * h * s * t * (d + e)
    return f / 2 if causal else f


def _conv_flops(x: Shape, w: Shape, y: Shape, transposed: bool) -> float:
    """2 n co ho wo (ci/groups) kh kw = 2 * (n * output positions) * numel(weight); transposed
    convolutions run the same products over the input positions."""
    positions = x[0] * math.prod(x[2:]) if transposed else y[0] * math.prod(y[2:])
    return 2.0 * positions * math.prod(w)


def _flops(call: OpCall, ins: Sequence[Shape], outs: Sequence[Optional[Shape]]) -> Optional[float]:
    """FLOPs of the ops with a formula; None for the rest (1 FLOP per output element)."""
    key = _op_key(call.op)
    if key == "aten.mm":
        (m, k), (_, n) = ins[0], ins[1]
        return 2.0 * m * k * n
    if key == "aten.addmm":  # (bias, a, b)
        (m, k), (_, n) = ins[1], ins[2]
        return 2.0 * m * k * n + m * n
    if key == "aten.bmm":
        (bt, m, k), (_, _, n) = ins[0], ins[1]
        return 2.0 * bt * m * k * n
    if key == "aten.baddbmm":  # (bias, a, b)
        (bt, m, k), (_, _, n) = ins[1], ins[2]
        return 2.0 * bt * m * k * n + bt * m * n
    if key == "aten._grouped_mm":  # groups of rows (or of the contracted dim) times one matrix each
        a, b = ins[0], ins[1]
        if len(a) == 2 and len(b) == 2:  # [K, T] x [T, N] -> [E, K, N]: the groups partition T
            return 2.0 * a[0] * a[1] * b[1]
        return 2.0 * _numel(outs[0]) * a[-1]  # [T, K] x [E, K, N] -> [T, N]; batched 3-D x 3-D
    if call.op == ATTN_FWD:
        return _attention_flops(ins[0], ins[1], ins[2], bool(call.arg(4, "is_causal", False)))
    if call.op == ATTN_BWD:
        fwd = _attention_flops(ins[1], ins[2], ins[3], bool(call.arg(7, "is_causal", False)))
        return FLASH_BACKWARD_FACTOR * fwd
    if call.op == "aten.convolution.default":
        return _conv_flops(ins[0], ins[1], outs[0], bool(call.arg(6, "transposed", False)))
    if call.op == "aten.convolution_backward.default":
        # (grad_out, input, weight, ...): grad_input and grad_weight each cost the forward's
        # products; grad_bias is a reduction over grad_out.
        g, x, w = ins[0], ins[1], ins[2]
        mask = call.arg(10, "output_mask", [True, True, True])
        one = _conv_flops(x, w, g, bool(call.arg(7, "transposed", False)))
        return one * (bool(mask[0]) + bool(mask[1])) + (_numel(g) if mask[2] else 0)
    if key == "aten.embedding":
        return 0.0
    return None


def flops_and_bytes(
    call: OpCall, in_shapes: Sequence[Shape], out_shapes: Sequence[Optional[Shape]], precision: Precision
) -> tuple[float, float]:
    """Local FLOPs and bytes moved by ``call`` on blocks of ``in_shapes`` -> ``out_shapes``.

    Bytes: every input read and every output written once, float tensors at the precision's
    activation size, integer/bool tensors at their own. An embedding reads only the rows it
    gathers (ids + output-sized rows + output), not the whole table. FLOPs: mm 2mkn, addmm
    2mkn + mn, bmm/baddbmm likewise per batch, attention 2bhst(d+e) (halved when causal; its
    backward 2.5x the forward), grouped mm 2 x rows x K x N over all its groups, convolution
    2 n co ho wo (ci/groups) kh kw (backward: the same per requested grad_input/grad_weight),
    embedding 0, anything else 1 per output element.
    """
    ins = [tuple(s) for s in in_shapes]
    outs = [None if s is None else tuple(s) for s in out_shapes]
    if is_free(call.op):
        return 0.0, 0.0
    flops = _flops(call, ins, outs)
    if flops is None:
        flops = float(sum(_numel(s) for s in outs))
    if _op_key(call.op) == "aten.embedding":  # (weight, ids): read ids and gathered rows, write out
        out_b = _numel(outs[0]) * element_bytes(call.out_specs[0].dtype, "activation", precision)
        ids_b = _numel(ins[1]) * element_bytes(call.in_specs[1].dtype, "activation", precision)
        return 0.0, float(ids_b + 2 * out_b)
    return float(flops), _io_bytes(call, ins, outs, precision)


def _score_bytes(call: OpCall, ins: Sequence[Shape], precision: Precision) -> float:
    """Attention without flash: the b h s t score matrix is written and read (twice in backward)."""
    q_at = 1 if call.op == ATTN_BWD else 0
    q, k = ins[q_at], ins[q_at + 1]
    scores = q[0] * q[1] * q[2] * k[2]
    eb = element_bytes(call.in_specs[q_at].dtype, "activation", precision)
    return float(scores * eb * (4 if call.op == ATTN_BWD else 2))


def matmul_shape(call: OpCall, ins: Sequence[Shape], outs: Sequence[Optional[Shape]]) -> Optional[tuple[float, float]]:
    """(output elements MN over all batches, reduction length K) of a matmul-like op; None for
    the rest. A convolution is its implicit GEMM: MN = output positions x output channels, K =
    input channels per group x kernel area (its backward: the forward's shape)."""
    key = _op_key(call.op)
    if key in ("aten.mm", "aten.addmm"):
        a, b = (ins[0], ins[1]) if key == "aten.mm" else (ins[1], ins[2])
        return float(a[0] * b[1]), float(a[1])
    if key in ("aten.bmm", "aten.baddbmm"):
        a, b = (ins[0], ins[1]) if key == "aten.bmm" else (ins[1], ins[2])
        return float(a[0] * a[1] * b[2]), float(a[2])
    if key == "aten._grouped_mm":  # by one group's shape: experts share the rows evenly
        a, b = ins[0], ins[1]
        if len(a) == 2 and len(b) == 2:  # [K, T] x [T, N] -> [E, K, N]
            groups = outs[0][0] if outs[0] else 1
            return float(a[0] * b[1] * groups), float(a[1]) / max(1, groups)
        return float(_numel(outs[0])), float(a[-1])
    if call.op in ("aten.convolution.default", "aten.convolution_backward.default"):
        x, w = (ins[0], ins[1]) if call.op == "aten.convolution.default" else (ins[1], ins[2])
        if len(w) < 2:
            return None
        positions = _numel(outs[0]) / max(1, w[0]) if call.op == "aten.convolution.default" and outs[0] else None
        if positions is None:  # backward: the forward's output positions from grad_output
            positions = _numel(ins[0]) / max(1, w[0])
        return float(positions * w[0]), float(math.prod(w[1:]))
    return None


def efficiency_of(call: OpCall, ins: Sequence[Shape], outs: Sequence[Optional[Shape]], hw: Hardware) -> float:
    """Fraction of peak FLOP/s ``call`` reaches on ``hw`` (``autopar.cost_model.efficiency``):
    matmuls and convolutions by (MN, K); fused attention by (keys, head dim, causal, phase); any
    other op at the best matmul rate (they are memory-bound: the byte term decides)."""
    e = hw.efficiency
    if call.op in (ATTN_FWD, ATTN_BWD):
        at = 1 if call.op == ATTN_BWD else 0
        q, k = ins[at], ins[at + 1]
        causal = bool(call.arg(7, "is_causal", False) if at else call.arg(4, "is_causal", False))
        return eff.attention(e, "bwd" if at else "fwd", k[2], q[3], causal)
    if _op_key(call.op) == "aten._grouped_mm" and len(ins) > 1 and len(ins[0]) == 2:
        # one expert's GEMM: its rows are the local rows over the local experts (expert parallelism
        # gathers an expert's rows from the group, so its GEMMs are larger than a row split's)
        a, b = ins[0], ins[1]
        if len(b) == 3:  # [T, K] x [E, K, N]
            return eff.matmul(e, a[0] / max(1, b[0]) * b[2], a[1])
        if len(b) == 2 and outs and outs[0]:  # [K, T] x [T, N] -> [E, K, N]
            return eff.matmul(e, a[0] * b[1], a[1] / max(1, outs[0][0]))
    shape = matmul_shape(call, ins, outs)
    if shape is not None:
        return eff.matmul(e, *shape)
    return e.mm_max


def compute_time(
    call: OpCall,
    in_shapes: Sequence[Shape],
    out_shapes: Sequence[Optional[Shape]],
    hw: Hardware,
    precision: Precision,
    fused=None,
) -> float:
    """Seconds for one op on one device: 0 for ``is_free`` ops, else the roofline

        max(flops / (peak[dtype] * e_flops(shape)), bytes / (hbm_bandwidth * e_memory(bytes)))
        + launch_floor

    with dtype = ``precision.compute_dtype`` or the op's own (first float) dtype, ``e_flops`` the
    shape's achieved fraction of peak (``efficiency_of``) and ``e_memory`` that of the bandwidth
    (``autopar.cost_model.efficiency.memory``). On hardware without flash attention the fused
    attention ops also move their score matrix through memory.

    ``fused`` (a ``cost_model.fusion.Fused``, compiled programs): the inputs it marks are read from
    registers and move no bytes; an output kept in registers moves none and launches no kernel.
    """
    if is_free(call.op):
        return 0.0
    if fused is not None:
        return _fused_time(call, in_shapes, out_shapes, hw, precision, fused)
    _, _, t_flops, t_bytes, _ = _roofline(call, in_shapes, out_shapes, hw, precision)
    return max(t_flops, t_bytes) + hw.launch_floor


def _fused_time(call: OpCall, in_shapes, out_shapes, hw: Hardware, precision: Precision, fused) -> float:
    """A pointwise op's seconds inside a fused kernel (see ``compute_time``)."""
    _, _, t_flops, _, _ = _roofline(call, in_shapes, out_shapes, hw, precision)
    moved = 0.0
    for spec, shape, reg in zip(call.in_specs, in_shapes, fused.inputs):
        if not reg:
            moved += _numel(shape) * element_bytes(spec.dtype, "activation", precision)
    if not fused.output:
        for spec, shape in zip(call.out_specs, out_shapes):
            if spec is not None and shape is not None:
                moved += _numel(shape) * element_bytes(spec.dtype, "activation", precision)
    t_bytes = moved / (hw.hbm_bandwidth * eff.memory(hw.efficiency, moved)) if moved else 0.0
    return max(t_flops, t_bytes) + (0.0 if fused.output else hw.launch_floor)


def _roofline(call: OpCall, in_shapes, out_shapes, hw: Hardware, precision: Precision):
    """``(ins, outs, t_flops, t_bytes, nbytes)``: the roofline's two terms of a non-free op."""
    ins = [tuple(s) for s in in_shapes]
    outs = [None if s is None else tuple(s) for s in out_shapes]
    flops, nbytes = flops_and_bytes(call, ins, outs, precision)
    if call.op in (ATTN_FWD, ATTN_BWD) and not hw.flash_attention:
        nbytes += _score_bytes(call, ins, precision)
    dtype = precision.compute_dtype or str(_float_dtype(call)).replace("torch.", "")
    t_flops = flops / (hw.flops(dtype) * efficiency_of(call, ins, outs, hw)) if flops else 0.0
    t_bytes = nbytes / (hw.hbm_bandwidth * eff.memory(hw.efficiency, nbytes)) if nbytes else 0.0
    return ins, outs, t_flops, t_bytes, nbytes


def _along(x: float, half: float) -> float:
    """How far along an efficiency curve ``x / (x + half)`` the size ``x`` is (1 for a flat curve)."""
    return 1.0 if half <= 0 else (x / (x + half) if x > 0 else 0.0)


def row_growth(
    call: OpCall,
    in_shapes: Sequence[Shape],
    out_shapes: Sequence[Optional[Shape]],
    hw: Hardware,
    precision: Precision,
) -> float:
    """How fast ``compute_time`` at least grows when every batch-carrying size of the op grows by a
    factor ``f >= 1`` (its rows: samples or tokens), for an op whose work is per row: seconds per unit
    of ``f``, so that ``compute_time(f) >= compute_time(1) + (f - 1) * row_growth``. The roofline's
    active term is affine in ``f`` (the efficiency curves are ``x / (x + half)``): a matmul's slope is
    its FLOP time at full efficiency in whichever of (MN, K) grows, bounded by
    ``t_flops * min(sat(MN), sat(K))`` since which of the two holds the rows is not known; fused
    attention's efficiency does not depend on the rows, so its time is linear; a memory-bound op's
    slope is its byte time at full bandwidth; the launch floor does not grow. The pipeline driver's
    estimate of fewer, larger micro-batches from a solve at smaller ones uses it (an estimate that
    must not be pessimistic: ``passes/search/pipeline_split.scaled``)."""
    if is_free(call.op):
        return 0.0
    ins, outs, t_flops, t_bytes, nbytes = _roofline(call, in_shapes, out_shapes, hw, precision)
    if t_bytes > t_flops:
        return t_bytes * _along(nbytes, hw.efficiency.mem_half_bytes)
    if call.op in (ATTN_FWD, ATTN_BWD):
        return t_flops
    shape = matmul_shape(call, ins, outs)
    if shape is None:
        return t_flops
    e = hw.efficiency
    return t_flops * min(_along(shape[0], e.mm_half_mn), _along(shape[1], e.mm_half_k))


def model_flops(graph) -> float:
    """Model FLOPs of one step (the MFU numerator, global, every device together): the forward's
    matmuls, convolutions and fused attention at their full shapes, times 3 when training (the
    backward's two products per forward one), recomputation not counted. A matmul counts 2 MNK
    (no bias), attention 2 b h s t (d + e) forward WITHOUT the causal halving (the convention
    MFU figures are published in: for a decoder 6 N + 12 L h s per token, N the matmul weights,
    L layers, h the width, s the sequence). Pointwise work, norms and the loss are not counted."""
    from autopar.ir.graph import Phase
    from autopar.ir.rules import op_call

    total = 0.0
    for n in graph.ops():
        if n.phase != Phase.FORWARD:
            continue
        if n.op == ATTN_FWD:
            ins = [tuple(graph.spec(r).shape) for r in n.inputs[:3]]
            total += _attention_flops(ins[0], ins[1], ins[2], False)
            continue
        key = _op_key(n.op)
        if key not in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm") and n.op != "aten.convolution.default":
            continue
        call = op_call(graph, n)
        ins = [tuple(graph.spec(r).shape) for r in n.inputs]
        outs = [None if o is None else tuple(o.shape) for o in n.outputs]
        shape = matmul_shape(call, ins, outs)
        if shape is not None:
            total += 2.0 * shape[0] * shape[1]
    return total * (3.0 if graph.training else 1.0)


def tokens_per_step(graph) -> int:
    """Tokens one step processes: the elements of the first integer input with two or more dims
    (token ids, [batch, sequence]); 0 when the model takes no such input (then plans report no
    tokens/s)."""
    for name in graph.inputs.values():
        spec = graph.node(name).out
        if spec is not None and not spec.dtype.is_floating_point and spec.dtype != torch.bool and len(spec.shape) >= 2:
            return int(math.prod(spec.shape))
    return 0


def optimizer_time(state: dict, hw: Hardware) -> float:
    """Seconds of one optimizer step over one device's block of a parameter: memory-bound, reading
    the weights, the gradient and the state and writing the weights and the state back (AdamW
    bf16-mixed: 4 + 4 + 8 read, 4 + 8 written = 28 bytes per element). ``state`` is
    ``memory.param_state_bytes``'s ``{"params", "grads", "optimizer"}``; no gradient, no step."""
    if not state.get("grads"):
        return 0.0
    nbytes = 2 * state["params"] + state["grads"] + 2 * state["optimizer"]
    return nbytes / (hw.hbm_bandwidth * eff.memory(hw.efficiency, nbytes))


__all__ = ["compute_time", "efficiency_of", "flops_and_bytes", "is_free", "matmul_shape", "model_flops", "optimizer_time",
           "row_growth",
           "tokens_per_step"]
