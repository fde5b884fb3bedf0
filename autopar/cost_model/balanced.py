"""Resharding to and from the load-balanced split ``Z(d)`` (``ir.placement.Balanced``), as steps.

``Z(d)`` on an axis of ``n`` devices is ``S(d)`` of the tensor with ``d``'s ``2n`` chunks reordered
(``ir.placement.zigzag``), so a resharding that keeps an axis's ``Z`` is an ordinary one on the
other axes, and one that changes it converts that axis first (or last):

==================  ===============================  ==========================================
from -> to          steps                            time
==================  ===============================  ==========================================
Z(d) -> S(d)        two ``permute``                  two point-to-point hops of half a block
S(d) -> Z(d)        two ``permute``                  (a permute that moves nothing is skipped)
Z(d) -> B           all_gather, ``unorder``          the all-gather's; the reorder is local
B -> Z(d)           ``zigzag_slice``                 0 (local: chunks r and 2n-1-r)
P -> Z(d)           ``reorder``, reduce_scatter      the reduce-scatter's (reordering addends is local)
Z(d) -> other       Z(d) -> S(d), then the rest      as above, plus the ordinary steps
==================  ===============================  ==========================================

Each permute step's ``bytes`` is what one device sends (half its block), as the runtime records
it. ``lowering_steps`` gives every step with the placements after it, which the lowering runs (a
conversion's permutes run together at its last step, the one whose placements change).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from autopar.cost_model import comm
from autopar.cost_model.comm import Step, collective_time, reshard_steps, step_bytes
from autopar.ir.placement import Balanced, Broadcast, Partial, Placement, Split

if TYPE_CHECKING:
    from autopar.cost_model.mesh import Mesh

__all__ = ["has_balanced", "lowering_steps", "permute_dest", "balanced_steps"]

Placements = tuple[Placement, ...]


def has_balanced(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether either side of a resharding has a ``Z`` axis."""
    return any(type(p) is Balanced for p in tuple(src) + tuple(dst))


def _owner(chunk: int, n: int) -> int:
    """The rank holding ``chunk`` (of ``2n``) under ``Z``."""
    return chunk if chunk < n else 2 * n - 1 - chunk


def permute_dest(to_balanced: bool, n: int, parity: int) -> list[int]:
    """Where each rank sends its chunk of ``parity`` (0: even chunk index, 1: odd) going ``S -> Z``
    (rank s holds chunks 2s, 2s+1) or ``Z -> S`` (rank s holds chunks s, 2n-1-s)."""
    if to_balanced:
        return [_owner(2 * s + parity, n) for s in range(n)]
    return [(s if s % 2 == parity else 2 * n - 1 - s) // 2 for s in range(n)]


def _permutes(to_balanced: bool, a: int, n: int, nbytes: int, mesh: "Mesh") -> list[Step]:
    """The point-to-point steps of one conversion: one per parity that moves something."""
    half = nbytes // 2
    return [Step("permute", a, half, collective_time("permute", half, n, mesh.links[a]))
            for parity in (0, 1) if permute_dest(to_balanced, n, parity) != list(range(n))]


def _convert(out: list, cur: list, steps: list[Step], a: int, new: Placement) -> None:
    """Append a conversion's steps; the placements change at its last."""
    for st in steps[:-1]:
        out.append((st, tuple(cur)))
    cur[a] = new
    out.append((steps[-1], tuple(cur)))


def _plain(placements: Sequence[Placement]) -> Placements:
    return tuple(Split(p.dim) if type(p) is Balanced else p for p in placements)


def lowering_steps(shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement], mesh: "Mesh",
                   elem_bytes: int) -> list[tuple[Step, Placements]]:
    """The steps from ``src`` to ``dst`` with the placements after each (``Z`` where an axis holds
    the balanced layout; the ordinary steps in between see it as ``S``, their geometry)."""
    ms, eb = mesh.shape, int(elem_bytes)
    out: list[tuple[Step, Placements]] = []
    cur = list(src)

    def add(step: Step, a: int, new: Placement) -> None:
        cur[a] = new
        out.append((step, tuple(cur)))

    for a, p in enumerate(src):  # leave Z where the target does not keep it
        if type(p) is not Balanced or dst[a] == p:
            continue
        nbytes = step_bytes(shape, _plain(cur), Split(p.dim), a, ms, eb) // ms[a]
        if isinstance(dst[a], Broadcast):
            nb = step_bytes(shape, _plain(cur), dst[a], a, ms, eb)
            add(Step("all_gather", a, nb, collective_time("all_gather", nb, ms[a], mesh.links[a])), a, p)
            add(Step("unorder", a, 0, 0.0), a, dst[a])
        else:
            _convert(out, cur, _permutes(False, a, ms[a], nbytes, mesh), a, Split(p.dim))
    mid = list(dst)  # what the ordinary steps reach: Z's axes as they are, ready to convert
    for a, q in enumerate(dst):
        if type(q) is Balanced and cur[a] != q:
            mid[a] = cur[a] if isinstance(cur[a], (Broadcast, Partial)) else Split(q.dim)
    keep = [type(p) is Balanced for p in cur]
    for st in reshard_steps(shape, _plain(cur), _plain(mid), mesh, eb):
        new = Broadcast() if st.kind == "all_gather" else mid[st.axis]
        add(st, st.axis, new)
    for a, k in enumerate(keep):
        if k:
            cur[a] = dst[a]
    for a, q in enumerate(dst):  # reach Z where the target has it
        if type(q) is not Balanced or cur[a] == q:
            continue
        c = cur[a]
        if isinstance(c, Broadcast):
            add(Step("zigzag_slice", a, 0, 0.0), a, q)
        elif isinstance(c, Partial):
            out.append((Step("reorder", a, 0, 0.0), tuple(cur)))
            nb = step_bytes(shape, _plain(cur), Split(q.dim), a, ms, eb)
            add(Step("reduce_scatter", a, nb, collective_time("reduce_scatter", nb, ms[a], mesh.links[a]),
                     c.reduce), a, q)
        else:
            nbytes = step_bytes(shape, _plain(cur), Split(q.dim), a, ms, eb) // ms[a]
            _convert(out, cur, _permutes(True, a, ms[a], nbytes, mesh), a, q)
    assert tuple(cur) == tuple(dst), (cur, dst)
    return out


_MEMO: dict = {}


def balanced_steps(shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement], mesh: "Mesh",
                   elem_bytes: int) -> tuple[tuple[Step, ...], float]:
    """The steps of a resharding with a ``Z`` axis on either side, and their seconds (memoized per
    mesh shape and links, as ``comm.reshard_steps`` is)."""
    key = (tuple(shape), tuple(src), tuple(dst), mesh.shape, mesh.links, int(elem_bytes))
    if key not in _MEMO:
        steps = tuple(st for st, _ in lowering_steps(shape, src, dst, mesh, elem_bytes))
        _MEMO[key] = (steps, sum(st.time for st in steps))
    return _MEMO[key]


comm.BALANCED.update(steps=balanced_steps, memo=_MEMO)
