"""Communication cost: resharding a tensor between placements, as timed collectives per mesh axis.

One axis of ``n`` devices with link (alpha, beta) and ``B`` bytes of the tensor as that axis's group
sees it (ring algorithms, DESIGN.md "SBP"; each kind's time times the link's factor for it,
``Link.factors``, 1 unless measured by ``autopar calibrate``):

=================  ==============  ===========================================
from -> to         step            time
=================  ==============  ===========================================
S(i) -> B          all_gather      (n-1) a + (n-1)/n   B/b
P -> B             all_reduce      2(n-1) a + 2(n-1)/n B/b
P -> S(i)          reduce_scatter  (n-1) a + (n-1)/n   B/b
S(i) -> S(j)       all_to_all      (n-1) a + (n-1)/n^2 B/b
P(x) -> P(y)       all_reduce      (reduce with x, then keep one addend locally)
B -> S(i)          slice           0 (local)
B -> P             zero            0 (all but one device zero their copy)
S(i) -> P          pad             0 (each device zero-pads its block to the full tensor)
=================  ==============  ===========================================

A change on several axes is a sequence of one-axis steps; the bytes a step moves depend on the
other axes' placements at that moment, so every valid order is tried and the cheapest kept (an
order is valid when each step acts on contiguous blocks: see ``step_valid``). The lowering runs
exactly these steps, so predicted and executed collectives agree.

Two axes that both split dim i and both turn to splitting dim j (Ulysses over two axes: sequence
split on both, heads split on both) have no valid order of one-axis steps: whichever axis goes
second finds the other one's pieces interleaved. Their change is one all-to-all over the group of
both axes (``joint_step``): its ranks, numbered axis-a-major, hold dim i's blocks in the order the
nested splits give them, so the exchange is exact; priced on the two links (``joint_time``).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from autopar.cost_model.hardware import Link
from autopar.ir.placement import Balanced, Broadcast, Partial, Placement, Split

if TYPE_CHECKING:
    from autopar.cost_model.mesh import Mesh

KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice", "pad", "zero",
         # the balanced split's (``cost_model.balanced``): a point-to-point exchange, local reorders
         "permute", "zigzag_slice", "unorder", "reorder")
LOCAL_KINDS = frozenset({"slice", "pad", "zero", "zigzag_slice", "unorder", "reorder"})


@dataclass(frozen=True)
class Step:
    """One collective (or local) step of a reshard, on one mesh axis."""

    kind: str  # one of KINDS
    axis: int  # mesh axis index
    bytes: int  # the tensor as this axis's group sees it (local block w.r.t. the other axes)
    time: float
    reduce: str = "sum"  # for all_reduce / reduce_scatter: the partial's reduction
    axes: tuple[int, ...] = ()  # a collective over the group of several axes (``joint_step``): them, axis first


def step_axes(step: Step) -> tuple[int, ...]:
    """The mesh axes whose combined group runs ``step`` (one, except for a joint all-to-all)."""
    return step.axes or (step.axis,)


def collective_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """Ring-algorithm time of one collective over ``n`` devices (0 for local steps or ``n == 1``).

    Each collective also pays one ``latency`` to start (a launch and a handshake), so one
    all-reduce is cheaper than the reduce-scatter + all-gather that moves the same bytes. The ring
    time is multiplied by the link's factor for ``kind`` (``Link.factors``: what the backend's
    implementation costs over the ring algorithm's, measured by ``autopar calibrate``; 1 unless
    given, as on the GPU presets).
    """
    return ring_time(kind, nbytes, n, link) * link.factor(kind)


def ring_time(kind: str, nbytes: float, n: int, link: Link) -> float:
    """``collective_time`` without the link's per-kind factor: the ring algorithm's time."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {KINDS}")
    if n <= 1 or kind in LOCAL_KINDS:
        return 0.0
    a, b = link.latency, link.bandwidth
    if kind == "all_gather" or kind == "reduce_scatter":
        return n * a + (n - 1) / n * nbytes / b
    if kind == "all_reduce":
        return (2 * (n - 1) + 1) * a + 2 * (n - 1) / n * nbytes / b
    if kind == "permute":  # point to point: ``nbytes`` sent by each device
        return a + nbytes / b
    return n * a + (n - 1) / (n * n) * nbytes / b  # all_to_all


def axis_step(src: Placement, dst: Placement) -> str | None:
    """The step that turns ``src`` into ``dst`` on one axis (None when they are equal)."""
    if src == dst:
        return None
    if isinstance(src, Split):
        if isinstance(dst, Broadcast):
            return "all_gather"
        if isinstance(dst, Split):
            return "all_to_all"
        if isinstance(dst, Partial):
            return "pad"
    elif isinstance(src, Partial):
        if isinstance(dst, Broadcast):
            return "all_reduce"
        if isinstance(dst, Split):
            return "reduce_scatter"
        if isinstance(dst, Partial):
            return "all_reduce"
    elif isinstance(src, Broadcast):
        if isinstance(dst, Split):
            return "slice"
        if isinstance(dst, Partial):
            return "zero"
    raise ValueError(f"no reshard step from {src!r} to {dst!r}")


def _splits_dim(p: Placement, dim: int) -> bool:
    return isinstance(p, Split) and p.dim == dim


def step_valid(cur: Sequence[Placement], dst: Placement, axis: int) -> bool:
    """Whether changing ``cur[axis]`` to ``dst`` acts on contiguous blocks.

    Splits of one dim nest in mesh-axis order (axis 0 outermost), so an axis may split or gather
    a dim only while no later axis splits that dim too; otherwise the later axis's pieces would
    interleave. Such orders are skipped (the lowering could not run them as one collective).
    """
    dims = [p.dim for p in (cur[axis], dst) if isinstance(p, Split)]
    if not dims:
        return True
    # (a loop, not nested generators: this runs for every step the search prices)
    for b in range(axis + 1, len(cur)):
        p = cur[b]
        if isinstance(p, Split) and p.dim in dims:
            return False
    return True


def step_bytes(shape: Sequence[int], cur: Sequence[Placement], dst: Placement, axis: int,
               mesh_shape: Sequence[int], elem_bytes: int) -> int:
    """Bytes of one step's buffer as the axis group sees it: the local block with ``axis`` taken
    as ``B``, each dim the step splits or gathers padded to a multiple of the axis size (uneven
    splits run as equal, zero-padded pieces)."""
    # the block at coordinates 0 (``local_shape``'s, computed directly: this runs for every step of
    # every resharding the search prices): each split of another axis ceil-divides its dim
    block = list(shape)
    for a, p in enumerate(cur):
        if a != axis and isinstance(p, Split):
            block[p.dim] = -(-block[p.dim] // mesh_shape[a])
    n = mesh_shape[axis]
    for p in (cur[axis], dst):
        if isinstance(p, Split) and n > 1:
            block[p.dim] = -(-block[p.dim] // n) * n
    return math.prod(block) * elem_bytes


def _one_step(shape, cur, dst, a: int, mesh_shape, links, elem_bytes) -> tuple | None:
    """The step that changes ``cur[a]`` to ``dst[a]``, as ``Step``'s fields (kind, axis, bytes,
    seconds, reduce), or None where it would not act on contiguous blocks (``step_valid``)."""
    kind = axis_step(cur[a], dst[a])
    assert kind is not None
    if not step_valid(cur, dst[a], a):
        return None
    nbytes = step_bytes(shape, cur, dst[a], a, mesh_shape, elem_bytes)
    reduce = cur[a].reduce if isinstance(cur[a], Partial) else "sum"
    return kind, a, nbytes, collective_time(kind, nbytes, mesh_shape[a], links[a]), reduce


def _steps_in_order(shape, src, dst, mesh_shape, links, elem_bytes, order) -> tuple[list[Step], float] | None:
    cur = list(src)
    steps: list[Step] = []
    total = 0.0
    for a in order:
        if isinstance(a, tuple):  # two axes changed by one collective over their combined group
            step = joint_step(shape, cur, dst, a, mesh_shape, links, elem_bytes)
            if step is None:
                return None
            steps.append(step)
            total += step.time
            for b in a:
                cur[b] = dst[b]
            continue
        one = _one_step(shape, cur, dst, a, mesh_shape, links, elem_bytes)
        if one is None:
            return None
        steps.append(Step(*one))
        total += one[3]
        cur[a] = dst[a]
    return steps, total


def _best_order(shape, src, dst, mesh_shape, links, elem_bytes, changing) -> tuple[tuple[Step, ...], float] | None:
    """The cheapest valid order of one-axis steps over ``changing`` (permutations in lexicographic
    order: the first of equal cost wins), each order priced as ``_steps_in_order`` prices it, or
    None when no order is valid. A step depends only on which axes changed before it, so each is
    priced once per (those axes, its axis) rather than once per order (12 steps instead of 18 on
    three changing axes), and only the winner's become ``Step``s."""
    priced: dict[tuple[int, int], tuple | None] = {}
    best, best_total = None, 0.0
    for order in itertools.permutations(changing):
        total, done = 0.0, 0
        for a in order:
            one = priced.get((done, a), False)
            if one is False:
                cur = [dst[b] if done >> b & 1 else p for b, p in enumerate(src)]
                one = priced[done, a] = _one_step(shape, cur, dst, a, mesh_shape, links, elem_bytes)
            if one is None:
                break
            total += one[3]
            done |= 1 << a
        else:
            if best is None or total < best_total:
                best, best_total = order, total
    if best is None:
        return None
    steps, done = [], 0
    for a in best:
        steps.append(Step(*priced[done, a]))
        done |= 1 << a
    return tuple(steps), best_total


def _via_unsplit(src) -> tuple[Placement, ...]:
    """The midpoint of the always-valid route: every split of ``src`` gathered."""
    return tuple(Broadcast() if isinstance(s, Split) else s for s in src)


# 2^19 entries (~400 B each): a 3-axis mesh's search prices ~500k distinct reshardings (measured: a
# 3-layer tiny LLaMA on (2, 2, 2), 1.86M lookups), which 2^18 entries evicted and priced again
# (745k misses): 2^19 holds them once, 18% less CPU in its planning, for ~200 MB more at most
@functools.lru_cache(maxsize=1 << 19)
def _best_steps(shape, src, dst, mesh_shape, links, elem_bytes) -> tuple[tuple[Step, ...], float]:
    changing = [a for a in range(len(mesh_shape)) if src[a] != dst[a]]
    # permutations of a sorted list come in lexicographic order: the first of equal cost wins
    best = _best_order(shape, src, dst, mesh_shape, links, elem_bytes, changing)
    if best is None and changing:
        best = _best_joint(shape, src, dst, mesh_shape, links, elem_bytes, changing)
    if best is None and changing:
        # No direct order is valid (e.g. S(0),S(0) -> S(1),S(0)): gather every split from the
        # innermost axis out, then reshard from the outermost axis in; both halves are always valid.
        mid = _via_unsplit(src)
        axes = range(len(mesh_shape))
        first = _steps_in_order(shape, src, mid, mesh_shape, links, elem_bytes,
                                [a for a in reversed(axes) if src[a] != mid[a]])
        second = _steps_in_order(shape, mid, dst, mesh_shape, links, elem_bytes,
                                 [a for a in axes if mid[a] != dst[a]])
        assert first is not None and second is not None, (src, dst)
        best = (tuple(first[0]) + tuple(second[0]), first[1] + second[1])
    return best if best is not None else ((), 0.0)


# -- one all-to-all over two axes -----------------------------------------------------------------

def _joint_pairs(src, dst, changing) -> list[tuple[int, int]]:
    """The pairs of axes that both turn the same ``S(i)`` into the same ``S(j)``."""
    return [(a, b) for a, b in itertools.combinations(changing, 2)
            if isinstance(src[a], Split) and isinstance(dst[a], Split) and src[a] != dst[a]
            and src[a] == src[b] and dst[a] == dst[b]]


def _best_joint(shape, src, dst, mesh_shape, links, elem_bytes, changing):
    """The cheapest route where one pair of axes changes by a joint all-to-all and every other
    changing axis by its own step, in the best valid order; None when there is none."""
    best = None
    for pair in _joint_pairs(src, dst, changing):
        units = [pair] + [a for a in changing if a not in pair]
        for order in itertools.permutations(units):
            found = _steps_in_order(shape, src, dst, mesh_shape, links, elem_bytes, order)
            if found is not None and (best is None or found[1] < best[1]):
                best = (tuple(found[0]), found[1])
    return best


def joint_step(shape, cur, dst, axes: tuple[int, int], mesh_shape, links, elem_bytes) -> Step | None:
    """``S(i) -> S(j)`` on both ``axes`` as one all-to-all over their combined group; None when
    it would not be exact.

    The group's rank ``c_a * n_b + c_b`` holds block ``c_a * n_b + c_b`` of dim i (the nested
    splits' order) and must end with that block of dim j, which is an all-to-all over the group in
    that numbering, provided no other axis splits dim i or j inside ``a`` (after it in mesh order:
    its pieces would interleave) and both dims cut evenly (nested splits of an uneven dim are not
    the flat split's pieces)."""
    a, b = axes
    i, j = cur[a].dim, dst[a].dim
    n = mesh_shape[a] * mesh_shape[b]
    others = [c for c in range(len(cur)) if c not in axes]
    if any(_splits_dim(cur[c], d) for c in others if c > a for d in (i, j)):
        return None
    for d in (i, j):
        outer = math.prod(mesh_shape[c] for c in others if _splits_dim(cur[c], d))
        if shape[d] % (outer * n):
            return None
    block = list(shape)
    for c in others:  # the largest block (coordinates 0), as ``step_bytes``
        if isinstance(cur[c], Split):
            block[cur[c].dim] = -(-block[cur[c].dim] // mesh_shape[c])
    nbytes = math.prod(block) * elem_bytes
    return Step("all_to_all", a, nbytes, joint_time(nbytes, (mesh_shape[a], mesh_shape[b]), (links[a], links[b])),
                axes=tuple(axes))


def joint_time(nbytes: float, sizes: Sequence[int], links: Sequence[Link]) -> float:
    """An all-to-all of ``nbytes`` (the buffer as the group sees it) over the combined group of
    two axes of ``sizes`` devices with ``links``.

    Each rank sends ``(n-1)/n`` of its block, one piece per peer. A piece to a peer that differs
    on the slower axis crosses that axis's link (``(n_s - 1)/n_s`` of the block); the rest, to
    peers that differ on the faster axis only, cross the faster one (``(n_f - 1)/(n_f n_s)``). On
    equal links this is one axis's formula for ``n_a n_b`` devices. The group's ``n`` latencies
    are the slower start-up's, the factor for the kind the slower link's."""
    n = math.prod(sizes)
    s, f = sorted(range(2), key=lambda k: (links[k].bandwidth, k))
    block = nbytes / n
    ns, nf = sizes[s], sizes[f]
    time = (n * max(link.latency for link in links) + (ns - 1) / ns * block / links[s].bandwidth
            + (nf - 1) / (nf * ns) * block / links[f].bandwidth)
    return time * links[s].factor("all_to_all")


def _key(shape, src, dst, mesh: "Mesh", elem_bytes):
    src, dst = tuple(src), tuple(dst)
    if len(src) != mesh.ndim or len(dst) != mesh.ndim:
        raise ValueError(f"placements {src} -> {dst} do not have one entry per axis of {mesh!r}")
    return tuple(shape), src, dst, mesh.shape, mesh.links, int(elem_bytes)


def reshard_steps(
    shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement], mesh: "Mesh", elem_bytes: int
) -> list[Step]:
    """The cheapest order of one-axis steps from ``src`` to ``dst`` (ties: the lexicographically
    first order of axes). Each step's ``bytes`` is the local block of the tensor under the placements
    at that moment with the changing axis taken as ``B`` (the largest block, coordinates 0). The
    balanced split ``Z`` has its own steps (``cost_model.balanced``)."""
    if _balanced(src, dst):
        return list(_balanced_steps()(shape, src, dst, mesh, elem_bytes)[0])
    return list(_best_steps(*_key(shape, src, dst, mesh, elem_bytes))[0])


def reshard_time(
    shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement], mesh: "Mesh", elem_bytes: int
) -> float:
    """Seconds to reshard (the sum of ``reshard_steps``' times); memoized."""
    if tuple(src) == tuple(dst):
        return 0.0
    if _balanced(src, dst):
        return _balanced_steps()(shape, src, dst, mesh, elem_bytes)[1]
    return _best_steps(*_key(shape, src, dst, mesh, elem_bytes))[1]


#: ``cost_model.balanced``'s steps and memo, which it registers here on import (it builds on this module)
BALANCED: dict = {}


def _balanced_steps():
    if "steps" not in BALANCED:
        raise ValueError("a resharding with the balanced split Z is priced by autopar.cost_model.balanced: import it")
    return BALANCED["steps"]


def _balanced(src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
    """Whether either side has the balanced split ``Z`` (``ir.placement.Balanced``)."""
    for side in (src, dst):  # (loops, not generators: asked for every resharding the search prices)
        for p in side:
            if type(p) is Balanced:
                return True
    return False


def cache_info():
    """The memo's hit/miss counts (``functools.lru_cache`` statistics)."""
    return _best_steps.cache_info()


def cache_clear() -> None:
    """Forget the memoised resharding costs (after the hardware figures change)."""
    _best_steps.cache_clear()
    if "memo" in BALANCED:
        BALANCED["memo"].clear()


__all__ = ["KINDS", "Step", "axis_step", "joint_step", "joint_time", "step_axes", "step_bytes", "step_valid", "cache_clear", "cache_info", "collective_time", "reshard_steps", "reshard_time",
           "ring_time"]
