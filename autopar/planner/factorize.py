"""The mesh factorization search: ``autopar.plan`` on a ``Mesh.devices(count, ...)`` mesh.

The user gives a device count (and a node size); the planner chooses the factorization into
``pp`` x ``dp`` x ``tp`` (axes in that order: tp innermost, inside a node; pp and dp across nodes,
as Megatron-LM and torchtitan lay them out). Candidates, pruned by rules rather than planned
exhaustively:

- ``tp`` divides the node size (a tensor-parallel group never spans nodes: its per-layer
  collectives are the most frequent) and the count;
- ``pp`` is 1 or a power of two no larger than the model's repeated layer instances (counted on
  the captured graph: a stage holds at least one) nor than the batch (a micro-batch per stage);
- ``dp`` is the rest and no larger than the batch;
- a ``cp`` axis (context parallelism, between ``dp`` and ``tp``) takes part of the rest when the
  inputs are token sequences that are long (``CP_MIN_SEQ``) or too few to give every ``dp`` device
  one: a power of two dividing the sequence, on unpipelined shapes. What each axis splits is the
  search's choice; on ``cp`` that is the sequence, with each attention op in a form of its own
  (all-gathered keys and values, all-to-all, or a head split);
- an ``ep`` axis (between ``dp`` and ``tp``) takes part of the rest for a mixture of experts (a
  graph with grouped expert products): a power of two ``e`` with ``e x tp`` within a node, ``tp >= 2``
  and ``e`` no more than the experts, on unpipelined shapes. Attention splits the batch on it like
  ``dp``; the expert layers may run their experts over it alone or over ``ep x tp`` (their own
  factorization of the devices: ``ir/rules/expert.py``), an expert-parallel degree that neither
  ``dp`` nor ``tp`` alone gives;
- ``Mesh.devices(..., pp=[...], tp=[...])`` restricts the degrees further.

Each candidate is planned as the user would plan that shape: ``pp = 1`` by the intra-op planner on
``{"dp", "tp"}``, ``pp > 1`` by the pipeline planner (``planner/pipelined.py``) without its own
comparison against the plain plan (the ``pp = 1`` candidates are that comparison). Two captures
serve every candidate (``planner/captures``): the full batch's, and one at a probe batch that is
re-shaped to each micro-batch size (``ir/rebatch.py``). The
pipelined shapes are planned first; an unpipelined shape is first solved without a memory budget,
and when that plan (the fastest it can have: recomputation only adds time) does not fit and is
already slower than a fitting shape found, its budgeted search is skipped (listed with the reason).
A shape whose mesh is an earlier one's renamed (``pp=2 dp=4`` inside a node of 8 is ``pp=2
tp=4``: ``renamed_key``) is not planned twice. A pipelined shape whose first intra-op solve shows
that none of its pipelines could beat a fitting shape already found (priced without a memory budget,
the other micro-batch counts by the driver's optimistic estimate) is not solved further
(``pipelined.NotFaster``). The fastest candidate that fits wins; ``plan.mesh_search`` lists every
candidate priced (or why it was not), and ``plan.phases["mesh_search"]`` the search's own wall time.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from autopar.cost_model.mesh import DP_AXIS, PP_AXIS, TP_AXIS, Mesh
from autopar.errors import ArgumentError, InfeasibleError, RecipeError
from autopar.ir.capture import as_args
from autopar.ir.rules.expert import graph_experts
from autopar.ir.rules.ring import asks_balanced, offer_balanced
from autopar.ir.stages import chain
from autopar.passes.search.strategies import runs_balanced
from autopar.planner.captures import capture
from autopar.planner.intra import prepare, run_passes, search_prepared, within
from autopar.planner.options import PlanOptions
from autopar.planner.pipelined import NotFaster, batch_size, plan_pipelined
from autopar.planner.report import build_plan


#: the context-parallel axis: the devices that split one sequence (its own axis, between dp and tp)
CP_AXIS = "cp"
#: tokens per sequence from which a ``cp`` axis is considered even when the batch could fill ``dp``
CP_MIN_SEQ = 16384
#: the expert axis of a mixture of experts: devices that split the batch for attention and the experts
EP_AXIS = "ep"


def shape_candidates(count: int, node_size: int, batch: int, n_layers: int, pp: Optional[list] = None,
                     tp: Optional[list] = None, seq: int = 0, experts: int = 0) -> list[dict[str, int]]:
    """The ``{"pp", "dp", "tp"}`` factorizations of ``count`` the search plans (see the module
    docstring), in a fixed order: fewer pipeline stages first, then larger tensor-parallel groups.
    With a token sequence of ``seq`` tokens that is long (``CP_MIN_SEQ``) or whose batch cannot fill
    the devices ``dp`` would get, unpipelined shapes with a ``cp`` axis (a power of two dividing
    ``seq``; ``{"pp", "dp", "cp", "tp"}``) follow each ``tp``'s plain shape; for a mixture of
    ``experts`` experts, so do shapes with an ``ep`` axis (``{"pp", "dp", "ep", "tp"}``)."""
    out = []
    tps = [t for t in range(node_size, 0, -1) if node_size % t == 0 and count % t == 0]
    if tp is not None:
        tps = [t for t in tps if t in tp]
    pps = [1] + [2 ** k for k in range(1, count.bit_length()) if 2 ** k <= min(n_layers, batch)]
    if pp is not None:
        pps = [p for p in sorted(set(pp)) if p == 1 or p <= n_layers]
    for p in pps:
        for t in tps:
            if count % (p * t):
                continue
            d = count // (p * t)
            if p > 1 and batch % p:
                continue
            if d <= batch:
                out.append({PP_AXIS: p, DP_AXIS: d, TP_AXIS: t})
            if p == 1 and experts:
                out += expert_shapes(d, t, node_size, batch, experts)
            if p == 1 and seq and (seq >= CP_MIN_SEQ or d > batch):
                # (cp alone inside a node is the mesh of tp alone of that size, renamed: skipped)
                out += [{PP_AXIS: 1, DP_AXIS: d // c, CP_AXIS: c, TP_AXIS: t}
                        for c in (2 ** k for k in range(1, d.bit_length()))
                        if d % c == 0 and d // c <= batch and seq % c == 0
                        and not (c == count and node_size % c == 0)]
    return out


def expert_shapes(d: int, t: int, node_size: int, batch: int, experts: int) -> list[dict[str, int]]:
    """The unpipelined shapes that carve an ``ep`` axis of ``e`` devices out of ``d`` data-parallel
    ones beside ``t``: ``e x t`` within a node (the experts' exchange over ``ep x tp`` stays on the
    node's links), ``t >= 2`` (with ``t = 1``, ``dp x ep`` is a ``dp x tp`` shape renamed), ``e`` no
    more than the ``experts``, and ``dp`` at least 2 (``ep x tp`` alone is a ``dp x tp`` shape
    renamed)."""
    if t < 2:
        return []
    return [{PP_AXIS: 1, DP_AXIS: d // e, EP_AXIS: e, TP_AXIS: t}
            for e in (2 ** k for k in range(1, d.bit_length()))
            if d % e == 0 and e < d and e * t <= node_size and node_size % (e * t) == 0 and e <= experts and d <= batch]


def renamed_key(shape: dict[str, int]) -> tuple:
    """What a shape's mesh is, names aside: its pipeline degree and the sizes of its other axes of
    more than one device, in order (each axis's link follows from its size and the sizes inside it,
    ``cost_model.mesh.axis_link``). Shapes with a ``cp`` or ``ep`` axis keep their names (those
    axes are made for a split of their own)."""
    if set(shape) - {PP_AXIS, DP_AXIS, TP_AXIS}:
        return tuple(shape.items())
    return (shape[PP_AXIS],) + tuple(v for k, v in shape.items() if k != PP_AXIS and v > 1)


def _text(shape: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items())


def sequence_length(args: tuple, kwargs: dict) -> int:
    """Tokens per sequence: dim 1 of the first integer input of two or more dims (token ids); 0 if none."""
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and not v.is_floating_point() and not v.is_complex():
            return int(v.shape[1])
    return 0


def candidate_mesh(mesh: Mesh, shape: dict[str, int]) -> Mesh:
    """The mesh of one factorization: ``pp`` (when > 1), ``dp`` and ``tp`` (each when > 1; a lone
    device is ``dp=1``), on ``mesh``'s hardware and node shape, with the default links."""
    axes = {k: v for k, v in shape.items() if v > 1}
    if not axes:
        axes = {DP_AXIS: 1}
    return Mesh(axes, device=mesh.hardware)


def plan_mesh_search(model, mesh: Mesh, example_inputs=(), example_kwargs=None,
                     options: Optional[PlanOptions] = None):
    """The ``Plan`` for a ``Mesh.devices`` mesh (see the module docstring) with ``options``. Raises
    ``InfeasibleError`` when no factorization fits, naming each one's need."""
    start = time.perf_counter()
    options = options if options is not None else PlanOptions()
    spec: dict[str, Any] = mesh.factorize or {}
    count, node = int(spec["devices"]), int(spec["node_size"])
    if not options.training:
        raise ArgumentError("autopar.plan: Mesh.devices (the factorization search) plans training only; give the "
                            "axes (autopar.Mesh({'dp': ..., 'tp': ...})) for inference")
    if options.pipeline is not None:
        raise ArgumentError("autopar.plan: pipeline= pins a pipeline on a given mesh; with Mesh.devices the planner "
                            "chooses the pipeline degree: give the axes, e.g. Mesh({'pp': 4, 'dp': 2, 'tp': 8}), "
                            "to pin it")
    if options.recipe is not None or options.hints is not None or options.attention:
        raise ArgumentError("autopar.plan: recipe=, hints= and attention= name mesh axes; with Mesh.devices the axes "
                            "are not known "
                            "yet: give the axes (autopar.Mesh({...})) to use them")
    args = as_args(example_inputs)
    kwargs = dict(example_kwargs or {})
    batch = batch_size(args, kwargs)
    graphs: dict[int, Any] = {}  # the pipelined shapes' captures (the loss alone, as pipelines run)
    # the unpipelined shapes' capture: the step returns the model's other outputs too
    full = options.graph if options.graph is not None else capture(model, args, kwargs, training=True, outputs=True,
                                                                        planning=True)
    n_layers = len(chain(full).keys)
    shapes = shape_candidates(count, node, batch, n_layers, spec.get(PP_AXIS), spec.get(TP_AXIS),
                              sequence_length(args, kwargs), graph_experts(full))
    if not shapes:
        raise ArgumentError(f"autopar.plan: no factorization of {count} devices into pp x dp x tp fits a batch of "
                            f"{batch} with tp dividing the node size {node}"
                            + (f" and the degrees asked (pp={spec.get(PP_AXIS)}, tp={spec.get(TP_AXIS)})"
                               if spec.get(PP_AXIS) or spec.get(TP_AXIS) else ""))
    budget = options.budget(mesh)  # every factorization is on this hardware: one budget for all
    fixed = replace(options, graph=None, memory_budget=budget)
    at_batch = replace(fixed, graph=full)
    asked = asks_balanced(fixed.hints, fixed.attention)  # the balanced split Z weighed from the start
    rows: list[dict] = []
    plans = []
    # the pipelined shapes first (their per-stage solves are small), then the unpipelined ones, each
    # first without a budget: recomputing or leaner placements only add time, so when even that is
    # slower than a fitting shape already found, its budgeted search (the costly part) is skipped
    order = [s for s in shapes if s[PP_AXIS] > 1] + [s for s in shapes if s[PP_AXIS] == 1]
    seen: dict[tuple, dict[str, int]] = {}
    for shape in order:
        key = renamed_key(shape)
        if key in seen:
            rows.append({"shape": dict(shape), "error": f"not planned: the mesh of {_text(seen[key])} renamed (the "
                         "same sizes on the same links; what each axis splits is the search's choice)"})
            continue
        seen[key] = shape
        sub = candidate_mesh(mesh, shape)
        best = min((p.step_time for p, _ in plans if p.fits), default=math.inf)
        try:
            if shape[PP_AXIS] > 1:
                try:
                    plan = plan_pipelined(model, sub, args, kwargs, fixed, mesh_search=True, graphs=graphs, beat=best)
                except NotFaster as e:
                    rows.append({"shape": dict(shape), "error": str(e)})
                    continue
            else:
                # (the passes before the search, and its solve without the budget, serve both searches)
                with offer_balanced(asked):
                    prep = prepare(model, sub, args, kwargs, replace(at_batch, memory_budget=math.inf))
                    fast = search_prepared(prep)
                    if fast.cost.step_time >= best and fast.cost.peak_memory > budget:
                        rows.append({"shape": dict(shape), "error": f"not planned within the budget: its fastest "
                                     f"plan without one ({fast.cost.step_time * 1e3:.1f} ms) is already slower than "
                                     f"a fitting shape"})
                        continue
                    # (recomputation levels that cannot beat the fastest fitting shape are not solved)
                    planned = fast if budget == math.inf else search_prepared(within(prep, budget), best)
                if not asked and runs_balanced(planned):  # the balanced split weighed in a second search
                    planned = run_passes(model, sub, args, kwargs, replace(at_batch, memory_budget=budget))
                plan = build_plan(planned)
        except (InfeasibleError, ArgumentError, RecipeError, ValueError) as e:
            rows.append({"shape": dict(shape), "error": str(e).splitlines()[0][:400]})
            continue
        plans.append((plan, len(rows)))
        rows.append({"shape": dict(shape), "step_time": plan.step_time, "peak_memory": int(plan.peak_memory),
                     "fits": bool(plan.fits), "pipelined": plan.pipeline is not None})
    fitting = [(p, k) for p, k in plans if p.fits]
    if not fitting:
        tried = "; ".join(_text(r["shape"]) + ": "
                          + (r["error"][:120] if "error" in r else f"{r['peak_memory'] / 2**30:.1f} GiB")
                          for r in rows)
        raise InfeasibleError(f"no factorization of {count} devices fits the memory budget: {tried}; use more devices, "
                              f"a smaller batch, or raise memory_budget")
    best, k = min(fitting, key=lambda pk: (pk[0].step_time, pk[1]))
    best.mesh_search = {"devices": count, "node_size": node, "chosen": dict(rows[k]["shape"]),
                        "compared": sorted(rows, key=lambda r: ("error" in r, not r.get("fits", False),
                                                               r.get("step_time", math.inf)))}
    best.phases = dict(best.phases, mesh_search=round(time.perf_counter() - start, 4))
    return best


__all__ = ["CP_AXIS", "EP_AXIS", "candidate_mesh", "expert_shapes", "plan_mesh_search", "renamed_key",
           "sequence_length", "shape_candidates"]
