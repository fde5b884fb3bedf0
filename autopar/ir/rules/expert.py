"""Dropless expert parallelism as a strategy of ``aten._grouped_mm``: the experts' weights split on a
mesh axis, and the rows routed to an expert travel to the device that holds it and back.

The rows of a grouped product are sorted by expert (group ``e`` is rows ``offs[e-1]:offs[e]``,
``offs`` read whole on every device), so each expert owns one contiguous range of rows, whose bounds
come from ``offs`` when the step runs. With the rows split evenly over the axis (``S(0)``, as data
parallelism leaves them), what device ``j`` sends to device ``d`` is the overlap of its rows with the
ranges of ``d``'s experts: every device computes every split size from the same ``offs`` (the counts
are exchanged by the plan itself, which reduces the ``histc`` counts behind ``offs`` before the
product reads them whole), and the rows arrive in global order, so the received rows of every
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
A strategy may tag one mesh axis ``experts``; the others keep ``E`` whole and may split the rows
too (each axis group then exchanges its own rows: the weight gradient is a partial sum over the
other axis), the columns or the contraction.
"""

from __future__ import annotations

from typing import Optional, Sequence

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


def compose(call: OpCall, strats: list, mesh_shape: Sequence[int]) -> list:
    """The compositions of ``strats`` that hold together (``OpRule.compose``): see ``composes``."""
    return [s for s in strats if composes(s)]


def composes(strategy: Strategy) -> bool:
    """At most one axis runs the experts, and no other axis splits the expert dim (the exchange runs
    inside one axis group; other axes may split the rows, the columns or the contraction)."""
    tagged = [s for s in strategy if s.tag == TAG]
    if not tagged:
        return True
    if len(tagged) > 1:
        return False
    rows_form = tagged[0].inputs[0] == Split(0)
    for s in strategy:
        if s.tag != TAG and (s.inputs[1] == Split(0) if rows_form else s.outputs[0] == Split(0)):
            return False
    return True


def _axis(ctx: LocalCtx) -> Optional[int]:
    return next((i for i, s in enumerate(ctx.strategy) if s.tag == TAG), None)


def _member_range(ctx: LocalCtx, i: int, dim: int, axis: int, j: int) -> tuple[int, int]:
    """``(start, length)`` along ``dim`` of input ``i``'s block on member ``j`` of this device's group on ``axis``."""
    coords = list(ctx.coords)
    coords[axis] = j
    return local_range(ctx.call.in_specs[i].shape, ctx.in_placements(i), ctx.mesh_shape, coords)[dim]


def exchange_counts(ctx: LocalCtx, offs: list[int], axis: int, rows_dim: int,
                    experts: tuple[int, int]) -> list[list[int]]:
    """``counts[j][e]``: rows of member ``j`` of the axis group routed to expert ``experts[0] + e``
    (the block of experts member ``experts``' owner holds). Rows past the last group belong to none."""
    ends = [0] + list(offs)
    e0, ek = experts
    out = []
    for j in range(ctx.mesh_shape[axis]):
        s, k = _member_range(ctx, 0, rows_dim, axis, j)
        out.append([max(0, min(s + k, ends[e + 1]) - max(s, ends[e])) for e in range(e0, e0 + ek)])
    return out


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
    bounds = [int(o) for o in offs.tolist()]
    # every member's experts: the rows form's weight block, the weight gradient's output block
    if form == "rows":
        spec, placements = ctx.call.in_specs[1], ctx.in_placements(1)
    else:
        spec, placements = ctx.call.out_specs[0], ctx.out_placements(0)
    blocks = []
    for d in range(n):
        coords = list(ctx.coords)
        coords[axis] = d
        blocks.append(local_range(spec.shape, placements, ctx.mesh_shape, coords)[0])
    mine = exchange_counts(ctx, bounds, axis, rows_dim, blocks[me])  # [member][my expert]
    send = [sum(exchange_counts(ctx, bounds, axis, rows_dim, blocks[d])[me]) for d in range(n)]
    recv = [sum(row) for row in mine]
    counts = [sum(col) for col in zip(*mine)] if mine and mine[0] else []
    local_offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=offs.device, dtype=offs.dtype)
    # this device's rows are sorted by expert, so the ones it sends are a prefix (past the last group: none)
    if form == "rows":
        got = ctx.exchange(a.narrow(0, 0, sum(send)), axis, send, recv)
        y = grouped(got, b, local_offs) if got.shape[0] else got.new_zeros(0, b.shape[-1])
        back = ctx.exchange(y.contiguous(), axis, recv, send)
        if back.shape[0] < a.shape[0]:  # rows of no expert: zeros (the kernel leaves them unwritten)
            back = torch.cat([back, back.new_zeros(a.shape[0] - back.shape[0], back.shape[1])])
        return back
    got_a = ctx.exchange(a.narrow(1, 0, sum(send)).t().contiguous(), axis, send, recv).t()
    got_b = ctx.exchange(b.narrow(0, 0, sum(send)).contiguous(), axis, send, recv)
    if not got_b.shape[0]:
        return torch.zeros(ctx.out_shape(0), dtype=b.dtype, device=b.device)
    out = grouped(got_a, got_b, local_offs)
    empty = torch.tensor([c == 0 for c in counts], device=out.device).reshape(-1, 1, 1)
    return torch.where(empty, out.new_zeros(()), out)
