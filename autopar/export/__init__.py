"""Plans exported as the layouts people already run: ``export(plan, "dtensor", model, inputs)`` writes a
Python module applying the plan with DTensor's module styles and FSDP2 (``export.dtensor``),
``export(plan, "torchtitan", ...)`` torchtitan's job-config settings (``export.torchtitan``).

Module styles cannot say everything an op-level plan says: ``export.project`` projects the plan onto
them and prices the projection with the planner's own evaluator. ``Export.report`` holds both prices,
every parameter, input and op whose placement the projection changed, and the collectives one
training step of the exported layout runs, counted as FSDP2 and DTensor issue them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional

from autopar.errors import ArgumentError
from autopar.export import dtensor, torchtitan
from autopar.export.project import Projection, Styles, project, styles, unit_of
from autopar.plans.format import human_time
from autopar.plans.schema import Plan

FORMATS = ("dtensor", "torchtitan")


@dataclass
class Export:
    """An exported plan: ``text`` (the Python module, or the TOML fragment) and ``report``: the
    original and projected figures (``"original"``, ``"projected"``: None when unpriced), the
    changes (``"changed"``: ``{"name", "module", "planned", "projected"}`` each), the ``"collectives"``
    one step runs (kind -> count; None when unpriced), ``"notes"`` and, for torchtitan, ``"config"``."""

    format: str
    text: str
    report: dict

    def summary(self) -> str:
        """The report in a few lines."""
        r = self.report
        lines = [f"export ({self.format}): planned {human_time(r['original']['step_time'])}"]
        if r["projected"] is not None:
            gap = r["projected"]["step_time"] / r["original"]["step_time"] - 1
            lines[0] += f", projected {human_time(r['projected']['step_time'])} ({gap:+.1%})"
            lines.append(f"{len(r['changed'])} placements changed by the projection")
            lines += [f"  {c['name']} ({c['module'] or 'root'}): {c['planned']} -> {c['projected']}"
                      for c in r["changed"][:20]]
            if len(r["changed"]) > 20:
                lines.append(f"  ... {len(r['changed']) - 20} more in Export.report['changed']")
        lines += [f"note: {n}" for n in r["notes"]]
        return "\n".join(lines)


def _figures(plan: Plan) -> dict:
    return {"step_time": plan.step_time, "comm_time": plan.comm_time, "peak_memory": plan.peak_memory,
            "fits": plan.fits}


def step_collectives(projected: Plan, st: Styles) -> dict[str, int]:
    """The collectives one training step of the exported layout runs, by kind, from the projected
    plan's reshardings grouped as FSDP2 and DTensor's styles issue them: one all-gather per
    ``fully_shard`` unit and phase its parameters are gathered in, one reduce-scatter (and, over a
    replicated data axis, one all-reduce) per unit its gradients are reduced in, each activation
    all-reduce, all-gather and reduce-scatter on the tensor axis (sequence parallelism's at the
    split Linears' boundaries), and each gradient all-reduce there. With the head split on the
    vocabulary, the loss's forward all-reduces on the tensor axis count too (``loss_parallel``'s
    maximum, sum and picked logits), its backward's not: ``loss_parallel`` differentiates the
    log-softmax and the nll loss together on each rank's classes, with no collective. The root unit
    is not resharded after forward (FSDP2 keeps it gathered), where the projection's price gathers
    what the backward uses again. The loss's own all-reduce (the program averages the step's loss
    over the batch; the exported model returns each rank's) is not counted."""
    phase = {n["name"]: n.get("phase", "") for n in projected.nodes}
    data, shard = set(st.data_axes), st.data_axes[-1] if st.data_axes else None
    gathers, reduced, tensor = set(), Counter(), Counter()
    vocab = "vocab" in st.sequence.values()
    for r in projected.reshardings:
        unit, kinds = unit_of(st.units, r.get("module", "")), [(s["kind"], s["axis"]) for s in r.get("steps", [])]
        if r.get("kind") == "param":
            when = "backward" if phase.get(r.get("consumer", "")) == "backward" else "forward"
            # a unit not resharded after forward (FSDP2's root) keeps its gathered parameters for the backward
            if any(k == "all_gather" and a in data for k, a in kinds) and (when == "forward" or st.reshard[unit]):
                gathers.add((unit, when))
        elif r.get("kind") == "grad":
            for k, a in set(kinds):
                if a in data:
                    reduced[(unit, "reduce_scatter" if a == shard else "all_reduce")] = 1
            # a replicated parameter used on sequence-split activations (a norm's scale) has its
            # gradient's partial sums all-reduced over the tensor axis, one each
            tensor["all_reduce"] += sum(1 for k, a in kinds if k == "all_reduce" and a == st.tensor_axis)
        elif r.get("module", "") != "" or (vocab and phase.get(r.get("consumer", "")) == "forward"):
            for k, a in kinds:
                if a == st.tensor_axis and k in ("all_reduce", "all_gather", "reduce_scatter"):
                    tensor[k] += 1
    out = Counter({"all_gather": len(gathers)}) + tensor
    for (_, kind), n in reduced.items():
        out[kind] += n
    return {k: v for k, v in sorted(out.items()) if v}


def export(plan: Plan, format: str, model=None, example_inputs=(), example_kwargs=None, *,
           tensor_parallel: Optional[bool] = None, sequence_parallel: Optional[bool] = None,
           loss_parallel: Optional[bool] = None) -> Export:
    """``plan`` as the layout ``format`` names (``"dtensor"`` or ``"torchtitan"``). ``model`` and its
    example inputs (those the plan was made with) let the projection be priced; the ``dtensor``
    format needs them (its tensor-parallel styles are read off the model's graph). ``tensor_parallel``:
    None projects with and without the plan's tensor axis and keeps the faster that fits; True or
    False keeps or drops it; ``sequence_parallel`` None splits the tensor-parallel layers' residual
    stream along the sequence where the plan does, True wherever the model allows, False never
    (``export.project.project``, ``export.sequence``); ``loss_parallel`` likewise splits the output
    head on the vocabulary, its loss computed on the split logits under torch's ``loss_parallel``."""
    if format not in FORMATS:
        raise ArgumentError(f"export: unknown format {format!r}; formats are {', '.join(FORMATS)}")
    proj: Optional[Projection] = None
    if model is not None and plan.pipeline is None:
        proj = project(plan, model, example_inputs, example_kwargs, tensor_parallel, sequence_parallel,
                       loss_parallel)
    elif format == "dtensor" and plan.pipeline is None:
        raise ArgumentError("export: the dtensor format needs the plan's model and example inputs "
                            "(plan.export('dtensor', model, example_inputs))")
    st = proj.styles if proj is not None else styles(plan, None)
    notes = list(st.notes)
    if plan.pipeline is not None:
        notes.append("pipelined plan: the stages' layout is exported without tensor styles and not priced")
    report = {"original": _figures(plan), "projected": _figures(proj.plan) if proj else None,
              "changed": [dict(zip(("name", "module", "planned", "projected"), c)) for c in proj.changed]
              if proj else [], "collectives": step_collectives(proj.plan, st) if proj else None, "notes": notes}
    if format == "dtensor":
        return Export(format, dtensor.render(plan, st, proj.plan if proj else None), report)
    config, more = torchtitan.settings(plan, st)
    report["notes"] += more
    report["config"] = config
    return Export(format, torchtitan.toml(config), report)


__all__ = ["FORMATS", "Export", "export", "step_collectives"]
