"""Dropless expert parallelism as a strategy of ``aten._grouped_mm``: the experts' weights split on a
mesh axis, and the rows routed to an expert travel to the device that holds it and back.

The rows of a grouped product are sorted by expert (group ``e`` is rows ``offs[e-1]:offs[e]``,
``offs`` read whole on every device), so the experts a device holds own one contiguous range of
rows, whose bounds come from ``offs`` when the step runs. With the rows split evenly over the axis
(``S(0)``, as data parallelism leaves them), what device ``j`` sends to device ``d`` is the overlap
of its rows with ``d``'s range: every device computes every split size from the same ``offs`` (the
counts are exchanged by the plan itself, which reduces the ``histc`` counts behind ``offs`` before
the product reads them whole), the rows arrive in global order, so the received rows of every
expert are again contiguous and sorted.

- ``rows`` form ``a [T, K] @ b [E, K, N] -> [T, N]``, signature ``(S(0), S(0), B) -> (S(0))``
  tagged ``experts``: dispatch ``a``'s rows (an all-to-all with run-time split sizes), the grouped
  product on the received rows with this device's experts, the combine in reverse.
- ``sum`` form ``a [K, T] @ b [T, N] -> [E, K, N]`` (the weight gradient), signature
  ``(S(1), S(0), B) -> (S(0))``: both operands' rows travel to their experts' device, which sums
  them into its block of experts (an expert with no row gets zeros).

The forward's product and its input gradient are the rows form, the weight gradient the sum form, so
the backward is the mirror of the forward. The exchange is the lowered program's
``all_to_all_v`` (``LocalCtx.exchange``, set by the lowering: rules sit below the collectives).
A strategy may tag one mesh axis ``experts``; the others must keep ``T`` and ``E`` whole.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.ir.placement import B, Split, local_range
from autopar.ir.rules.base import LocalCtx, OpCall
from autopar.ir.rules.dimmap import Signature, Strategy

TAG = "experts"


def expert_signatures(call: OpCall, form: Optional[str]) -> list[Signature]:
    """The expert-parallel signature of a grouped product of ``form`` (none for other forms)."""
    a, b = call.in_specs[0], call.in_specs[1]
    if form == "rows" and b.shape[0] >= 2:
        return [Signature((Split(0), Split(0), B), (Split(0),), TAG)]
    if form == "sum" and call.out_specs[0] is not None and call.out_specs[0].shape[0] >= 2 and a.shape[1] >= 2:
        return [Signature((Split(1), Split(0), B), (Split(0),), TAG)]
    return []


def composes(strategy: Strategy) -> bool:
    """At most one axis runs the experts; every other axis keeps the rows and the experts whole
    (the exchange runs inside one axis group, on rows split by that axis alone)."""
    tagged = [s for s in strategy if s.tag == TAG]
    if not tagged:
        return True
    if len(tagged) > 1:
        return False
    rows_dim = 0 if tagged[0].inputs[0] == Split(0) else 1
    for s in strategy:
        if s.tag != TAG and (s.inputs[0] == Split(rows_dim) or s.inputs[1] == Split(0) or s.outputs[0] == Split(0)):
            return False
    return True


def _axis(ctx: LocalCtx) -> Optional[int]:
    return next((i for i, s in enumerate(ctx.strategy) if s.tag == TAG), None)


def _ranges(size: int, n: int, axis: int, ctx: LocalCtx) -> list[tuple[int, int]]:
    """``(start, length)`` of every member of the axis group, for a dim of ``size`` split on ``axis``."""
    out = []
    for j in range(n):
        coords = list(ctx.coords)
        coords[axis] = j
        placements = [Split(0) if a == axis else B for a in range(len(ctx.mesh_shape))]
        out.append(local_range((size,), placements, ctx.mesh_shape, coords)[0])
    return out


def exchange_sizes(offs: list[int], n_rows: int, n_experts: int, n: int, ctx: LocalCtx,
                   axis: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """``(sizes, owned)``: ``sizes[j][d]`` rows that member ``j`` sends to member ``d``; ``owned[d]``
    the global row range ``(start, stop)`` of member ``d``'s experts."""
    ends = [0] + [min(o, n_rows) for o in offs]
    experts = _ranges(n_experts, n, axis, ctx)
    owned = [(ends[s], ends[s + k]) for s, k in experts]
    rows = _ranges(n_rows, n, axis, ctx)
    sizes = [[max(0, min(s + k, hi) - max(s, lo)) for lo, hi in owned] for s, k in rows]
    return sizes, owned


def expert_local(ctx: LocalCtx, xs: list, form: str, grouped) -> Optional[torch.Tensor]:
    """This device's output under the experts strategy (None: the strategy does not run the experts).
    ``grouped(a, b, offs)`` runs the product on local operands."""
    axis = _axis(ctx)
    if axis is None:
        return None
    if ctx.exchange is None:
        raise RuntimeError("the experts strategy of aten._grouped_mm needs the program's all_to_all_v "
                           "(LocalCtx.exchange), which the lowering provides")
    a, b, offs = xs[0], xs[1], xs[2]
    n, me = ctx.mesh_shape[axis], ctx.coords[axis]
    rows_dim = 0 if form == "rows" else 1
    n_rows = ctx.call.in_specs[0].shape[rows_dim]
    n_experts = ctx.call.in_specs[1].shape[0] if form == "rows" else ctx.call.out_specs[0].shape[0]
    sizes, owned = exchange_sizes([int(o) for o in offs.tolist()], n_rows, n_experts, n, ctx, axis)
    send, recv = sizes[me], [sizes[j][me] for j in range(n)]
    lo, hi = owned[me]
    e0, ek = _ranges(n_experts, n, axis, ctx)[me]
    mine = (offs[e0:e0 + ek] - lo).clamp(0, hi - lo).to(offs.dtype)
    if form == "rows":
        # rows past the last group belong to no expert (the kernel leaves them unwritten): zeros here
        sent = a.narrow(0, 0, sum(send))
        got = ctx.exchange(sent, axis, send, recv)
        y = grouped(got, b, mine) if got.shape[0] else got.new_zeros(0, b.shape[-1])
        back = ctx.exchange(y.contiguous(), axis, recv, send)
        if back.shape[0] < a.shape[0]:
            back = torch.cat([back, back.new_zeros(a.shape[0] - back.shape[0], back.shape[1])])
        return back
    got_a = ctx.exchange(a.narrow(1, 0, sum(send)).t().contiguous(), axis, send, recv).t()
    got_b = ctx.exchange(b.narrow(0, 0, sum(send)).contiguous(), axis, send, recv)
    out = grouped(got_a, got_b, mine) if got_b.shape[0] else None
    shape = ctx.out_shape(0)
    if out is None:
        return torch.zeros(shape, dtype=b.dtype, device=b.device)
    counts = torch.diff(mine, prepend=mine.new_zeros(1))
    return torch.where((counts > 0).reshape(-1, 1, 1), out, out.new_zeros(()))
