"""Measured memory of a simulated pipelined step, per pipeline rank (``autopar.simulate``).

The simulator runs every pipeline rank of one stage-mesh device in one thread (``simulate.py``);
here each pipeline rank has its own ``runtime.memory.MemoryTracker``, which watches only the ops of
the stages that rank owns (``plan.pipeline.stage_ranks``) and holds only what that rank would hold:
the parameter and buffer blocks its stages read (own copies), the optimizer state of those
parameters (the plan's bytes per element, as a step after the first holds), the gradient
accumulators of its stages, the static values (kept gathered parameters) its stages read, its
micro-batches' inputs, the values it receives from a stage on another rank (boundary activations
and their gradients), and what its stages' forwards stash for their backwards (activations).
A rank's peak is sampled after each of its own ops.

What it is not: the simulator runs every schedule in GPipe's order (every micro-batch's forward,
then every backward), so each rank holds all its micro-batches' stashes at once: the figure is the
plan's under GPipe (``in_flight`` = micro-batches); for a schedule with fewer micro-batches in
flight (1F1B) the measured activations are larger than the plan's by that ratio. The static part
(the gathers, run once) and the per-step reductions run outside every tracker: their results are
counted (the kept gathers as parameters), their in-flight buffers are not.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

from autopar.ir.stages import param_stages
from autopar.runtime.memory import MemoryTracker


def state_stages(graph, stages: list, stage_of) -> dict:
    """Parameter or buffer FQN -> the stages that hold it: a parameter's as ``ir.stages.param_stages``
    says, a buffer's the stages of the ops that read it (the first stage's when none does)."""
    users = graph.users()
    out = {fqn: set(got) for fqn, got in param_stages(graph, stages).items()}
    for fqn, name in graph.buffers.items():
        out[fqn] = {stage_of(u) for u in users[name]} or {0}
    return out


class RankMeters:
    """One tracker per pipeline rank of a stage-mesh device (see the module docstring)."""

    def __init__(self, ranks: list, slots: list, blocks: list, owners: dict, cut, optimizer_bytes: int) -> None:
        """``ranks``: each stage's pipeline rank; ``slots``/``blocks``: the program's inputs and each
        micro-batch's blocks of them; ``owners``: ``state_stages``; ``cut``: the device's ``Cut``."""
        self.ranks = list(ranks)
        self.trackers = {r: MemoryTracker() for r in sorted(set(ranks))}
        self._cut = cut
        self._optimizer: list = []  # the optimizer state, alive through the step (the trackers hold weak keys)
        for r, tracker in self.trackers.items():
            mine = {s for s, rr in enumerate(ranks) if rr == r}
            state = [k for k, slot in enumerate(slots) if slot.kind in ("param", "buffer")
                     and owners.get(slot.key, {0}) & mine]
            params = [blocks[0][k] for k in state]
            optimizer = [torch.zeros(t.numel() * optimizer_bytes, dtype=torch.uint8, device=t.device)
                         for k, t in zip(state, params) if slots[k].kind == "param" and t.is_floating_point()]
            given = {k for st in cut.stages if st.index in mine for k in st.f_given
                     if slots[k].kind not in ("param", "buffer")}
            self._optimizer += optimizer
            tracker.begin(params=params, optimizer=optimizer, inputs=[b[k] for b in blocks for k in sorted(given)])

    def state(self, statics: list, acc: list) -> None:
        """Count each rank's static values (kept gathered parameters: ``params``) and gradient
        accumulators (``grads``), made before the first stage runs."""
        for st in self._cut.stages:
            tracker = self.trackers[self.ranks[st.index]]
            tracker.hold([statics[k] for k in st.f_statics + st.b_statics], "params")
            tracker.hold([acc[f] for f in st.frontier], "grads")

    @contextlib.contextmanager
    def stage(self, index: int, handed: Iterable = (), source: int = -1) -> Iterator[None]:
        """Watch stage ``index``'s ops on its rank's tracker; ``handed``: its inputs from stage
        ``source``, received (counted on this rank) when another rank holds that stage."""
        tracker = self.trackers[self.ranks[index]]
        if 0 <= source < len(self.ranks) and self.ranks[source] != self.ranks[index]:
            tracker.take(handed)
        with tracker.watching():
            yield

    def saved(self, index: int, values: Iterable) -> None:
        """What stage ``index``'s forward stashed for its backward: activations of its rank."""
        self.trackers[self.ranks[index]].mark(values, "activations")

    def finish(self) -> dict:
        """Pipeline rank -> its measured step (``MemoryTracker.finish``)."""
        return {r: tracker.finish() for r, tracker in self.trackers.items()}


__all__ = ["RankMeters", "state_stages"]
