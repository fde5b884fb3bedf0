"""Collectives predicted by a plan against collectives a run executed.

A plan lists every resharding with its steps (``plan.reshardings``); the collectives among them
(all-gather, reduce-scatter, all-reduce, all-to-all: local slices and pads move nothing) are what
the lowered program must run on each device. A run records what actually ran
(``ParallelModule.record_collectives``, or ``simulate(..., trace=...)``). Both are counted per
(kind, mesh axis, bytes as the axis group sees it); gradient reshardings that share a bucket
(``"bucket"`` in the plan, see ``cost_model.buckets``) are one collective of their summed bytes. A
pipelined rank runs its stages' part of them, some once per micro-batch, and its point-to-point
transfers (``pipelined_predicted``).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

from autopar.cost_model.buckets import LOCAL_KINDS, collective_calls
from autopar.ir.graph import Phase
from autopar.program.staged import SHAPE

Key = tuple[str, str, int]


def predicted(plan) -> Counter:
    """Per (kind, axis, bytes): how many times one device runs that collective in one step."""
    return Counter((coll, axis, nbytes) for _, coll, axis, nbytes, _ in collective_calls(plan.reshardings))


def executed(records: Iterable) -> Counter:
    """The same count for recorded collectives (``collectives.Executed``)."""
    return Counter((e.kind, e.axis, int(e.bytes)) for e in records)


def compare(want: Counter, records: Iterable) -> list[str]:
    """What differs between a prediction and a device's recorded collectives (empty: equal)."""
    got = executed(records)
    lines = []
    for key in sorted(set(want) | set(got)):
        if want[key] != got[key]:
            kind, axis, nbytes = key
            lines.append(f"{kind} on {axis} of {nbytes} B: predicted {want[key]}, executed {got[key]}")
    return lines


def differences(plan, records: Iterable) -> list[str]:
    """What differs between the plan's prediction and a device's recorded collectives (empty: equal)."""
    return compare(predicted(plan), records)


def pipelined_predicted(pm) -> Counter:
    """Per (kind, axis, bytes): how many times a rank of a pipelined run (``MeshPipelinedModule``
    ``pm``) runs that collective in one step, by the plan's reshardings: the activation reshardings its
    stages' ops read, once per micro-batch (once per step for values made from parameters, buffers and
    constants alone, which run once); the parameter gathers its stages' forward ops read, once per step
    (the gathered copy is kept for the step: the backward's regathers are priced as not run), a gather
    group whole when one of its members is wanted; the gradient reductions of the parameters its stages
    read, once per step (a bucket whole when one of its members is wanted); the loss handed back whole
    (a partial loss reduced) on the last stage's rank, once per micro-batch; and its point-to-point
    transfers (``pipelined_p2p``)."""
    g, stage_of, m = pm.graph, pm.stage_of, pm.m
    mine = set(pm.my_stages)
    names = {n.name for n in g.nodes}
    last = len(pm.plan.pipeline.stage_ranks) - 1
    groups: dict = {}
    calls = []
    for r in pm.plan.reshardings:
        cons = [c for c in r.get("consumers") or [r["consumer"]] if c in names]
        if r["kind"] == "grad":  # its consumer is the parameter's slot: reduced on the ranks of its stages
            n = 1 if pm.param_stages.get(r["consumer"][len("param:"):], set()) & mine else 0
        elif r["kind"] == "param":
            n = 1 if {stage_of(c) for c in cons if g.node(c).phase == Phase.FORWARD} & mine else 0
        elif not cons and r["consumer"] == "loss":  # the loss handed back whole: the last stage's, per micro-batch
            n = m if last in mine else 0
        elif {stage_of(c) for c in cons} & mine:
            n = 1 if r["tensor"] in pm.static_refs else m
        else:
            n = 0
        steps = [(st["kind"], st["axis"], int(st["bytes"])) for st in r["steps"] if st["kind"] not in LOCAL_KINDS]
        if r.get("bucket") is not None:  # one collective for the group: run whole if any member is wanted
            b = groups.setdefault((r["kind"], r["bucket"]), [0, [[k, a, 0] for k, a, _ in steps]])
            b[0] = max(b[0], n)
            for entry, (_, _, nbytes) in zip(b[1], steps):
                entry[2] += nbytes
        elif n:
            calls += [step for step in steps for _ in range(n)]
    for n, steps in groups.values():
        calls += [tuple(step) for step in steps for _ in range(n)]
    return Counter(calls) + pipelined_p2p(pm)


def pipelined_p2p(pm) -> Counter:
    """Per (send | recv, pp axis, bytes): a pipelined rank's point-to-point transfers in one step: per
    micro-batch, each value its stages send the next stage (and, back, a gradient in each one's slot),
    each value they receive, at the local size the plan's placements give it."""
    pl, cut = pm.plan.pipeline, pm.cutting
    ranks, axis, out = list(pl.stage_ranks), pl.axis, Counter()

    def size(n) -> int:
        shape, dtype = n.meta[SHAPE]
        return math.prod(shape) * dtype.itemsize

    for s in pm.my_stages:
        st = cut.stages[s]
        if s + 1 < len(ranks) and ranks[s + 1] != ranks[s]:
            for n in st.f_out:
                out[("send", axis, size(n))] += pm.m
                out[("recv", axis, size(n))] += pm.m
        if s > 0 and ranks[s - 1] != ranks[s]:
            for n in st.f_in:
                out[("recv", axis, size(n))] += pm.m
                out[("send", axis, size(n))] += pm.m
    return out


def static_values(graph) -> set:
    """Names of the graph's values made from parameters, buffers and constants alone (what a pipelined
    rank computes once per step, before the schedule)."""
    out = set()
    for n in graph.nodes:
        if n.is_placeholder:
            if n.name in graph.params.values() or n.name in graph.buffers.values():
                out.add(n.name)
        elif all(r.node in out for r in n.inputs):  # constants and ops of no tensor input too
            out.add(n.name)
    return out


__all__ = ["compare", "differences", "executed", "pipelined_p2p", "pipelined_predicted", "predicted",
           "static_values"]
