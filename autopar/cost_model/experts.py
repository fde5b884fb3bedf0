"""The price of dropless expert parallelism (``ir.rules.expert``): the dispatch and combine
all-to-alls of a grouped product whose experts split on a mesh axis, at the routing's expected load
times an imbalance factor.

The rows are sorted by expert, so what moves depends on where they sit (``expected_rows``): rows
split over the experts' axis in mesh order already sit at their experts' device, rows split on an
outer axis first all go, per outer group, to one member. The device that holds the busiest experts
receives ``IMBALANCE`` times its share, and every peer waits for it, so both the exchange and the
grouped product are priced at the busiest device's rows. ``IMBALANCE`` defaults to 1.25, the capacity
factor Switch Transformer trains with (Fedus, Zoph and Shazeer, "Switch Transformers", JMLR 2022,
section 2.2): the per-expert load over its mean that a router trained with a balance loss stays
under for nearly all tokens. It is a stated assumption, settable here, not a measurement of the
user's router.
"""

from __future__ import annotations

import itertools
import math
from typing import Optional, Sequence

from autopar.cost_model.comm import collective_time
from autopar.cost_model.mesh import Mesh
from autopar.ir.placement import local_range

#: max / mean rows per expert-parallel device (see the module docstring); set it to price another router.
IMBALANCE = 1.25

TAG = "experts"


def expert_axis(strategy) -> Optional[int]:
    """The mesh axis a grouped product's strategy runs its experts on (None: not expert-parallel)."""
    return next((i for i, s in enumerate(strategy) if s.tag == TAG), None)


def expected_rows(strategy, rows_shape: Sequence[int], rows_placements: Sequence, rows_dim: int,
                  experts_shape: Sequence[int], experts_placements: Sequence, mesh_shape: Sequence[int],
                  imbalance: Optional[float] = None) -> tuple[float, float]:
    """``(moved, held)``: the most rows one device moves in the exchange (sent or received, whichever
    is more) and the most it runs the grouped product on, at the routing's expected load.

    The rows are sorted by expert (group ``e`` is rows ``offs[e-1]:offs[e]`` of the whole), so at an
    even load expert ``e`` owns rows ``[e T / E, (e+1) T / E)``; where a device's own block of rows
    already holds its experts' rows, they stay (the sorted rows split on the expert axis in mesh order
    line up with the experts), and where a group's rows all belong to one member's experts they all
    go there. Each device receives from its own group (the tagged axes varied, the others fixed) the
    rows of that group's block that its experts own. The busiest expert-parallel device runs
    ``imbalance`` times its share; what it holds of it already stays."""
    f = IMBALANCE if imbalance is None else imbalance
    axes = [i for i, s in enumerate(strategy) if s.tag == TAG]
    t, e = int(rows_shape[rows_dim]), int(experts_shape[0])
    moved = held = 0.0
    for coords in itertools.product(*[range(n) for n in mesh_shape]):
        s0, n0 = local_range(rows_shape, rows_placements, mesh_shape, coords)[rows_dim]
        e0, ek = local_range(experts_shape, experts_placements, mesh_shape, coords)[0]
        lo, hi = e0 * t / e, (e0 + ek) * t / e  # this device's experts' rows at an even load
        share = 0.0
        for member in itertools.product(*[range(mesh_shape[a]) for a in axes]):
            c = list(coords)
            for a, m in zip(axes, member):
                c[a] = m
            s, n = local_range(rows_shape, rows_placements, mesh_shape, c)[rows_dim]
            share += max(0.0, min(hi, s + n) - max(lo, s))
        own = max(0.0, min(hi, s0 + n0) - max(lo, s0))
        moved = max(moved, f * (n0 - own), f * share - own)
        held = max(held, f * share)
    return moved, held


def exchange_time(strategy, in_specs: Sequence, in_placements: Sequence, out_spec, out_placements: Sequence,
                  elem_bytes: int, mesh: Mesh, imbalance: Optional[float] = None) -> tuple[float, float]:
    """``(seconds, factor)`` of one expert-parallel grouped product on the busiest device: the time of
    its all-to-alls and the factor its rows grow by over the even split (``expected_rows``).
    ``in_specs``/``out_spec``: the whole operands' shapes; the placements per mesh axis. The rows form
    ``a [T, K] @ b [E, K, N] -> [T, N]`` sends its rows and takes back ``[T, N]``; the weight gradient
    (``[K, T] x [T, N] -> [E, K, N]``) sends both operands' rows one way. Experts over several axes
    exchange once per axis (a hierarchical all-to-all), each at the moved rows' size."""
    axes = [i for i, s in enumerate(strategy) if s.tag == TAG]
    a, b = in_specs[0], in_specs[1]
    rows_form = len(b) == 3
    experts, e_place = (b, in_placements[1]) if rows_form else (out_spec, out_placements)
    rows_dim = 0 if rows_form else 1
    key = (tuple(strategy), tuple(a), tuple(in_placements[0]), rows_dim, tuple(experts), tuple(e_place),
           tuple(mesh.shape), IMBALANCE if imbalance is None else imbalance)
    if key not in _ROWS:
        _ROWS[key] = expected_rows(strategy, a, in_placements[0], rows_dim, experts, e_place, mesh.shape, imbalance)
    moved, held = _ROWS[key]
    mean = math.prod(a) / a[1 - rows_dim] / math.prod(mesh.shape)  # rows per device under an even split
    widths = [a[1], b[2]] if rows_form else [a[0] + b[1]]
    secs = 0.0
    for x in axes:
        n = mesh.shape[x]
        if n <= 1:
            continue
        for w in widths:  # ``ring_time``'s all_to_all moves (n-1)/n^2 of its bytes per device
            secs += collective_time("all_to_all", moved * w * elem_bytes * n * n / (n - 1), n, mesh.links[x])
    return secs, held / max(mean, 1.0)


#: ``expected_rows`` per (strategy, shapes, placements, mesh, imbalance): alike layers share one count
_ROWS: dict = {}


__all__ = ["IMBALANCE", "exchange_time", "expected_rows", "expert_axis"]
