"""The pipeline's part of the plan's HTML page: the schedule, micro-batches and bubble, a table of
stages (modules, forward and backward times, micro-batches in flight, what each recomputes, its
rank's memory as a bar), the candidates compared, batch-coupled ops; and the mesh search's
factorizations (``Mesh.devices``). Empty strings for a plan without them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from autopar.plans.format import finite_float
from autopar.plans.html.cells import bar_cell, bytes_text, escape, header_cell, sort_key, time_text

if TYPE_CHECKING:
    from autopar.plans.entries import PipelineChoice
    from autopar.plans.schema import Plan


def _span(paths: list) -> str:
    paths = [str(p) for p in paths]
    return ", ".join(paths) if len(paths) <= 4 else f"{paths[0]}, {paths[1]} .. {paths[-1]} ({len(paths)} modules)"


def _num(value, text: str) -> str:
    return f'<td class="num" data-v="{sort_key(value)}">{escape(text)}</td>'


def pipeline_section(plan: "Plan") -> str:
    """The pipeline (``plan.pipeline``): its choice, per stage its figures, what it compared."""
    pl: Optional[PipelineChoice] = getattr(plan, "pipeline", None)
    if pl is None:
        return ""
    ranks = pl.stage_ranks or []
    times = pl.stage_times or []
    flight = pl.in_flight or []
    mem = pl.rank_memory or []
    redo = pl.recompute or []
    top = max((finite_float(x) for x in mem), default=0.0)
    rows = []
    for s, paths in enumerate(pl.stages):
        r = int(ranks[s]) if s < len(ranks) else s
        f, i, w = (list(times[s]) + [0.0, 0.0, 0.0])[:3] if s < len(times) else (0.0, 0.0, 0.0)
        rc = redo[s] if s < len(redo) else None
        n_redo = len(rc.layers) if rc is not None else 0
        redo_text = f"{n_redo} ({rc.mode})" if rc is not None and n_redo else "-"
        rm = finite_float(mem[r]) if r < len(mem) else 0.0
        rows.append(
            f"<tr>{_num(s, str(s))}{_num(r, str(r))}<td><code>{escape(_span(paths))}</code></td>"
            f"{_num(f, time_text(f))}{_num(i + w, time_text(i + w))}{_num(w, time_text(w))}"
            f"{_num(flight[s] if s < len(flight) else 0, str(flight[s]) if s < len(flight) else '?')}"
            f"{_num(n_redo, redo_text)}"
            f"{bar_cell(rm, bytes_text(rm), top)}</tr>")
    head = "".join(header_cell(label, key, num=num) for label, key, num in (
        ("stage", "stage", True), ("rank", "rank", True), ("modules", "modules", False),
        ("forward per micro-batch", "fwd", True), ("backward per micro-batch", "bwd", True),
        ("of which weight gradients", "wgrad", True), ("micro-batches in flight", "flight", True),
        ("layers recomputed", "redo", True), ("rank memory", "mem", True)))
    axes = " \u00d7 ".join(f"{n}={v}" for n, v in zip(pl.mesh_names, pl.mesh_shape))
    facts = [("schedule", pl.schedule), ("micro-batches", pl.microbatches),
             ("stages per rank", pl.virtual_stages),
             ("bubble", f"{100 * finite_float(pl.bubble):.1f}%"),
             ("replayed makespan", time_text(pl.makespan)),
             ("exposed gradient sync", time_text(pl.sync_time)),
             ("one boundary transfer", time_text(pl.p2p_time))]
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in facts)
    coupled = pl.batch_coupled or []
    note = ""
    if coupled:
        note = (f'<p class="warn">{len(coupled)} op(s) couple the whole batch ({escape(", ".join(coupled[:4]))}'
                f'{" .." if len(coupled) > 4 else ""}): the plan\'s reference is the '
                f'{escape(pl.reference or "micro-batched")} single-device run.</p>')
    compared = pl.compared or []
    crow = []
    for c in compared:
        st = finite_float(c.step_time)
        pm = finite_float(c.peak_memory)
        bubble = finite_float(c.bubble)
        redone = c.recomputed or 0
        crow.append(f"<tr><td>{escape(c.schedule)}</td>{_num(c.microbatches, str(c.microbatches))}"
                    f"{_num(c.virtual_stages, str(c.virtual_stages))}{_num(st, time_text(st))}"
                    f"{_num(pm, bytes_text(pm))}{_num(bubble, f'{100 * bubble:.1f}%')}"
                    f"{_num(redone, str(redone))}"
                    f"<td>{'estimated' if c.estimated else 'solved'}</td></tr>")
    chead = "".join(header_cell(label, key, num=num) for label, key, num in (
        ("schedule", "schedule", False), ("micro-batches", "m", True), ("stages per rank", "v", True),
        ("step", "step", True), ("peak memory", "peak", True), ("bubble", "bubble", True),
        ("layers recomputed", "recomputed", True), ("priced from", "how", False)))
    return ('<section id="pipeline"><h2>Pipeline</h2>'
            f'<p class="sub">On axis <code>{escape(pl.axis)}</code> of {escape(axes)}; placements above are '
            'per stage, on the other axes, per micro-batch. The step is the replayed schedule plus the gradient '
            'synchronisation and optimizer step each rank does not hide.</p>'
            f'<dl class="facts">{dl}</dl>{note}'
            f'<div class="scroll"><table class="sortable" id="pipeline-stages"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>'
            + (f'<h3>Candidates compared</h3><div class="scroll"><table class="sortable" id="pipeline-compared">'
               f'<thead><tr>{chead}</tr></thead><tbody>{"".join(crow)}</tbody></table></div>' if crow else "")
            + "</section>")


def mesh_search_section(plan: "Plan") -> str:
    """The factorizations ``Mesh.devices`` left to the planner: each one's step and memory, or why not."""
    ms = getattr(plan, "mesh_search", None)
    if not isinstance(ms, dict) or not ms:
        return ""
    chosen = ms.get("chosen") or {}
    rows = []
    for r in ms.get("compared") or []:
        sh = r.get("shape") or {}
        name = " \u00d7 ".join(f"{k}={sh.get(k, 1)}" for k in ("pp", "dp", "tp"))
        mark = " (chosen)" if sh == chosen else ""
        if "error" in r:
            rows.append(f"<tr><td>{escape(name)}</td><td colspan=\"4\">{escape(str(r['error'])[:300])}</td></tr>")
            continue
        st, pm = finite_float(r.get("step_time")), finite_float(r.get("peak_memory"))
        rows.append(f"<tr><td>{escape(name + mark)}</td>{_num(st, time_text(st))}{_num(pm, bytes_text(pm))}"
                    f"<td>{'yes' if r.get('fits') else 'no'}</td><td>{'yes' if r.get('pipelined') else 'no'}</td></tr>")
    head = "".join(header_cell(label, key, num=num) for label, key, num in (
        ("pp \u00d7 dp \u00d7 tp", "shape", False), ("step", "step", True), ("peak memory", "peak", True),
        ("fits", "fits", False), ("pipelined", "pipelined", False)))
    return ('<section id="mesh-search"><h2>Mesh factorizations compared</h2>'
            f'<p class="sub">{escape(ms.get("devices"))} devices in nodes of {escape(ms.get("node_size"))}: the '
            'planner planned each shape (tp within a node) and kept the fastest that fits.</p>'
            f'<div class="scroll"><table class="sortable" id="mesh-search-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div></section>')


__all__ = ["mesh_search_section", "pipeline_section"]
