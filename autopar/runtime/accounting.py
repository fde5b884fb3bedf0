"""Collectives predicted by a plan against collectives a run executed.

A plan lists every resharding with its steps (``plan.reshardings``); the collectives among them
(all-gather, reduce-scatter, all-reduce, all-to-all: local slices and pads move nothing) are what
the lowered program must run on each device. A run records what actually ran
(``ParallelModule.record_collectives``, or ``simulate(..., trace=...)``). Both are counted per
(kind, mesh axis, bytes as the axis group sees it); gradient reshardings that share a bucket
(``"bucket"`` in the plan, see ``cost_model.buckets``) are one collective of their summed bytes.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from autopar.cost_model.buckets import collective_calls

Key = tuple[str, str, int]


def predicted(plan) -> Counter:
    """Per (kind, axis, bytes): how many times one device runs that collective in one step."""
    return Counter((coll, axis, nbytes) for _, coll, axis, nbytes, _ in collective_calls(plan.reshardings))


def executed(records: Iterable) -> Counter:
    """The same count for recorded collectives (``collectives.Executed``)."""
    return Counter((e.kind, e.axis, int(e.bytes)) for e in records)


def differences(plan, records: Iterable) -> list[str]:
    """What differs between the plan's prediction and a device's recorded collectives (empty: equal)."""
    want, got = predicted(plan), executed(records)
    lines = []
    for key in sorted(set(want) | set(got)):
        if want[key] != got[key]:
            kind, axis, nbytes = key
            lines.append(f"{kind} on {axis} of {nbytes} B: predicted {want[key]}, executed {got[key]}")
    return lines


__all__ = ["differences", "executed", "predicted"]
