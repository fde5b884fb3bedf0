"""The planning problem as flat data, and the one evaluator that prices any choice of strategies.

A ``Problem`` is what the cost pass hands to merge and solve: per node its candidate strategies
and, per strategy, compute time, communication at graph sinks and memory; per edge (a tensor from
a producer's output to a consumer's input) a resharding cost matrix over the distinct placements
the two sides may take. Nodes and edges of folded layers appear once, with their multiplicity.

Edges are grouped into *transfers* (``PEdge.share``; ``Problem.transfers``): the consumers of one
tensor. A tensor is resharded once per target placement, and every consumer that needs that
placement shares the result (the collective is not repeated per consumer), so a transfer costs

    transfer(t) = mult(t) * sum over distinct target placements q its consumers take of cost(p -> q)

with p the producer's placement (``build.py`` says what one transfer spans: which producer
instances, which phases). ``evaluate`` prices a choice (one strategy per node):

    step    = compute + activation communication + sum over groups of (exposed(g) + contention(g))
    exposed(g)    = mult(g) * max(0, param_comm(g) - compute(g))
    contention(g) = mult(g) * s * min(param_comm(g), compute(g))

where activation communication is the sum of the non-overlappable transfers, and
``param_comm(g)`` is one instance of group g's parameter gathers and gradient reductions (the
overlappable transfers; each transfer belongs to one group, its edges' ``group``), which run under
the same instance's compute in the same phase (gathers issued a layer ahead hide under forward
compute, reductions under the backward as buckets fill). The ILP's objective is this function,
linearised; recipes and searched plans are priced by it alike.

``contention`` is the compute that hidden communication slows: a collective running beside the
compute kernels takes SMs and memory bandwidth from them, so compute under it loses the fraction
``s`` of its throughput (``Problem.overlap_slowdown``, the hardware's ``overlap_slowdown``). While
``h`` seconds of collectives run under ``C`` seconds of compute (``h = min(param_comm, compute)``),
the compute gets ``h (1 - s)`` seconds of work done in those ``h`` seconds and needs ``s h`` more to
finish: exact when the traffic fits under the compute (``param_comm <= (1 - s) compute``); where
the traffic exceeds the compute it charges ``s compute`` beyond the traffic, as if the collective
were slowed alike (both share the SMs and HBM), an upper bound. Linear in ``param_comm`` and
``exposed``: ``exposed + contention = (1 - s) exposed + s param_comm`` (``solve._exposed``).
"""

from __future__ import annotations

from collections import defaultdict
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
    #: bytes per strategy alive only while the op runs: its outputs nothing saves for the backward
    #: and the unsaved values it reads, at their placements (``build``; None: none)
    transient: Optional[list[float]] = None
    #: bytes per strategy of a parameter's gradient made as a partial sum, alive unreduced until the
    #: backward's end (its reduction comes after the backward's ops; ``build``); counted as "grads"
    #: by ``evaluate`` and the solver's memory row (None: none)
    pending: Optional[list[float]] = None
    #: whether its transient is held before the layers' backward begins (a forward op nothing
    #: re-runs, or a backward op ahead of every layer's: the loss), when no layer has made a
    #: gradient yet (``build``; ``largest_transient``)
    head: bool = False
    #: bytes per strategy of its memory that no op before the layers' backward holds: a layer
    #: parameter's gradient and a layer op's pending one (None: none)
    deferred: Optional[list[float]] = None

    def mem_total(self, s: int) -> float:
        """Bytes per instance of strategy ``s``, all memory kinds together (and ``pending``)."""
        return sum(v[s] for v in self.memory.values()) + (self.pending[s] if self.pending else 0.0)

    def alive(self) -> list[int]:
        """The strategy indices still allowed (by hints or a recipe's restriction): all by default."""
        return list(self.allowed) if self.allowed is not None else list(range(len(self.strategies)))


@dataclass
class PEdge:
    """A tensor from ``src``'s output to ``dst``'s input (``dst_slot`` -1: the parameter itself,
    for a gradient that must end up placed like its parameter).

    ``share`` names the edge's transfer: edges with one ``share`` carry the same tensor (same
    ``src``, ``src_out``, ``kind``, ``mult`` and ``group``), and a resharding to a placement is
    paid once however many of them need it. ``mult`` is how many times one such resharding
    happens in a step (the producer instances the transfer covers)."""

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
    share: int = -1  # transfer id; -1: a transfer of its own
    #: per (row, column) of ``cost``: bytes per instance of the resharded copy the forward keeps for
    #: the backward (a forward value the backward reads; ``build``), paid once per target like the
    #: resharding (None: nothing kept)
    saved: Optional[list[list[float]]] = field(default=None, compare=False, repr=False)
    #: per column of ``cost``: its placement's index among the transfer's targets (set by ``Problem``)
    targets: Optional[list[int]] = field(default=None, compare=False, repr=False)

    def overlappable(self) -> bool:
        """Whether this edge's communication may run under compute (a parameter gather or a gradient reduction of a group)."""
        return self.kind in ("param", "grad")


@dataclass
class Group:
    """An overlap group: one phase (forward or backward) of one layer instance (``mult`` of
    them), or of everything outside layers."""

    name: str
    mult: int


@dataclass
class Problem:
    """The search's input: priced nodes (one per graph node, or per folded layer position), the
    edges between them with a cost per pair of placements, the groups whose parameter traffic may
    hide under their compute, and the memory budget. ``evaluate`` prices any choice of one strategy
    per node; every search pass (merge, complete, solve, solve_axis, propagate) reads it."""

    nodes: list[PNode]
    edges: list[PEdge]
    groups: list[Group]
    memory_budget: float
    #: fraction of compute throughput lost while a hidden collective runs beside it (``Hardware.overlap_slowdown``)
    overlap_slowdown: float = 0.0
    #: whether the solver's memory row adds the largest ``PNode.transient`` of the choice to the
    #: persistent memory (``solve._memory``; ``passes.search.peak.solve_fitting`` turns it on)
    transients: bool = False
    index: dict[str, int] = field(default_factory=dict)
    #: edge indices per transfer (edges of one ``share``, in edge order), in order of first edge
    transfers: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.transfers = transfers_of(self.edges)
        for ks in self.transfers:
            ids: dict[Placements, int] = {}
            for k in ks:
                e = self.edges[k]
                e.targets = [ids.setdefault(q, len(ids)) for q in e.places_in]


def transfers_of(edges: Sequence[PEdge]) -> list[list[int]]:
    """Edge indices grouped by ``share`` (an edge with share -1 alone)."""
    out: list[list[int]] = []
    at: dict[int, int] = {}
    for k, e in enumerate(edges):
        if e.share < 0:
            out.append([k])
        elif e.share in at:
            out[at[e.share]].append(k)
        else:
            at[e.share] = len(out)
            out.append([k])
    return out


@dataclass
class Cost:
    """A choice's estimated step: times in seconds, memory in bytes per device."""

    step_time: float
    compute_time: float
    comm_time: float
    exposed_param_comm: float
    memory: dict[str, float]
    #: seconds of compute slowed by the hidden collectives beside it (in ``comm_time``: what
    #: communication costs the step beyond the kernels' own time; ``problem.overlap_terms``)
    contention: float = 0.0

    @property
    def peak_memory(self) -> float:
        """Bytes per device, all memory kinds together."""
        return sum(self.memory.values())


def edge_cost(e: PEdge, choice: Sequence[int]) -> float:
    """One resharding along ``e`` alone (seconds, one instance)."""
    return e.cost[e.src_place[choice[e.src]]][e.dst_place[choice[e.dst]]]


def transfer_cost(edges: Sequence[PEdge], choice: Sequence[int], i: int = -1, s: int = -1) -> float:
    """One instance of a transfer: each distinct target placement its consumers take, once.
    With ``i >= 0``, node ``i`` runs strategy ``s`` instead of ``choice[i]``; edges to nodes not
    chosen yet (-1) are skipped."""
    if len(edges) == 1:
        e = edges[0]
        a = s if e.src == i else choice[e.src]
        b = s if e.dst == i else choice[e.dst]
        return 0.0 if a < 0 or b < 0 else e.cost[e.src_place[a]][e.dst_place[b]]
    paid: dict[int, float] = {}
    for e in edges:
        a = s if e.src == i else choice[e.src]
        b = s if e.dst == i else choice[e.dst]
        if a < 0 or b < 0:
            continue
        q = e.dst_place[b]
        c = e.cost[e.src_place[a]][q]
        if c and c > paid.get(e.targets[q], 0.0):
            paid[e.targets[q]] = c
    return sum(paid.values())


def incident_transfers(problem: Problem) -> dict[int, list[list[PEdge]]]:
    """Node index -> the transfers (lists of edges) that have an edge starting or ending there."""
    out: dict[int, list[list[PEdge]]] = {}
    for ks in problem.transfers:
        edges = [problem.edges[k] for k in ks]
        for i in sorted({e.src for e in edges} | {e.dst for e in edges}):
            out.setdefault(i, []).append(edges)
    return out


def local_cost(problem: Problem, incident: dict[int, list[list[PEdge]]], choice: Sequence[int], i: int, s: int) -> float:
    """Node ``i`` running strategy ``s`` with the other nodes held at ``choice``: its compute, sink
    communication and every transfer it touches, priced as ``evaluate`` prices it (edges to
    nodes not chosen yet, -1, are skipped; overlappable transfers count in full). Differences
    between two strategies of ``i`` are the change of ``evaluate``'s compute and activation
    communication exactly (overlap hiding aside)."""
    n = problem.nodes[i]
    c = n.mult * (n.compute[s] + n.comm[s])
    for edges in incident.get(i, ()):
        c += edges[0].mult * transfer_cost(edges, choice, i, s)
    return c


def saved_copies(edges: Sequence[PEdge], choice: Sequence[int]) -> float:
    """Bytes per instance of the resharded copies one transfer keeps for the backward: each
    distinct target placement its consumers take, once (as ``transfer_cost`` pays them)."""
    kept: dict[int, float] = {}
    for e in edges:
        if e.saved is None:
            continue
        p, q = e.src_place[choice[e.src]], e.dst_place[choice[e.dst]]
        b = e.saved[p][q]
        if b and e.cost[p][q]:
            t = q if e.targets is None else e.targets[q]
            kept[t] = max(kept.get(t, 0.0), b)
    return sum(kept.values())


def largest_transient(problem: Problem, choice: Sequence[int]) -> float:
    """What the memory row adds to ``choice``'s persistent memory for the op that holds the most
    beside it (``PNode.transient``): the largest transient of the ops from the layers' backward on,
    or that of the ops before it (``PNode.head``: the forward, the loss) less the layers' gradients,
    which are not made yet then (``PNode.deferred``), whichever is more. Both are upper bounds of
    what is alive while such an op runs; adding the loss's logits-sized temporaries to every
    layer's unreduced gradient would count two moments of the step as one."""
    late = head = 0.0
    for i, n in enumerate(problem.nodes):
        if n.transient:
            t = n.transient[choice[i]]
            if n.head:
                head = max(head, t)
            else:
                late = max(late, t)
    if head > late:
        head -= sum(n.mult * n.deferred[choice[i]] for i, n in enumerate(problem.nodes) if n.deferred)
    return max(late, head)


def least_transient(problem: Problem) -> float:
    """A lower bound of ``largest_transient`` over every choice allowed: per class (``PNode.head``)
    the largest of the nodes' least transients, the head's less the most its gradients can defer."""
    late = max((min(n.transient[s] for s in n.alive()) for n in problem.nodes if n.transient and not n.head),
               default=0.0)
    head = max((min(n.transient[s] for s in n.alive()) for n in problem.nodes if n.transient and n.head),
               default=0.0)
    deferred = sum(n.mult * max(n.deferred[s] for s in n.alive()) for n in problem.nodes if n.deferred)
    return max(late, head - deferred)


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
        if n.pending:
            memory["grads"] += n.mult * n.pending[s]
    edges = problem.edges
    for ks in problem.transfers:
        e = edges[ks[0]]
        c = edge_cost(e, choice) if len(ks) == 1 else transfer_cost([edges[k] for k in ks], choice)
        if e.saved is not None:
            memory["activations"] += e.mult * saved_copies([edges[k] for k in ks], choice)
        if e.overlappable():
            group_comm[e.group] += c * e.mult / problem.groups[e.group].mult
        else:
            comm += c * e.mult
    exposed, contention = overlap_terms(problem, group_comm, group_compute)
    return Cost(compute + comm + exposed + contention, compute, comm + exposed + contention, exposed, memory, contention)


def overlap_terms(problem: Problem, group_comm: Sequence[float], group_compute: Sequence[float]) -> tuple[float, float]:
    """``(exposed, contention)`` over every group: the parameter traffic its compute cannot hide,
    and the compute slowed by the traffic it does hide (``s * min(traffic, compute)`` per
    instance; see the module docstring), each times the group's multiplicity."""
    s = problem.overlap_slowdown
    exposed = contention = 0.0
    for k, g in enumerate(problem.groups):
        t, c = group_comm[k], group_compute[k]
        exposed += g.mult * max(0.0, t - c)
        if s:
            contention += g.mult * s * min(t, c)
    return exposed, contention


class Repricer:
    """``evaluate``'s step time of the chosen strategies with one node's strategy changed, from the
    chosen plan's own sums: only that node's terms and the transfers it touches are priced again.
    The plan's report prices each module's alternatives with it: a full ``evaluate`` per
    alternative made the report quadratic in the graph (28 of 42 s of planning a 2+2-layer T5,
    whose layers do not fold)."""

    def __init__(self, prob: Problem, choice: Sequence[int]) -> None:
        self.prob, self.choice = prob, list(choice)
        self.compute = self.comm = 0.0
        self.group_compute = [0.0] * len(prob.groups)
        self.group_comm = [0.0] * len(prob.groups)
        for i, n in enumerate(prob.nodes):
            self.compute += n.mult * n.compute[choice[i]]
            self.comm += n.mult * n.comm[choice[i]]
            self.group_compute[n.group] += n.compute[choice[i]]
        self.edges: list[list] = []
        self.paid: list[float] = []
        self.touching: dict[int, list[int]] = defaultdict(list)
        for t, ks in enumerate(prob.transfers):
            edges = [prob.edges[k] for k in ks]
            c = edge_cost(edges[0], choice) if len(ks) == 1 else transfer_cost(edges, choice)
            self.edges.append(edges)
            self.paid.append(c)
            self._add(edges[0], c)
            for node in sorted({e.src for e in edges} | {e.dst for e in edges}):
                self.touching[node].append(t)

    def _add(self, e, c: float) -> None:
        if e.overlappable():
            self.group_comm[e.group] += c * e.mult / self.prob.groups[e.group].mult
        else:
            self.comm += c * e.mult

    def _times(self) -> tuple[float, float, float]:
        exposed, contention = overlap_terms(self.prob, self.group_comm, self.group_compute)
        return self.compute + self.comm + exposed + contention, self.compute, self.comm + exposed + contention

    def with_strategy(self, i: int, s: int) -> tuple[float, float, float]:
        """``(step time, compute time, communication time)`` with node ``i`` running ``s``."""
        n, old = self.prob.nodes[i], self.choice[i]
        saved = (self.compute, self.comm, list(self.group_compute), list(self.group_comm))
        self.compute += n.mult * (n.compute[s] - n.compute[old])
        self.comm += n.mult * (n.comm[s] - n.comm[old])
        self.group_compute[n.group] += n.compute[s] - n.compute[old]
        for t in self.touching.get(i, ()):
            edges = self.edges[t]
            self._add(edges[0], transfer_cost(edges, self.choice, i, s) - self.paid[t])
        out = self._times()
        self.compute, self.comm, self.group_compute, self.group_comm = saved
        return out
