"""Prove sharding rules by execution on a captured graph.

Runs the captured program once on real tensors to get every op's real input values (so indices,
masks and targets are valid), then, for every op and every strategy its rule enumerates on a mesh,
runs the rule's local implementation on each device's blocks in the simulator and compares the
reassembled result with the op on whole tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch

from autopar.ir.graph import Graph, Role
from autopar.ir.rules import has_rule, op_call, strategies
from autopar.ir.rules.base import OpCall
from autopar.ir.rules.proof.interp import CheckResult, check_strategy, reference


def record_values(graph: Graph, model: torch.nn.Module, args: Sequence[Any], kwargs: Optional[dict] = None) -> dict[str, list]:
    """Every node's output values when the captured program runs on ``model``'s real tensors."""
    assert graph.gm is not None
    kwargs = kwargs or {}
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    by_placeholder: dict[str, Any] = {}
    for fqn, name in list(graph.params.items()) + list(graph.buffers.items()):
        by_placeholder[name] = state[fqn].detach()
    for key, name in graph.inputs.items():
        by_placeholder[name] = args[int(key.split(":")[1])] if key.startswith("input:") else kwargs[key]
    for n in graph.nodes:
        if n.is_placeholder and n.roles[0] == Role.TANGENT:
            by_placeholder[n.name] = torch.ones(n.out.shape, dtype=n.out.dtype)
    values: dict[str, list] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            res = super().run_node(node)
            if node.op != "output":
                values[node.name] = list(res) if isinstance(res, (tuple, list)) else [res]
            return res

    placeholders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        Recorder(graph.gm).run(*[by_placeholder[p] for p in placeholders])
    return values


@dataclass
class Case:
    """One op instance with its real input values."""

    call: OpCall
    inputs: list[torch.Tensor]
    expected: list
    node: str


def cases(graph: Graph, values: dict[str, list]) -> list[Case]:
    """Every op of ``graph`` that has a rule, with its recorded inputs (getitem folded)."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for node in graph.ops():
        if not has_rule(node.op):
            continue
        call = op_call(graph, node)
        ins = [_perturb(values[r.node][r.index], gen) for r in node.inputs]
        expected = reference(call, ins)
        out.append(Case(call, ins, expected, node.name))
    return out


def _perturb(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Real values, jittered so that no float input is special (a zero bias hides a missing P).

    Signs are kept (log, rsqrt stay defined); all-zero tensors get small random values.
    """
    if not t.is_floating_point():
        return t
    if not t.any():
        return torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.1
    return t * (1 + 0.05 * (2 * torch.rand(t.shape, generator=gen, dtype=t.dtype) - 1))


def _key(case: Case) -> tuple:
    from torch.fx.node import map_aggregate

    from autopar.ir.graph import Ref

    def strip(a):
        return "<T>" if isinstance(a, Ref) else a

    call = case.call
    shapes = tuple((s.shape, s.dtype) for s in call.in_specs)
    return (call.op, shapes, repr(map_aggregate(call.args, strip)), repr(map_aggregate(call.kwargs, strip)))


def dedupe(items: Iterable[Case]) -> list[Case]:
    """One case per distinct (op, shapes, arguments)."""
    seen, out = set(), []
    for c in items:
        k = _key(c)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


@dataclass
class Report:
    """The outcome of proving rules: cases checked, and every strategy whose reassembled result
    differed from the op on whole tensors."""

    checked: int = 0
    ops: set = field(default_factory=set)
    pairs: set = field(default_factory=set)  # distinct (op, signature text)
    failures: list = field(default_factory=list)

    def add(self, case: Case, strategy, res: CheckResult) -> None:
        """Record one checked strategy's result."""
        self.checked += 1
        self.ops.add(case.call.op)
        self.pairs.add((case.call.op, " | ".join(str(s) for s in strategy)))
        if not res.ok:
            text = " | ".join(str(s) for s in strategy)
            self.failures.append(f"{case.call.op} [{case.node}] {text}: {res.error}")


def verify(case_list: Sequence[Case], mesh_shape: Sequence[int], report: Optional[Report] = None) -> Report:
    """Check every strategy of every case on ``mesh_shape``."""
    report = report or Report()
    for case in case_list:
        for strat in strategies(case.call, mesh_shape):
            res = check_strategy(case.call, strat, mesh_shape, case.inputs, case.expected)
            report.add(case, strat, res)
    return report


# ---------------------------------------------------------------------------------------------
# Mutation testing of the proof itself: single mutations of real signatures must be caught.


def mutants(sig) -> list:
    """Single mutations of a one-axis signature: a ``P`` turned into ``B``, a split moved to another dim."""
    from autopar.ir.placement import B, Partial, Split
    from autopar.ir.rules.dimmap import Signature

    out = []
    slots = [("in", i, p) for i, p in enumerate(sig.inputs)] + [("out", j, p) for j, p in enumerate(sig.outputs)]
    for side, k, p in slots:
        repl = []
        # B is itself a valid P(max)/P(min) input (the reduction is idempotent), so only P(sum) -> B.
        if isinstance(p, Partial) and (p.reduce == "sum" or side == "out"):
            repl.append(B)
        if isinstance(p, Split):
            repl.extend(Split(d) for d in range(8) if d != p.dim)
        for r in repl:
            ins, outs = list(sig.inputs), list(sig.outputs)
            (ins if side == "in" else outs)[k] = r
            out.append(Signature(tuple(ins), tuple(outs), sig.tag))
    return out


@dataclass
class MutationReport:
    """How many deliberately wrong signatures (mutants) the proof caught, and which it missed."""

    total: int = 0  # mutants that are not valid signatures of the rule
    caught: int = 0
    survivors: list = field(default_factory=list)

    @property
    def rate(self) -> float:
        """The fraction of mutants caught."""
        return self.caught / self.total if self.total else 1.0


def mutation_test(case_list: Sequence[Case], mesh_shape: Sequence[int] = (2,)) -> MutationReport:
    """Mutate every one-axis signature of every case; count how many wrong mutants the proof catches.

    A mutant equal to a signature the rule already enumerates is valid and not counted; a split
    moved to a dim the tensor does not have is not a mutant. Rank-aware local implementations are
    also run with their offsets dropped.
    """
    from autopar.ir.placement import Split
    from autopar.ir.rules import RULES, signatures
    from autopar.ir.rules.base import OFFSET_READS

    rep = MutationReport()
    for case in case_list:
        sigs = signatures(case.call)
        valid = {(s.inputs, s.outputs) for s in sigs}
        specs = list(case.call.in_specs) + list(case.call.out_specs)
        for sig in sigs:
            for m in mutants(sig):
                if (m.inputs, m.outputs) in valid:
                    continue
                places = list(m.inputs) + list(m.outputs)
                if any(isinstance(p, Split) and (s is None or p.dim >= s.ndim) for p, s in zip(places, specs)):
                    continue  # not a placement of that tensor at all
                if not _meaningful(sig, m, specs):
                    continue
                rep.total += 1
                res = check_strategy(case.call, (m,), mesh_shape, case.inputs, case.expected, seed=1)
                if res.ok:
                    rep.survivors.append(f"{case.call.op} [{case.node}] {sig} -> mutant {m}")
                else:
                    rep.caught += 1
            rule = RULES.get(case.call.op)
            if rule is not None and rule.local is not None:
                before = OFFSET_READS[0]
                base = check_strategy(case.call, (sig,), mesh_shape, case.inputs, case.expected, seed=1)
                if OFFSET_READS[0] == before:
                    continue  # this signature's local implementation uses no offset
                dropped = check_strategy(case.call, (sig,), mesh_shape, case.inputs, case.expected, seed=1, offset_scale=0)
                if base.ok:
                    rep.total += 1
                    if dropped.ok:
                        rep.survivors.append(f"{case.call.op} [{case.node}] {sig} with offsets dropped")
                    else:
                        rep.caught += 1
    return rep


def _meaningful(sig, mutant, specs) -> bool:
    """A mutant that only touches an empty tensor, or moves a split onto a size-1 dim, is still a
    valid signature (every placement of an empty tensor is the same; a size-1 dim's split is the
    whole on one device), so it does not count."""
    from autopar.ir.placement import Split

    before = list(sig.inputs) + list(sig.outputs)
    after = list(mutant.inputs) + list(mutant.outputs)
    for a, b, spec in zip(before, after, specs):
        if a == b:
            continue
        if spec is None or spec.numel == 0:
            return False
        if isinstance(b, Split) and spec.shape[b.dim] == 1:
            return False
    return True
