"""The top of the plan's HTML page and its tables: the header, the modules, the layer groups' memory
trade-offs (activation checkpointing) and the communication."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from autopar.plans.format import device_count, finite_float, relative_name
from autopar.plans.names import alternative_label, namer
from autopar.plans.html.cells import (
    bar_cell,
    bytes_text,
    chip,
    escape,
    full_name,
    header_cell,
    is_number,
    per_axis,
    percent,
    placement_chips,
    sort_key,
    steps_text,
    time_text,
)

if TYPE_CHECKING:
    from autopar.plans.schema import Plan

#: at most this many rows in the reshardings table (the rest are counted)
MAX_RESHARDINGS = 500
#: at most this many modules in the "bytes moved per module" chart
MAX_COMM_BARS = 40


def header_section(plan: "Plan", title: str) -> str:
    """The page's header: model, mesh, device, precision, step time and memory bars, source."""
    axes = plan.mesh.get("axes") or {}
    hw = plan.mesh.get("hardware") or {}
    g = plan.graph or {}
    prec = plan.precision or {}
    ndev = device_count(plan.mesh)
    mesh_txt = " \u00d7 ".join(f"{k}={v}" for k, v in axes.items()) or "(no axes)"
    links = plan.mesh.get("links") or {}
    link_txt = "; ".join(f"{k}: {finite_float(v.get('bandwidth')) / 1e9:g} GB/s, {time_text(v.get('latency'))} latency"
                         + "".join(f", {kind} at {finite_float(f):g}x its ring time"
                                   for kind, f in sorted((v.get("factors") or {}).items()))
                         for k, v in links.items() if isinstance(v, dict))
    inputs = g.get("inputs") or {}
    in_txt = ", ".join(f"{k} {v}" for k, v in sorted(inputs.items())) or "-"
    nparams = len(g.get("fqns") or ()) or g.get("params", "?")
    graph_fp = str((plan.fingerprint or {}).get("graph", ""))[:12] or "?"
    model_txt = (f"{nparams} parameter tensors, {g.get('nodes', '?')} graph nodes, {g.get('ops', '?')} distinct ops; "
                 f"inputs {in_txt}; graph {graph_fp}")
    device = plan.mesh.get("device", hw.get("name", "?"))
    flops = (hw.get("peak_flops") or {}).get(prec.get("compute_dtype", ""), None)
    dev_bits = [f"{ndev} devices"]
    if is_number(hw.get("memory")):
        dev_bits.append(f"{bytes_text(hw['memory'])} memory")
    if is_number(flops):
        dev_bits.append(f"{flops / 1e12:g} TFLOP/s {prec.get('compute_dtype')}")
    prec_bits = [str(prec.get("name", "?"))]
    if prec.get("compute_dtype"):
        prec_bits.append(f"compute {prec['compute_dtype']}")
    if prec.get("optimizer") and plan.training:
        prec_bits.append(f"optimizer {prec['optimizer']}")
    prec_bits.append("training" if plan.training else "inference")

    step, comp, comm = finite_float(plan.step_time), finite_float(plan.compute_time), finite_float(plan.comm_time)
    # with an overlap slowdown, comm_time also holds the compute that hidden collectives slow
    comm_label = ("exposed communication and the compute it slows" if finite_float(hw.get("overlap_slowdown")) > 0
                  else "exposed communication")
    scale = max(step, comp + comm, 1e-30)
    split = (f'<div class="split" role="img" aria-label="compute {escape(time_text(comp))}, communication {escape(time_text(comm))}">'
             f'<span class="seg seg-compute" style="width:{100 * comp / scale:.1f}%"></span>'
             f'<span class="seg seg-comm" style="width:{100 * comm / scale:.1f}%"></span></div>')
    peak, budget = finite_float(plan.peak_memory), finite_float(plan.memory_budget)
    fits = peak <= budget
    mscale = max(peak, budget, 1e-30)
    membar = (f'<div class="split" role="img" aria-label="peak memory {escape(percent(peak, budget))} of the budget">'
              f'<span class="seg seg-{"mem" if fits else "over"}" style="width:{100 * min(peak, mscale) / mscale:.1f}%"></span>'
              f'<span class="budgetmark" style="left:{100 * budget / mscale:.1f}%"></span></div>')
    verdict = '<span class="ok">fits</span>' if fits else '<span class="bad">does not fit</span>'

    s = plan.solver or {}
    solver_bits = [str(s[k]) for k in ("solver", "status") if s.get(k) is not None]
    if is_number(s.get("gap")):
        solver_bits.append(f"gap {s['gap']:.3g}")
    for k in ("variables", "constraints"):
        if isinstance(s.get(k), int):
            solver_bits.append(f"{s[k]:,} {k}")
    src = str(plan.source)
    src_txt = src + (f" (solver {', '.join(solver_bits)})" if solver_bits and src == "search" else "")
    if src.startswith("recipe:"):
        src_txt += ": the hand-written recipe, as the search found nothing faster that fits"
    best = _best_recipe(plan)
    vs = ""
    if best is not None and step > 0:
        name, bst = best
        vs = f"; best recipe that fits: {name} {time_text(bst)} ({bst / step:.2f}\u00d7 this plan's step time)"

    rows = [
        ("model", escape(model_txt)),
        ("mesh", escape(f"{mesh_txt} ({ndev} devices)") + (f'<span class="sub">{escape(link_txt)}</span>' if link_txt else "")),
        ("device", escape(f"{device}: " + ", ".join(dev_bits))),
        ("precision", escape(", ".join(prec_bits))),
        ("step time", f"<b>{escape(time_text(step))}</b>: "
                      f'<span class="key key-compute"></span>compute {escape(time_text(comp))} + '
                      f'<span class="key key-comm"></span>{comm_label} {escape(time_text(comm))}{split}'),
        *([("model FLOPs utilization", _mfu_html(plan))] if finite_float(getattr(plan, "model_flops", 0)) > 0 else []),
        ("peak memory", f"<b>{escape(bytes_text(peak))}</b> of {escape(bytes_text(budget))} per device "
                        f"({escape(percent(peak, budget))}, {verdict}){membar}"),
        ("source", escape(src_txt + vs)),
    ]
    dl = "".join(f'<div class="fact"><dt>{escape(k)}</dt><dd>{v}</dd></div>' for k, v in rows)
    return (f'<header><h1>{escape(title)}</h1><p class="lead">{escape(mesh_txt)} on {escape(device)}, '
            f'{escape(time_text(step))} per step, {escape(bytes_text(peak))} per device, source {escape(src)}</p>'
            f'<dl class="facts" id="facts">{dl}</dl></header>')


def _best_recipe(plan: "Plan") -> Optional[tuple[str, float]]:
    """(name, step time) of the fastest recipe that fits, or None."""
    cands = [(finite_float(b.get("step_time")), name) for name, b in (plan.baselines or {}).items()
             if isinstance(b, dict) and "error" not in b and b.get("fits") and is_number(b.get("step_time"))]
    if not cands:
        return None
    t, name = min(cands)
    return name, t


def _axis_cell(params: dict[str, str], path: str, axis: str, axes: tuple[str, ...]) -> str:
    """One module's parameters' placement on one mesh axis: a chip per distinct placement, naming
    the parameters when they differ."""
    groups: dict[str, list[str]] = {}
    for name in sorted(params):
        token = per_axis(params[name], axes).get(axis, "?")
        groups.setdefault(token, []).append(relative_name(name, path))
    if not groups:
        return '<td class="axis" data-v=""><span class="none">-</span></td>'
    parts = []
    for token in sorted(groups):
        names = groups[token]
        label = f"{axis}: {', '.join(names)}"
        if len(groups) == 1:
            parts.append(chip(token, label))
        else:
            parts.append(f'<span class="plg">{chip(token, label)}<span class="pn">{escape(", ".join(names))}</span></span>')
    key = "; ".join(f"{t} {','.join(n)}" for t, n in sorted(groups.items()))
    return f'<td class="axis" data-v="{escape(key)}">{"".join(parts)}</td>'


def _alternatives_cell(plan: "Plan", m: dict) -> str:
    """A module's alternatives, cheapest first, folded under their count."""
    alts = [a for a in (m.get("alternatives") or []) if isinstance(a, dict)]
    if not alts:
        return '<td class="num" data-v="-1"><span class="none">-</span></td>'
    alts = sorted(alts, key=lambda a: (finite_float(a.get("delta")), str(a.get("name"))))
    best = finite_float(alts[0].get("delta"))
    items = "".join(
        f'<li><span class="delta">{"+" if finite_float(a.get("delta")) >= 0 else ""}{escape(time_text(finite_float(a.get("delta"))))}</span> '
        f'{escape(alternative_label(plan, a.get("name")))} '
        f'<span class="sub">(compute {escape(time_text(a.get("time")))}, '
        f'communication {escape(time_text(a.get("comm")))})</span></li>' for a in alts)
    return (f'<td class="num alts" data-v="{sort_key(best)}"><details><summary>{len(alts)}: best '
            f'{"+" if best >= 0 else ""}{escape(time_text(best))}</summary><ol>{items}</ol></details></td>')


def modules_section(plan: "Plan") -> str:
    """The modules table (placements per mesh axis, times, bytes, memory, alternatives)."""
    axes = plan.axis_names
    mods = [m for m in plan.modules if isinstance(m, dict)]
    tmax = max([finite_float(m.get("time")) for m in mods] + [0.0])
    cmax = max([finite_float(m.get("comm")) for m in mods] + [0.0])
    bmax = max([finite_float(m.get("bytes")) for m in mods] + [0.0])
    mmax = max([finite_float(m.get("memory")) for m in mods] + [0.0])
    head = (header_cell("#", "order", num=True, title="graph order") + header_cell("module", "module")
            + "".join(header_cell(ax, f"axis:{ax}", title=f"placement of the module's parameters on mesh axis {ax} "
                          f"({plan.mesh.get('axes', {}).get(ax)} devices)") for ax in axes)
            + header_cell("compute", "time", num=True, title="compute time of the module's ops (forward and backward)")
            + header_cell("comm", "comm", num=True, title="communication time of the reshardings into the module's ops "
                  "(before overlap with compute)")
            + header_cell("bytes moved", "bytes", num=True, title="bytes the module's reshardings move")
            + header_cell("memory", "memory", num=True, title="memory per device of the module's parameters, gradients, "
                  "optimizer state and activations")
            + header_cell("alternatives", "alternatives", num=True, title="other strategies and how much they would add "
                  "to the step time"))
    body = []
    for i, m in enumerate(mods):
        path = str(m.get("path") or "")
        params = {str(k): str(v) for k, v in (m.get("placements") or {}).items()}
        label = f"<code>{escape(path)}</code>" if path else '<span class="root">(root)</span>'
        body.append(
            f'<tr data-path="{escape(path)}"><td class="num" data-v="{i}">{i}</td>'
            f'<td class="mod" data-v="{escape(path)}">{label}</td>'
            + "".join(_axis_cell(params, path, ax, axes) for ax in axes)
            + bar_cell(m.get("time"), time_text(m.get("time")), tmax, "b-time")
            + bar_cell(m.get("comm"), time_text(m.get("comm")), cmax, "b-comm")
            + bar_cell(m.get("bytes"), bytes_text(m.get("bytes")), bmax, "b-comm")
            + bar_cell(m.get("memory"), bytes_text(m.get("memory")), mmax, "b-mem")
            + _alternatives_cell(plan, m) + "</tr>")
    tot = [sum(finite_float(m.get(k)) for m in mods) for k in ("time", "comm", "bytes", "memory")]
    foot = (f'<tr><td></td><th scope="row">total ({len(mods)} modules)</th>{"<td></td>" * len(axes)}'
            f'<td class="num">{escape(time_text(tot[0]))}</td><td class="num">{escape(time_text(tot[1]))}</td>'
            f'<td class="num">{escape(bytes_text(tot[2]))}</td><td class="num">{escape(bytes_text(tot[3]))}</td><td></td></tr>')
    table = (f'<table class="sortable" id="modules"><thead><tr>{head}</tr></thead>'
             f'<tbody>{"".join(body)}</tbody><tfoot>{foot}</tfoot></table>')
    legend = ('<p class="legend">placement on each mesh axis: ' + chip("S(d)") + " split along dim d, "
              + chip("B") + " broadcast (every device holds it whole), " + chip("P") + " partial (a sum still to "
              "be reduced); when a module's parameters differ, each placement names its parameters.</p>")
    return (f'<section id="modules-section"><h2>Modules</h2>{legend}<div class="scroll">{table}</div>'
            f'{_other_placements(plan)}</section>')


def _other_placements(plan: "Plan") -> str:
    """Placements of inputs and of parameters no module row lists (tied weights)."""
    axes = plan.axis_names
    listed = set()
    for m in plan.modules:
        if isinstance(m, dict):
            path = str(m.get("path") or "")
            listed |= {full_name(str(k), path) for k in (m.get("placements") or {})}
    rest = {k: v for k, v in plan.placements.items() if k not in listed}
    if not rest:
        return ""
    rows = "".join(
        f'<tr><td class="mod" data-v="{escape(k)}"><code>{escape(k)}</code></td>'
        + "".join(_axis_cell({k: str(v)}, "", ax, axes) for ax in axes) + "</tr>"
        for k, v in sorted(rest.items()))
    head = header_cell("input or parameter", "name") + "".join(header_cell(ax, f"axis:{ax}") for ax in axes)
    return (f'<h3>Inputs and other placements</h3><div class="scroll"><table class="sortable" id="placements">'
            f'<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>')


def communication_section(plan: "Plan") -> str:
    """Bytes moved per module, the collectives and the reshardings."""
    out = ['<section id="communication"><h2>Communication</h2>']
    mods = [m for m in plan.modules if isinstance(m, dict) and finite_float(m.get("bytes")) > 0]
    total = sum(finite_float(m.get("bytes")) for m in mods)
    if mods:
        top = sorted(mods, key=lambda m: -finite_float(m.get("bytes")))[:MAX_COMM_BARS]
        shown = {id(m) for m in top}
        mods_in_order = [m for m in mods if id(m) in shown]
        bmax = max(finite_float(m.get("bytes")) for m in mods_in_order)
        rows = "".join(
            f'<div class="hrow"><span class="hlabel" title="{escape(m.get("path") or "(root)")}">'
            f'{escape(m.get("path") or "(root)")}</span><span class="htrack"><span class="hbar b-comm" '
            f'style="width:{100 * finite_float(m.get("bytes")) / bmax:.1f}%"></span></span>'
            f'<span class="hval">{escape(bytes_text(m.get("bytes")))} ({escape(percent(finite_float(m.get("bytes")), total))}), '
            f'{escape(time_text(m.get("comm")))}</span></div>' for m in mods_in_order)
        more = (f'<p class="sub">{len(mods) - len(mods_in_order)} more modules move less.</p>'
                if len(mods) > len(mods_in_order) else "")
        out.append(f'<h3>Bytes moved per module</h3><p class="sub">{escape(bytes_text(total))} in all, in graph order.</p>'
                   f'<div class="hchart" id="comm-modules">{rows}</div>{more}')
    else:
        out.append('<p>No module moves any data: every op reads its inputs where they are.</p>')

    cols = [c for c in plan.collectives if isinstance(c, dict)]
    if cols:
        tmax = max(finite_float(c.get("bytes")) * finite_float(c.get("count"), 1) for c in cols)
        rows = "".join(
            f'<tr><td data-v="{escape(c.get("kind"))}">{escape(c.get("kind"))}</td><td data-v="{escape(c.get("axis"))}">'
            f'{escape(c.get("axis"))}</td><td>{escape(c.get("phase", ""))}</td>'
            f'<td>{"yes" if c.get("bucketed") else "no"}</td>'
            f'<td class="num" data-v="{sort_key(c.get("bytes"))}">{escape(bytes_text(c.get("bytes")))}</td>'
            f'<td class="num" data-v="{sort_key(c.get("count", 1))}">{escape(c.get("count", 1))}</td>'
            + bar_cell(finite_float(c.get("bytes")) * finite_float(c.get("count"), 1),
                        bytes_text(finite_float(c.get("bytes")) * finite_float(c.get("count"), 1)), tmax, "b-comm") + "</tr>"
            for c in cols)
        head = (header_cell("kind", "kind") + header_cell("axis", "axis") + header_cell("phase", "phase") + header_cell("bucketed", "bucketed")
                + header_cell("bytes per call", "bytes", num=True) + header_cell("count", "count", num=True)
                + header_cell("total", "total", num=True))
        out.append(f'<h3>Collectives</h3><p class="sub">bucket size {escape(bytes_text(plan.bucket_size))}</p>'
                   f'<div class="scroll"><table class="sortable" id="collectives"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{rows}</tbody></table></div>')
    else:
        out.append('<h3>Collectives</h3><p>none</p>')

    rs = [r for r in plan.reshardings if isinstance(r, dict)]
    if rs:
        shown = rs[:MAX_RESHARDINGS]
        name = namer(plan)
        rows = "".join(
            f'<tr><td data-v="{escape(r.get("module", ""))}"><code>{escape(r.get("module") if r.get("module") is not None else "-")}'
            f'</code></td><td>{escape(r.get("kind", ""))}</td><td><code>{escape(name(r.get("tensor"), r))}</code></td>'
            f'<td><code>{escape(name(r.get("consumer")))}</code></td>'
            f'<td data-v="{escape(r.get("from"))}">{placement_chips(r.get("from"))} \u2192 {placement_chips(r.get("to"))}</td>'
            f'<td class="num" data-v="{sort_key(r.get("bytes"))}">{escape(bytes_text(r.get("bytes")))}</td>'
            f'<td class="num" data-v="{sort_key(r.get("time"))}">{escape(time_text(r.get("time")))}</td>'
            f'<td>{escape(steps_text(r.get("steps") or ()))}</td></tr>' for r in shown)
        head = (header_cell("module", "module") + header_cell("kind", "kind") + header_cell("tensor", "tensor") + header_cell("consumer", "consumer")
                + header_cell("from \u2192 to", "fromto") + header_cell("tensor bytes", "bytes", num=True)
                + header_cell("time", "time", num=True) + header_cell("steps", "steps"))
        more = (f'<p class="sub">{len(rs) - len(shown)} more reshardings not shown.</p>'
                if len(rs) > len(shown) else "")
        out.append(f'<details id="reshardings-details"><summary>Reshardings ({len(rs)})</summary>'
                   f'<div class="scroll"><table class="sortable" id="reshardings"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{rows}</tbody></table></div>{more}</details>')
    out.append("</section>")
    return "".join(out)


def layer_groups_section(plan: "Plan") -> str:
    """Per group of alike layers: how many instances recompute their activations, in which mode, and
    what that saves and costs (per instance and in all); empty when the model has no such group."""
    groups = [g for g in getattr(plan, "layer_groups", None) or [] if isinstance(g, dict)]
    if not groups:
        return ""
    rows = []
    for g in groups:
        k, n = int(finite_float(g.get("checkpointed"))), int(finite_float(g.get("count")))
        saved, kept = finite_float(g.get("saved_bytes")), finite_float(g.get("input_bytes"))
        rerun = finite_float(g.get("recompute_time"))
        paths = [str(p) for p in g.get("paths") or []]
        held = int(finite_float(g.get("kept", n if g.get("kept_gathers") else 0)))
        kb, kt = finite_float(g.get("kept_bytes")), finite_float(g.get("kept_time"))
        which = (f"{escape(paths[0])}" + (f" .. {escape(paths[k - 1])}" if k > 1 else "")) if k and paths else "-"
        rows.append(
            f'<tr><td><code>{escape(g.get("prefix") or "(root)")}</code></td>'
            f'<td class="num" data-v="{sort_key(k)}">{k} of {n}</td><td>{escape(g.get("mode", "none"))}</td>'
            f'<td><code>{which}</code></td>'
            f'<td class="num" data-v="{sort_key(saved)}">{escape(bytes_text(saved))}</td>'
            f'<td class="num" data-v="{sort_key(kept)}">{escape(bytes_text(kept))}</td>'
            f'<td class="num" data-v="{sort_key(rerun)}">{escape(time_text(rerun))}</td>'
            f'<td class="num" data-v="{sort_key(k * (saved - kept))}">{escape(bytes_text(k * (saved - kept)))}</td>'
            f'<td class="num" data-v="{sort_key(k * rerun)}">{escape(time_text(k * rerun))}</td>'
            f'<td class="num" data-v="{sort_key(held)}">{held} of {n}</td>'
            f'<td class="num" data-v="{sort_key(kb)}">{escape(bytes_text(kb))}</td>'
            f'<td class="num" data-v="{sort_key(kt)}">{escape(time_text(kt))}</td></tr>')
    head = "".join(header_cell(label, key, num=num) for label, key, num in (
        ("layers", "prefix", False), ("recomputed", "k", True), ("mode", "mode", False),
        ("instances", "which", False), ("saved per instance", "saved", True), ("kept if recomputed", "kept", True),
        ("re-run per instance", "rerun", True), ("memory saved", "less", True), ("time added", "more", True),
        ("gathers kept", "held", True), ("kept bytes per instance", "keptbytes", True),
        ("backward gathers saved per instance", "gathersaved", True)))
    return ('<section id="layer-groups"><h2>Activation checkpointing</h2><p class="sub">Per group of alike '
            'layers: the first instances recompute their forward in the backward; a recomputed instance keeps '
            'only its inputs (and, selective, the attention and every other matmul output). An instance that '
            'keeps its gathers holds its parameters gathered in the forward until the backward, which then '
            'does not gather them again.</p>'
            f'<div class="scroll"><table class="sortable" id="layer-groups-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div></section>')


__all__ = ["MAX_COMM_BARS", "MAX_RESHARDINGS", "communication_section", "header_section", "layer_groups_section",
           "modules_section"]


def _mfu_html(plan) -> str:
    """MFU, model FLOPs per step and tokens/s per device (schema version 5 plans)."""
    text = (f"<b>{100 * finite_float(plan.mfu):.1f}%</b>: model FLOPs {finite_float(plan.model_flops):.3g} per step "
            "(3 \u00d7 the forward's matmuls and attention, recomputation not counted)")
    if getattr(plan, "tokens_per_step", 0):
        text += escape(f", {finite_float(plan.tokens_per_second_per_device):,.0f} tokens/s per device")
    return text
