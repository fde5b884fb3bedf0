"""Dropless expert parallelism as a strategy of ``aten._grouped_mm``: the experts' weights split on
one mesh axis or several, and the rows routed to an expert travel to the device that holds it and back.

The rows of a grouped product are sorted by expert (group ``e`` is rows ``offs[e-1]:offs[e]``,
``offs`` read whole on every device), so each expert owns one contiguous range of rows, whose bounds
come from ``offs`` when the step runs. With the rows split evenly over the axis (``S(0)``, as data
parallelism leaves them), what device ``j`` sends to device ``d`` is the overlap of its rows with the
ranges of ``d``'s experts: every device computes every split size from the same ``offs`` (the counts
are exchanged by the plan itself, which reduces the ``histc`` counts behind ``offs`` before the
product reads them whole).

- ``rows`` form ``a [T, K] @ b [E, K, N] -> [T, N]``, signature ``(S(0), S(0), B) -> (S(0))``
  tagged ``experts``: dispatch ``a``'s rows (all-to-alls with run-time split sizes), the grouped
  product on the received rows with this device's experts, the combine in reverse.
- ``sum`` form ``a [K, T] @ b [T, N] -> [E, K, N]`` (the weight gradient), signature
  ``(S(1), S(0), B) -> (S(0))``: both operands' rows travel to their experts' device, which sums
  them into its block of experts (an expert with no row gets zeros).

The forward's product and its input gradient are the rows form, the weight gradient the sum form, so
the backward is the mirror of the forward. The exchange is the lowered program's
``all_to_all_v`` (``LocalCtx.exchange``, set by the lowering: rules sit below the collectives).

Several axes may be tagged ``experts`` at once (the expert layers' own factorization of the mesh:
experts over dp x tp where attention splits the batch on dp and heads on tp). The experts then split
over those axes together, nested in mesh order, and the rows travel in one exchange per axis, outer
axis first (a hierarchical all-to-all): after the exchange on an axis every row sits at the member
whose coordinate on that axis is its expert's owner's, and each device regroups what it received by
expert (``_regroup``) so that the next axis's pieces are again consecutive. The combine runs the
stages backwards. Untagged axes keep ``E`` whole and may split the rows too (each group of the
tagged axes then exchanges its own rows: the weight gradient is a partial sum over the other axis),
the columns within an expert (expert-tensor parallelism) or the contraction.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Optional, Sequence

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


def expert_count(call: OpCall) -> int:
    """The number of experts ``E`` of a grouped product (its 3-D weight's or output's dim 0)."""
    spec = call.in_specs[1] if call.in_specs[1].ndim == 3 else call.out_specs[0]
    return int(spec.shape[0]) if spec is not None else 0


def graph_experts(graph) -> int:
    """The most experts of a grouped product of ``graph`` that can run expert-parallel (0: none;
    the graph is no mixture of experts the experts strategy serves)."""
    most = 0
    for n in graph.ops():
        if n.op == "aten._grouped_mm.default" and len(n.inputs) >= 3:
            a, b = graph.spec(n.inputs[0]), graph.spec(n.inputs[1])
            if a.ndim == 2 and b.ndim == 3:
                most = max(most, int(b.shape[0]))
    return most


def compose(call: OpCall, strats: list, mesh_shape: Sequence[int]) -> list:
    """The compositions of ``strats`` that hold together (``OpRule.compose``): see ``composes``;
    several tagged axes together give every device at least one expert."""
    e = expert_count(call)
    return [s for s in strats if composes(s) and (len(expert_axes(s)) < 2 or math.prod(
        n for sig, n in zip(s, mesh_shape) if sig.tag == TAG) <= e)]


def composes(strategy: Strategy) -> bool:
    """No untagged axis splits the expert dim (the experts split over the tagged axes alone; the
    others may split the rows, the columns or the contraction)."""
    tagged = [s for s in strategy if s.tag == TAG]
    if not tagged:
        return True
    rows_form = tagged[0].inputs[0] == Split(0)
    for s in strategy:
        if s.tag != TAG and (s.inputs[1] == Split(0) if rows_form else s.outputs[0] == Split(0)):
            return False
    return True


def expert_axes(strategy: Strategy) -> list[int]:
    """The mesh axes a strategy runs its experts over, in mesh order (empty: not expert-parallel)."""
    return [i for i, s in enumerate(strategy) if s.tag == TAG]


class _Route:
    """The hierarchical exchange's sizes on this device, computed alike on every device from ``offs``.

    ``stages[k]`` for the ``k``-th tagged axis: ``(axis, send, recv, index)``, the split sizes of its
    all-to-all and the index that regroups the received rows by expert (None: already in order).
    ``counts``: rows of each of this device's experts once every stage has run."""

    def __init__(self, ctx: LocalCtx, offs: list[int], form: str):
        axes = expert_axes(ctx.strategy)
        rows_dim = 0 if form == "rows" else 1
        if form == "rows":
            spec, placements = ctx.call.in_specs[1], ctx.in_placements(1)
        else:
            spec, placements = ctx.call.out_specs[0], ctx.out_placements(0)
        n_e = len(offs)
        ends = torch.tensor([0] + list(offs), dtype=torch.int64)
        sizes = [ctx.mesh_shape[a] for a in axes]
        # per member of this device's group (row-major over the tagged axes): rows held of each
        # expert, and the owner's coordinate on each tagged axis of every expert
        owner = torch.zeros(len(axes), n_e, dtype=torch.int64)
        starts, lengths = [], []
        mine: tuple[int, int] = (0, 0)
        for member in itertools.product(*[range(n) for n in sizes]):
            coords = list(ctx.coords)
            for a, c in zip(axes, member):
                coords[a] = c
            s, k = local_range(ctx.call.in_specs[0].shape, ctx.in_placements(0), ctx.mesh_shape, coords)[rows_dim]
            starts.append(s)
            lengths.append(k)
            e0, ek = local_range(spec.shape, placements, ctx.mesh_shape, coords)[0]
            owner[:, e0:e0 + ek] = torch.tensor(member, dtype=torch.int64).reshape(-1, 1)
            if tuple(coords) == tuple(ctx.coords):
                mine = (e0, ek)
        st = torch.tensor(starts).reshape(-1, 1)
        hi = st + torch.tensor(lengths).reshape(-1, 1)
        held = (torch.minimum(hi, ends[1:]) - torch.maximum(st, ends[:-1])).clamp(min=0)
        held = held.reshape(*sizes, n_e)  # rows past the last group belong to no expert: never sent
        me = tuple(ctx.coords[a] for a in axes)
        self.stages: list[tuple[int, list[int], list[int], Optional[torch.Tensor]]] = []
        for k, (axis, n) in enumerate(zip(axes, sizes)):
            to = torch.nn.functional.one_hot(owner[k], n).T  # [n, E]: expert e goes to coordinate owner[k][e]
            line = held[me[:k] + (slice(None),) + me[k + 1:]]  # [n, E]: this device's axis group
            send = (line[me[k]] * to).sum(-1).tolist()
            pieces = line * to[me[k]]  # [source, E]: what each member sends here
            self.stages.append((axis, send, pieces.sum(-1).tolist(), _regroup(pieces)))
            shape = [1] * (len(sizes) + 1)
            shape[k], shape[-1] = n, n_e
            held = held.sum(k, keepdim=True) * to.reshape(shape)
        self.counts = held[me].narrow(0, mine[0], mine[1]).tolist()

    def dispatch(self, xs: list[torch.Tensor], exchange: Callable) -> list[torch.Tensor]:
        """The rows of ``xs`` (dim 0, sorted by expert) at their experts' device, sorted by expert."""
        for axis, send, recv, index in self.stages:
            xs = [exchange(x.narrow(0, 0, sum(send)).contiguous(), axis, send, recv) for x in xs]
            if index is not None:
                xs = [x.index_select(0, index.to(x.device)) for x in xs]
        return xs

    def combine(self, y: torch.Tensor, exchange: Callable) -> torch.Tensor:
        """The rows of ``y`` (as ``dispatch`` left them) back at the device they came from, in its order."""
        for axis, send, recv, index in reversed(self.stages):
            if index is not None:
                y = torch.empty_like(y).index_copy(0, index.to(y.device), y)
            y = exchange(y.contiguous(), axis, recv, send)
        return y


def _regroup(pieces: torch.Tensor) -> Optional[torch.Tensor]:
    """The index that orders rows received as consecutive pieces (``pieces[s][e]`` rows of expert
    ``e`` from source ``s``, each piece sorted by expert) by expert, keeping the pieces' order within
    an expert; None when they already are."""
    nz = [e for row in (pieces > 0).tolist() for e, x in enumerate(row) if x]
    if all(a <= b for a, b in zip(nz, nz[1:])):
        return None
    flat = pieces.reshape(-1)
    start = (flat.cumsum(0) - flat).reshape(pieces.shape)  # where each (source, expert) piece begins
    lengths = pieces.T.reshape(-1)  # expert-major
    begins = start.T.reshape(-1)
    out_start = lengths.cumsum(0) - lengths
    return torch.repeat_interleave(begins - out_start, lengths) + torch.arange(int(lengths.sum()))


def expert_local(ctx: LocalCtx, xs: list, form: str, grouped) -> Optional[torch.Tensor]:
    """This device's output under the experts strategy (None: the strategy does not run the experts).
    ``grouped(a, b, offs)`` runs the product on local operands."""
    if not expert_axes(ctx.strategy):
        return None
    if ctx.exchange is None:
        raise RuntimeError("the experts strategy of aten._grouped_mm needs the program's all_to_all_v "
                           "(LocalCtx.exchange), which the lowering provides")
    a, b, offs = xs[0], xs[1], xs[2]
    route = _Route(ctx, [int(o) for o in offs.tolist()], form)
    local_offs = torch.tensor(route.counts, dtype=torch.int64).cumsum(0).to(device=offs.device, dtype=offs.dtype)
    if form == "rows":
        got = route.dispatch([a], ctx.exchange)[0]
        y = grouped(got, b, local_offs) if got.shape[0] else got.new_zeros(0, b.shape[-1])
        back = route.combine(y, ctx.exchange)
        if back.shape[0] < a.shape[0]:  # rows of no expert: zeros (the kernel leaves them unwritten)
            back = torch.cat([back, back.new_zeros(a.shape[0] - back.shape[0], back.shape[1])])
        return back
    got_a, got_b = route.dispatch([a.t(), b], ctx.exchange)
    if not got_b.shape[0]:
        return torch.zeros(ctx.out_shape(0), dtype=b.dtype, device=b.device)
    out = grouped(got_a.t(), got_b, local_offs)
    empty = torch.tensor([c == 0 for c in route.counts], device=out.device).reshape(-1, 1, 1)
    return torch.where(empty, out.new_zeros(()), out)
