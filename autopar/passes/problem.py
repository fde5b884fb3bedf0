"""The planning problem as flat data, and the one evaluator that prices any choice of strategies.

A ``Problem`` is what the cost pass hands to merge and solve: per node its candidate strategies
and, per strategy, compute time, communication at graph sinks and memory; per edge (a tensor from
a producer's output to a consumer's input) a resharding cost matrix over the distinct placements
the two sides may take. Nodes and edges of folded layers appear once, with their multiplicity.

``evaluate`` prices a choice (one strategy per node):

    step    = compute + activation communication + sum over groups of exposed(g)
    exposed(g) = mult(g) * max(0, param_comm(g) - compute(g))

where ``param_comm(g)`` is one instance of group g's parameter gathers and gradient reductions,
which run under the same instance's compute in the same phase (gathers issued a layer ahead
hide under forward compute, reductions under the backward as buckets fill). The
ILP's objective is this function, linearised; recipes and searched plans are priced by it alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from autopar.ir.graph import Ref
from autopar.ir.placement import Placements
from autopar.ir.rules.dimmap import Strategy

MEMORY_KINDS = ("params", "grads", "optimizer", "activations")


@dataclass
class PNode:
    """One node of the problem (a graph node, standing for every instance of a folded layer)."""

    name: str
    strategies: list[Strategy]
    mult: int
    group: int
    compute: list[float]  # seconds per instance, per strategy
    comm: list[float]  # seconds per instance, per strategy (resharding at graph outputs: the loss)
    memory: dict[str, list[float]]  # bytes per instance, per strategy, by kind
    allowed: Optional[list[int]] = None  # strategy indices the hints allow (None: all)

    def mem_total(self, s: int) -> float:
        return sum(v[s] for v in self.memory.values())


@dataclass
class PEdge:
    """A tensor from ``src``'s output to ``dst``'s input (``dst_slot`` -1: the parameter itself,
    for a gradient that must end up placed like its parameter)."""

    src: int
    src_out: int
    dst: int
    dst_slot: int
    src_place: list[int]  # per src strategy: row of ``cost``
    dst_place: list[int]  # per dst strategy: column of ``cost``
    places_out: list[Placements]
    places_in: list[Placements]
    cost: list[list[float]]  # seconds per instance
    mult: int
    kind: str  # "activation" | "param" (a gather before use) | "grad" (a gradient reduction)
    group: int
    ref: Ref
    elem_bytes: int

    def overlappable(self) -> bool:
        return self.kind in ("param", "grad")


@dataclass
class Group:
    """An overlap group: one phase (forward or backward) of one layer instance (``mult`` of
    them), or of everything outside layers."""

    name: str
    mult: int


@dataclass
class Problem:
    nodes: list[PNode]
    edges: list[PEdge]
    groups: list[Group]
    memory_budget: float
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {n.name: i for i, n in enumerate(self.nodes)}


@dataclass
class Cost:
    """A choice's estimated step: times in seconds, memory in bytes per device."""

    step_time: float
    compute_time: float
    comm_time: float
    exposed_param_comm: float
    memory: dict[str, float]

    @property
    def peak_memory(self) -> float:
        return sum(self.memory.values())


def edge_cost(e: PEdge, choice: Sequence[int]) -> float:
    return e.cost[e.src_place[choice[e.src]]][e.dst_place[choice[e.dst]]]


def incident_edges(problem: Problem) -> dict[int, list[PEdge]]:
    """Node index -> the edges that start or end there."""
    out: dict[int, list[PEdge]] = {}
    for e in problem.edges:
        out.setdefault(e.src, []).append(e)
        out.setdefault(e.dst, []).append(e)
    return out


def local_cost(problem: Problem, incident: dict[int, list[PEdge]], choice: Sequence[int], i: int, s: int) -> float:
    """Node ``i`` running strategy ``s`` with its neighbours held at ``choice``: its compute, sink
    communication and the resharding on its edges (edges to neighbours not chosen yet, -1, are
    skipped; overlappable edges count in full)."""
    n = problem.nodes[i]
    c = n.mult * (n.compute[s] + n.comm[s])
    for e in incident.get(i, []):
        other = e.dst if e.src == i else e.src
        if choice[other] < 0:
            continue
        p = e.src_place[s if e.src == i else choice[e.src]]
        q = e.dst_place[s if e.dst == i else choice[e.dst]]
        c += e.mult * e.cost[p][q]
    return c


def evaluate(problem: Problem, choice: Sequence[int]) -> Cost:
    """The estimated step time and memory of one strategy per node."""
    compute = comm = 0.0
    memory = {k: 0.0 for k in MEMORY_KINDS}
    group_compute = [0.0] * len(problem.groups)
    group_comm = [0.0] * len(problem.groups)
    for i, n in enumerate(problem.nodes):
        s = choice[i]
        compute += n.mult * n.compute[s]
        comm += n.mult * n.comm[s]
        group_compute[n.group] += n.compute[s]
        for k in MEMORY_KINDS:
            memory[k] += n.mult * n.memory[k][s]
    for e in problem.edges:
        c = edge_cost(e, choice)
        if e.overlappable():
            group_comm[e.group] += c * e.mult / problem.groups[e.group].mult
        else:
            comm += c * e.mult
    exposed = sum(g.mult * max(0.0, group_comm[k] - group_compute[k]) for k, g in enumerate(problem.groups))
    return Cost(compute + comm + exposed, compute, comm + exposed, exposed, memory)
