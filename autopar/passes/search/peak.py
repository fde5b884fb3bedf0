"""The walked peak of a chosen plan (``cost_model.liveness``), as the search's ``Cost`` reports it.

``evaluate`` prices memory as a sum over nodes (what the ILP can constrain): parameter state and
saved activations. The step's real peak also holds what lives between ops (logits-sized buffers of
the loss, gathered weights in flight, collective and bucket buffers, unreduced gradients) and, after
the backward, the optimizer's scratch. ``walked`` prices one choice by walking its program; every
place that decides whether a plan fits, and every memory figure a plan reports, uses it.

The ILP keeps the linear form: ``solve_fitting`` solves, walks the result, and while the walked
plan does not fit solves again, first with each op's transient bytes (its unsaved outputs and
reads at its strategy, ``PNode.transient``) beside the persistent memory, so a temporary that alone
breaks the budget is split rather than the persistent state squeezed, then with the budget lowered
by the excess the walk found.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

from autopar.cost_model.liveness import PEAK_KINDS, Peak, step_peak
from autopar.cost_model.mesh import Mesh
from autopar.cost_model.precision import Precision
from autopar.ir.graph import Graph
from autopar.ir.recompute import recomputed_ops
from autopar.passes.search.checkpoint import Choice, checkpointed_paths
from autopar.passes.search.fold import Folding
from autopar.passes.search.kept import kept_reads
from autopar.passes.search.problem import Cost, Problem, evaluate, largest_transient


def strategy_lookup(problem: Problem, folding: Folding, choice: Sequence[int]):
    """Graph node name -> its chosen strategy (a folded instance runs its representative's)."""
    index, nodes = problem.index, problem.nodes
    cache: dict[str, tuple] = {}

    def strategy_of(name: str):
        got = cache.get(name)
        if got is None:
            i = index[folding.representative(name)]
            got = cache[name] = nodes[i].strategies[choice[i]]
        return got

    return strategy_of


def choice_peak(graph: Graph, mesh: Mesh, precision: Precision, folding: Folding, problem: Problem,
                choice: Sequence[int], checkpointing: Optional[dict] = None, kept: Sequence[str] = (),
                grad_stages=None) -> Peak:
    """The walked peak of ``choice`` (one strategy per problem node) with the layer instances of
    ``checkpointing`` (path -> mode) recomputed and those of ``kept`` keeping their gathers (folded
    instances run their representative's strategy: a repeated stack is walked once)."""
    strategy_of = strategy_lookup(problem, folding, choice)
    redo = recomputed_ops(graph, checkpointing) if checkpointing else frozenset()
    served = {k: (d.source, d.placed) for k, d in kept_reads(graph, strategy_of, kept, mesh, redo).items()} \
        if kept else {}
    return step_peak(graph, strategy_of, mesh, precision, recomputed=redo, served=served, grad_stages=grad_stages,
                     alike=folding)


def with_peak(cost: Cost, peak: Peak) -> Cost:
    """``cost`` with its memory the walked peak's parts (``Cost.peak_memory`` is then the peak)."""
    return replace(cost, memory={k: float(peak.parts.get(k, 0)) for k in PEAK_KINDS})


def walked(graph: Graph, mesh: Mesh, precision: Precision, folding: Folding, problem: Problem,
           choice: Sequence[int], checkpointing: Optional[dict] = None, kept: Sequence[str] = ()) -> Cost:
    """``evaluate``'s step time with the walked peak's memory."""
    return with_peak(evaluate(problem, choice),
                     choice_peak(graph, mesh, precision, folding, problem, choice, checkpointing, kept))


def peak_place(graph: Graph, peak: Optional[Peak]) -> str:
    """Where in the step ``peak`` is, in the user's terms: the phase, the module and the op."""
    if peak is None:
        return ""
    if not peak.at:
        return "backward, reducing the gradients after its ops" if peak.phase == "backward" else peak.phase
    node = graph.node(peak.at)
    return f"{peak.phase}, at {node.module_path or 'the model'} ({node.op.replace('aten.', '')})"


def solve_fitting(solve, peak_of, problem: Problem, budget: float, tries: int = 4):
    """``solve(lower, transients, start)`` (the ILP with its memory budget lowered by ``lower`` bytes,
    with ``transients`` the largest op's transient bytes added to its memory row,
    ``Problem.transients``, started from the last plan, which was over: ``(solution, choice)``,
    choice None when none is found) until the walked
    peak of its choice (``peak_of``) fits ``budget``. The first solve over it turns the transients
    on (a temporary the linear memory does not see may alone break the budget: lowering the budget
    would only squeeze the persistent state), then each lowers the budget by what the walk found
    over the linear memory, or over the budget, whichever is more. Where the solve with transients
    finds nothing, the budget is lowered without them. Returns the last ``(solution, choice)``."""
    solution, choice = solve(0.0, False)
    lower, seen, tried = 0.0, False, False
    for _ in range(tries):
        if choice is None:
            break
        need = peak_of(choice)
        if need <= budget:
            break
        linear = evaluate(problem, choice).peak_memory
        top = largest_transient(problem, choice) if seen or not tried else 0.0
        if not tried and top > 0:
            tried = True
            found = solve(max(0.0, need - linear - top), True, choice)
            if found[1] is not None:
                (solution, choice), seen, lower = found, True, max(0.0, need - linear - top)
                continue
            top = 0.0
        lower = max(lower + need - budget, need - linear - top)
        solution, choice = solve(lower, seen, choice)
    return solution, choice


class Walker:
    """Each choice's cost with its peak walked op by op (``passes.search.peak.walked``), once per
    (problem, choice, recomputation, kept gathers): a recipe is a baseline and a candidate. ``terms``
    (the layer groups' recomputation) is set before anything recomputes."""

    def __init__(self, graph: Graph, mesh: Mesh, prec: Precision, folding: Folding):
        self.graph, self.mesh, self.prec, self.folding = graph, mesh, prec, folding
        self.terms: list = []  # the layer groups' ``checkpoint.GroupTerms``
        self._walks: dict[tuple, tuple[Problem, Cost]] = {}  # (the problem held: its id stays its own)
        self._peaks: dict[tuple, tuple[Problem, Peak]] = {}

    def __call__(self, prob: Problem, choice: list[int], rc: Optional[Choice] = None,
                 keep_paths: Sequence[str] = ()) -> Cost:
        key = (id(prob), tuple(choice), rc if rc is not None and rc.any else None, tuple(keep_paths))
        if key not in self._walks:
            self._walks[key] = (prob, with_peak(evaluate(prob, choice), self.peak(prob, choice, rc, keep_paths)))
        return self._walks[key][1]

    def peak(self, prob: Problem, choice: list[int], rc: Optional[Choice] = None,
             keep_paths: Sequence[str] = ()) -> Peak:
        """The walked peak behind ``self(prob, choice, rc, keep_paths)``, walked once (the chosen plan's
        final figures reuse its candidate's walk)."""
        key = (id(prob), tuple(choice), rc if rc is not None and rc.any else None, tuple(keep_paths))
        if key not in self._peaks:
            paths = checkpointed_paths(self.terms, rc) if rc is not None and rc.any else None
            self._peaks[key] = (prob, choice_peak(self.graph, self.mesh, self.prec, self.folding, prob, choice, paths,
                                                  keep_paths))
        return self._peaks[key][1]


__all__ = ["Walker", "choice_peak", "peak_place", "solve_fitting", "strategy_lookup", "walked", "with_peak"]
