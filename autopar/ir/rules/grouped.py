"""Rules for grouped matrix products as mixture-of-experts layers run them (Hugging Face's default
``grouped_mm`` experts): ``aten._grouped_mm`` and the ``histc`` that counts tokens per expert.

``_grouped_mm(a, b, offs)`` multiplies consecutive groups of rows by one matrix each. ``offs`` holds
the groups' cumulative ends (global row positions, group ``e`` is rows ``offs[e-1]:offs[e]``), so it is
always read whole. Two forms occur, the forward / input gradient and the weight gradient:

- ``a [T, K] @ b [E, K, N] -> [T, N]``: split ``N`` (b's columns, the output's columns), split ``K``
  on both operands (the output is a partial sum), or split the rows ``T`` of ``a`` and the output
  with ``b`` whole: each device shifts the offsets to its own rows (``clamp(offs - start, 0,
  length)``), which keeps every row in its group. This is the data-parallel split of the experts.
- ``a [K, T] @ b [T, N] -> [E, K, N]`` (a per-group sum over ``T``): split ``K`` or ``N``, or split
  ``T`` on both operands with shifted offsets: each device sums its rows of every group, so the
  output is a partial sum (a group with no local rows gives zeros, written explicitly).

The op is bilinear, so a partial sum passes through either operand. The expert dim ``E`` splits
only in dropless expert parallelism (``rules.expert``: the rows travel to their experts' device and
back), never in place: masking the rows of experts a device does not hold would leave the stock
kernel running the rows before its first expert (unbalanced work). Dims of equal blocks
(``TensorSpec.blocks``) split like any dim except ``T``, whose split reads offsets.

The kernel wants each matrix's leading stride to be a multiple of 16 bytes (on CPU and on GPU), which
an uneven block of a split dim need not be: the local implementation then pads ``K``, ``N`` (and in
the weight gradient ``T``, at its end, past the last group) with zeros and cuts the output back.

``histc(x, bins, min, max)`` counts values: the counts of a split input are a partial sum of the
whole input's counts, as long as the range is fixed (``min < max``; ``min == max`` takes the range
from the data, which differs per device, so nothing splits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from autopar.ir.graph import Ref
from autopar.ir.placement import Split
from autopar.ir.rules.base import LocalCtx, OpCall, register, substitute
from autopar.ir.rules.dimmap import DimMap, Dims, Signature
from autopar.ir.rules.expert import compose, expert_local, expert_signatures
from autopar.ir.rules.generic import float_flags, linear_in

_GROUPED = "aten._grouped_mm.default"


def grouped_form(call: OpCall) -> Optional[str]:
    """``"rows"`` (2-D ``a`` by 3-D ``b``, groups of ``a``'s rows), ``"sum"`` (2-D by 2-D, groups of
    the contracted dim: the weight gradient) or None (any other form, or a bias / output dtype,
    which stay whole)."""
    args = list(call.args) + [None] * 5
    offs = args[2] if len(call.args) > 2 else call.kwargs.get("offs")
    bias = args[3] if len(call.args) > 3 else call.kwargs.get("bias")
    out_dtype = args[4] if len(call.args) > 4 else call.kwargs.get("out_dtype")
    if not isinstance(offs, Ref) or bias is not None or out_dtype is not None or len(call.in_specs) != 3:
        return None
    a, b = call.in_specs[0].ndim, call.in_specs[1].ndim
    return {(2, 3): "rows", (2, 2): "sum"}.get((a, b))


def _t_dim(form: str) -> int:
    """The dim of ``a`` that holds the grouped rows ``T``."""
    return 0 if form == "rows" else 1


def _aligned(t: torch.Tensor) -> bool:
    """Whether the kernel accepts ``t``'s layout: its last two dims row- or column-major with the
    leading stride a multiple of 16 bytes."""
    if t.ndim < 2:
        return True
    align = max(1, 16 // t.element_size())
    s, n = t.stride(), t.shape
    if s[-1] == 1 and s[-2] >= max(1, n[-1]):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, n[-2]):
        return s[-1] % align == 0
    return False


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def grouped_mm(target, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, form: str) -> torch.Tensor:
    """``target(a, b, offs)``, on zero-padded copies where the kernel would refuse the layout
    (padding adds zero products, or rows past the last group, and is cut from the result)."""
    if _aligned(a) and _aligned(b):
        return target(a, b, offs)
    align = max(1, 16 // a.element_size())
    if form == "rows":  # pad K on both, N on b
        k, n = a.shape[1], b.shape[2]
        kp, np_ = _up(k, align), _up(n, align)
        out = target(F.pad(a, (0, kp - k)), F.pad(b, (0, np_ - n, 0, kp - k)), offs)
        return out[:, :n].contiguous()
    t, n = a.shape[1], b.shape[1]  # pad T (past the last group) on both, N on b
    tp, np_ = _up(t, align), _up(n, align)
    out = target(F.pad(a, (0, tp - t)), F.pad(b, (0, np_ - n, 0, tp - t)), offs)
    return out[..., :n].contiguous()


def _grouped_local(ctx: LocalCtx, xs: list) -> torch.Tensor:
    """This device's block: offsets shifted to its rows where ``T`` is split (empty groups of a
    weight gradient zeroed), padded copies where a block's layout does not suit the kernel."""
    call = ctx.call
    form = grouped_form(call)
    args, kwargs = substitute(call, xs)
    if form is None:
        return call.target(*args, **kwargs)
    a, b, offs = xs[0], xs[1], xs[2]
    experts = expert_local(ctx, xs, form, lambda a_, b_, o_: grouped_mm(call.target, a_, b_, o_, form))
    if experts is not None:
        return experts
    split_t = any(isinstance(p, Split) and p.dim == _t_dim(form) for p in ctx.in_placements(0))
    if split_t:
        start, length = ctx.in_range(0, _t_dim(form))
        if length == 0:
            spec = call.out_specs[0]
            assert spec is not None
            return torch.zeros(ctx.out_shape(0), dtype=spec.dtype, device=a.device)
        offs = (offs - start).clamp(0, length).to(offs.dtype)
    out = grouped_mm(call.target, a, b, offs, form)
    if split_t and form == "sum":  # a group with no rows here contributes zeros to the sum
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        out = torch.where((counts > 0).reshape(-1, 1, 1), out, out.new_zeros(()))
    return out


def _grouped_extra(call: OpCall, dm: DimMap) -> list[Signature]:
    return expert_signatures(call, grouped_form(call))


@register(_GROUPED, local=_grouped_local, blocks_ok=True, extra=_grouped_extra, compose=compose)
def _grouped_mm(call: OpCall) -> DimMap:
    a, b = call.in_specs[0], call.in_specs[1]
    out = call.out_specs[0]
    assert out is not None
    fi, fo = float_flags(call)
    form = grouped_form(call)
    if form is None:  # every dim whole
        names = [[(f"_{i}_{d}",) for d in range(s.ndim)] for i, s in enumerate(call.in_specs)]
        onames = [(f"_o_{d}",) for d in range(out.ndim)]
        sizes = {f: n for dims, s in zip(names + [onames], list(call.in_specs) + [out])
                 for (f,), n in zip(dims, s.shape)}
        return DimMap(list(names), [onames], sizes, no_split=frozenset(sizes), float_inputs=fi, float_outputs=fo)
    no_split = {"_e"}
    if a.block_count(_t_dim(form)) > 1:
        no_split.add("t")  # the row split reads offsets, which know nothing of blocks
    if form == "rows":  # a [T, K] @ b [E, K, N] -> [T, N]
        ins: list[Optional[Dims]] = [[("t",), ("k",)], [("_e",), ("k",), ("n",)], None]
        outs: list[Optional[Dims]] = [[("t",), ("n",)]]
        sizes = {"t": a.shape[0], "k": a.shape[1], "_e": b.shape[0], "n": b.shape[2]}
        reduce = {"k": "sum"}
    else:  # a [K, T] @ b [T, N] -> [E, K, N]
        ins = [[("k",), ("t",)], [("t",), ("n",)], None]
        outs = [[("_e",), ("k",), ("n",)]]
        sizes = {"k": a.shape[0], "t": a.shape[1], "n": b.shape[1], "_e": out.shape[0]}
        reduce = {"t": "sum"}
    return DimMap(ins, outs, sizes, reduce=reduce, linear=[linear_in([0], [0]), linear_in([1], [0])],
                  no_split=frozenset(no_split), float_inputs=fi, float_outputs=fo)


@register("aten.histc.default")
def _histc(call: OpCall) -> DimMap:
    # histc(x, bins, min, max) -> [bins]: counts over every element of x (a sum over all its dims)
    x = call.in_specs[0]
    out = call.out_specs[0]
    assert out is not None
    names = [f"d{i}" for i in range(x.ndim)]
    lo, hi = call.arg(2, "min", 0), call.arg(3, "max", 0)
    fi, fo = float_flags(call)
    return DimMap(
        [[(n,) for n in names]], [[("_bins",)]], dict(zip(names, x.shape)) | {"_bins": out.shape[0]},
        reduce={n: "sum" for n in names},
        no_split=frozenset(["_bins"] + (names if not lo < hi else [])), float_inputs=fi, float_outputs=fo,
    )
