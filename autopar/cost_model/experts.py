"""The price of dropless expert parallelism (``ir.rules.expert``): the dispatch and combine
all-to-alls of a grouped product whose experts split on a mesh axis, at the routing's expected load
times an imbalance factor.

Under an even split of the sorted rows each device sends about ``(n-1)/n`` of its rows away and
receives as many, when every expert gets its share; the device that holds the busiest experts
receives ``IMBALANCE`` times that, and every peer waits for it, so both the exchange and the
grouped product are priced at the imbalanced size. ``IMBALANCE`` defaults to 1.25, the capacity
factor Switch Transformer trains with (Fedus, Zoph and Shazeer, "Switch Transformers", JMLR 2022,
section 2.2): the per-expert load over its mean that a router trained with a balance loss stays
under for nearly all tokens. It is a stated assumption, settable here, not a measurement of the
user's router.
"""

from __future__ import annotations

from typing import Optional, Sequence

from autopar.cost_model.comm import collective_time
from autopar.cost_model.mesh import Mesh

#: max / mean rows per expert-parallel device (see the module docstring); set it to price another router.
IMBALANCE = 1.25

TAG = "experts"


def expert_axis(strategy) -> Optional[int]:
    """The mesh axis a grouped product's strategy runs its experts on (None: not expert-parallel)."""
    return next((i for i, s in enumerate(strategy) if s.tag == TAG), None)


def exchange_time(strategy, in_shapes: Sequence, elem_bytes: int, mesh: Mesh,
                  imbalance: Optional[float] = None) -> float:
    """Seconds of the all-to-alls one expert-parallel grouped product runs on one device:
    the rows form sends its rows ``[T, K]`` and takes back ``[T, N]``; the weight gradient
    (``[K, T] x [T, N]``) sends both operands' rows one way. ``in_shapes``: the local blocks.
    Experts over several axes exchange once per axis (a hierarchical all-to-all), each at the
    local rows' size (every stage leaves each device about as many rows as it had)."""
    axes = [i for i, s in enumerate(strategy) if s.tag == TAG]
    f = IMBALANCE if imbalance is None else imbalance
    a, b = in_shapes[0], in_shapes[1]
    if len(b) == 3:  # rows: a [T, K], out [T, N]
        moved = [a[0] * a[1], a[0] * b[2]]
    else:  # sum: a [K, T], b [T, N]
        moved = [a[0] * a[1] + b[0] * b[1]]
    return sum(collective_time("all_to_all", mesh.shape[x] * m * elem_bytes * f, mesh.shape[x], mesh.links[x])
               for x in axes for m in moved)


__all__ = ["IMBALANCE", "exchange_time", "expert_axis"]
