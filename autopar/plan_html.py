"""A Plan as one self-contained HTML page: ``render_html(plan)`` and ``write_html(plan, path)``.

The page needs nothing but a browser: CSS and a small script are inline, charts are inline SVG or
CSS bars, and a Content-Security-Policy forbids every network fetch. It shows

* the header: model (graph summary), mesh, device, precision, step time split into compute and
  communication, peak memory against the budget, where the plan came from (search or a recipe);
* the modules in graph order with their parameters' placement on each mesh axis (S/B/P
  color-coded), compute time, communication time, bytes moved and memory, plus the alternatives;
* where communication happens: bytes moved per module, the collectives (kind, axis, bytes,
  count) and the reshardings with their steps;
* the memory per device (params, grads, optimizer, activations stacked against the budget);
* the plan against the hand-written recipes (step time bars; recipes that don't fit are marked,
  recipes that could not be applied are listed with their error).

Tables sort by clicking their headers; ``#sort=TABLE:COLUMN:asc|desc`` in the address sorts one on
load. Every text from the plan is escaped (module paths are user-controlled). The output is
deterministic: the plan is rendered from its canonical JSON form (the bytes ``Plan.save`` writes,
without wall-clock timings), so the same plan, or the same plan saved and loaded again, gives the
same bytes.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

from autopar.ir.placement import split_top_level
from autopar.plan import PlanError, human_bytes, human_time

if TYPE_CHECKING:
    from autopar.plan import Plan

#: memory components in display order (others a plan may carry follow, sorted)
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
#: at most this many rows in the reshardings table (the rest are counted)
MAX_RESHARDINGS = 500
#: at most this many modules in the "bytes moved per module" chart
MAX_COMM_BARS = 40


# -- small helpers ------------------------------------------------------------------------------------

def _e(x: Any) -> str:
    """Escaped text for element content and attribute values."""
    return html.escape(str(x), quote=True)


def _num(x: Any, default: float = 0.0) -> float:
    """A finite float, or ``default``."""
    try:
        f = float(x)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


def _v(x: Any) -> str:
    """The sort key of a numeric cell (``data-v``)."""
    return format(_num(x), ".12g")


def _f(x: float) -> str:
    """An SVG coordinate: two decimals, no ``-0.00``."""
    s = f"{x:.2f}"
    return "0.00" if s == "-0.00" else s


def _pct(part: float, whole: float) -> str:
    """``"12.5%"``; below 0.1% two significant digits (``"0.0045%"``) so a small share is not 0.0%."""
    if not whole > 0:
        return "-"
    x = 100.0 * part / whole
    return f"{x:.2g}%" if 0 < abs(x) < 0.1 else f"{x:.1f}%"


def _time(x: Any) -> str:
    return human_time(x) if _finite(x) else "-"


def _bytes(x: Any) -> str:
    return human_bytes(x) if _finite(x) else "-"


def _entries(text: str) -> list[str]:
    """``"S(0), P(max)"`` -> ``["S(0)", "P(max)"]``: the non-empty entries, stripped."""
    return [p.strip() for p in split_top_level(text) if p.strip()]


def _per_axis(placement: Any, axes: tuple[str, ...]) -> dict[str, str]:
    """``"S(0), B"`` over ``("dp", "tp")`` -> ``{"dp": "S(0)", "tp": "B"}``; the named form
    ``"dp=S(0), tp=B"`` too. Axes a placement does not mention are left out."""
    parts = _entries(str(placement))
    if parts and all("=" in p for p in parts):
        named = {}
        for p in parts:
            name, _, value = p.partition("=")
            named[name.strip()] = value.strip()
        return named
    return {ax: parts[i] for i, ax in enumerate(axes) if i < len(parts)}


def _kind(token: str) -> str:
    """CSS class suffix of a placement token: S, B, P or X (unknown)."""
    head = token[:1].upper()
    return head if head in ("S", "B", "P") else "X"


def _chip(token: str, title: str = "") -> str:
    t = f' title="{_e(title)}"' if title else ""
    return f'<span class="pl pl-{_kind(token)}"{t}>{_e(token)}</span>'


def _rel(name: str, path: str) -> str:
    return name[len(path) + 1:] if path and name.startswith(path + ".") else name


def _fqn(name: str, path: str) -> str:
    if not path or name.startswith(path + "."):
        return name
    return f"{path}.{name}"


def _devices(mesh: dict) -> int:
    n = 1
    for v in (mesh.get("axes") or {}).values():
        n *= int(_num(v, 1))
    return n


def _canonical(plan: "Plan") -> "Plan":
    """The plan as ``Plan.save`` would write and ``load_plan`` read it back: floats rounded to 12
    significant digits, dict keys sorted (mesh axis order kept), wall-clock timings left out."""
    from autopar.plan import Plan

    try:
        return Plan.from_dict(json.loads(plan.to_json(timing=False)))
    except (PlanError, TypeError, ValueError):  # a hand-made plan that cannot be saved: show it as it is
        return plan


# -- page parts -----------------------------------------------------------------------------------------

def _th(label: str, key: str, num: bool = False, title: str = "") -> str:
    t = f' title="{_e(title)}"' if title else ""
    typ = ' data-type="num"' if num else ""
    return f'<th scope="col" data-key="{_e(key)}"{typ}{t}>{_e(label)}</th>'


def _bar_cell(value: Any, text: str, scale: float, cls: str = "") -> str:
    w = 100.0 * _num(value) / scale if scale > 0 else 0.0
    c = f" {cls}" if cls else ""
    return (f'<td class="num" data-v="{_v(value)}"><span class="cellbar{c}" style="width:{w:.1f}%"></span>'
            f'<span class="cellval">{_e(text)}</span></td>')


def _header(plan: "Plan", title: str) -> str:
    axes = plan.mesh.get("axes") or {}
    hw = plan.mesh.get("hardware") or {}
    g = plan.graph or {}
    prec = plan.precision or {}
    ndev = _devices(plan.mesh)
    mesh_txt = " \u00d7 ".join(f"{k}={v}" for k, v in axes.items()) or "(no axes)"
    links = plan.mesh.get("links") or {}
    link_txt = "; ".join(f"{k}: {_num(v.get('bandwidth')) / 1e9:g} GB/s, {_time(v.get('latency'))} latency"
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
    if _finite(hw.get("memory")):
        dev_bits.append(f"{_bytes(hw['memory'])} memory")
    if _finite(flops):
        dev_bits.append(f"{flops / 1e12:g} TFLOP/s {prec.get('compute_dtype')}")
    prec_bits = [str(prec.get("name", "?"))]
    if prec.get("compute_dtype"):
        prec_bits.append(f"compute {prec['compute_dtype']}")
    if prec.get("optimizer") and plan.training:
        prec_bits.append(f"optimizer {prec['optimizer']}")
    prec_bits.append("training" if plan.training else "inference")

    step, comp, comm = _num(plan.step_time), _num(plan.compute_time), _num(plan.comm_time)
    scale = max(step, comp + comm, 1e-30)
    split = (f'<div class="split" role="img" aria-label="compute {_e(_time(comp))}, communication {_e(_time(comm))}">'
             f'<span class="seg seg-compute" style="width:{100 * comp / scale:.1f}%"></span>'
             f'<span class="seg seg-comm" style="width:{100 * comm / scale:.1f}%"></span></div>')
    peak, budget = _num(plan.peak_memory), _num(plan.memory_budget)
    fits = peak <= budget
    mscale = max(peak, budget, 1e-30)
    membar = (f'<div class="split" role="img" aria-label="peak memory {_e(_pct(peak, budget))} of the budget">'
              f'<span class="seg seg-{"mem" if fits else "over"}" style="width:{100 * min(peak, mscale) / mscale:.1f}%"></span>'
              f'<span class="budgetmark" style="left:{100 * budget / mscale:.1f}%"></span></div>')
    verdict = '<span class="ok">fits</span>' if fits else '<span class="bad">does not fit</span>'

    s = plan.solver or {}
    solver_bits = [str(s[k]) for k in ("solver", "status") if s.get(k) is not None]
    if _finite(s.get("gap")):
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
        vs = f"; best recipe that fits: {name} {_time(bst)} ({bst / step:.2f}\u00d7 this plan's step time)"

    rows = [
        ("model", _e(model_txt)),
        ("mesh", _e(f"{mesh_txt} ({ndev} devices)") + (f'<span class="sub">{_e(link_txt)}</span>' if link_txt else "")),
        ("device", _e(f"{device}: " + ", ".join(dev_bits))),
        ("precision", _e(", ".join(prec_bits))),
        ("step time", f"<b>{_e(_time(step))}</b>: "
                      f'<span class="key key-compute"></span>compute {_e(_time(comp))} + '
                      f'<span class="key key-comm"></span>exposed communication {_e(_time(comm))}{split}'),
        ("peak memory", f"<b>{_e(_bytes(peak))}</b> of {_e(_bytes(budget))} per device "
                        f"({_e(_pct(peak, budget))}, {verdict}){membar}"),
        ("source", _e(src_txt + vs)),
    ]
    dl = "".join(f'<div class="fact"><dt>{_e(k)}</dt><dd>{v}</dd></div>' for k, v in rows)
    return (f'<header><h1>{_e(title)}</h1><p class="lead">{_e(mesh_txt)} on {_e(device)}, '
            f'{_e(_time(step))} per step, {_e(_bytes(peak))} per device, source {_e(src)}</p>'
            f'<dl class="facts" id="facts">{dl}</dl></header>')


def _best_recipe(plan: "Plan") -> Optional[tuple[str, float]]:
    cands = [(_num(b.get("step_time")), name) for name, b in (plan.baselines or {}).items()
             if isinstance(b, dict) and "error" not in b and b.get("fits") and _finite(b.get("step_time"))]
    if not cands:
        return None
    t, name = min(cands)
    return name, t


def _axis_cell(params: dict[str, str], path: str, axis: str, axes: tuple[str, ...]) -> str:
    """One module's parameters' placement on one mesh axis: a chip per distinct placement, naming
    the parameters when they differ."""
    groups: dict[str, list[str]] = {}
    for name in sorted(params):
        token = _per_axis(params[name], axes).get(axis, "?")
        groups.setdefault(token, []).append(_rel(name, path))
    if not groups:
        return '<td class="axis" data-v=""><span class="none">-</span></td>'
    parts = []
    for token in sorted(groups):
        names = groups[token]
        label = f"{axis}: {', '.join(names)}"
        if len(groups) == 1:
            parts.append(_chip(token, label))
        else:
            parts.append(f'<span class="plg">{_chip(token, label)}<span class="pn">{_e(", ".join(names))}</span></span>')
    key = "; ".join(f"{t} {','.join(n)}" for t, n in sorted(groups.items()))
    return f'<td class="axis" data-v="{_e(key)}">{"".join(parts)}</td>'


def _alternatives_cell(m: dict) -> str:
    alts = [a for a in (m.get("alternatives") or []) if isinstance(a, dict)]
    if not alts:
        return '<td class="num" data-v="-1"><span class="none">-</span></td>'
    alts = sorted(alts, key=lambda a: (_num(a.get("delta")), str(a.get("name"))))
    best = _num(alts[0].get("delta"))
    items = "".join(
        f'<li><span class="delta">{"+" if _num(a.get("delta")) >= 0 else ""}{_e(_time(_num(a.get("delta"))))}</span> '
        f'{_e(a.get("name"))} <span class="sub">(compute {_e(_time(a.get("time")))}, '
        f'communication {_e(_time(a.get("comm")))})</span></li>' for a in alts)
    return (f'<td class="num alts" data-v="{_v(best)}"><details><summary>{len(alts)}: best '
            f'{"+" if best >= 0 else ""}{_e(_time(best))}</summary><ol>{items}</ol></details></td>')


def _modules(plan: "Plan") -> str:
    axes = plan.axis_names
    mods = [m for m in plan.modules if isinstance(m, dict)]
    tmax = max([_num(m.get("time")) for m in mods] + [0.0])
    cmax = max([_num(m.get("comm")) for m in mods] + [0.0])
    bmax = max([_num(m.get("bytes")) for m in mods] + [0.0])
    mmax = max([_num(m.get("memory")) for m in mods] + [0.0])
    head = (_th("#", "order", num=True, title="graph order") + _th("module", "module")
            + "".join(_th(ax, f"axis:{ax}", title=f"placement of the module's parameters on mesh axis {ax} "
                          f"({plan.mesh.get('axes', {}).get(ax)} devices)") for ax in axes)
            + _th("compute", "time", num=True, title="compute time of the module's ops (forward and backward)")
            + _th("comm", "comm", num=True, title="communication time of the reshardings into the module's ops "
                  "(before overlap with compute)")
            + _th("bytes moved", "bytes", num=True, title="bytes the module's reshardings move")
            + _th("memory", "memory", num=True, title="memory per device of the module's parameters, gradients, "
                  "optimizer state and activations")
            + _th("alternatives", "alternatives", num=True, title="other strategies and how much they would add "
                  "to the step time"))
    body = []
    for i, m in enumerate(mods):
        path = str(m.get("path") or "")
        params = {str(k): str(v) for k, v in (m.get("placements") or {}).items()}
        label = f"<code>{_e(path)}</code>" if path else '<span class="root">(root)</span>'
        body.append(
            f'<tr data-path="{_e(path)}"><td class="num" data-v="{i}">{i}</td>'
            f'<td class="mod" data-v="{_e(path)}">{label}</td>'
            + "".join(_axis_cell(params, path, ax, axes) for ax in axes)
            + _bar_cell(m.get("time"), _time(m.get("time")), tmax, "b-time")
            + _bar_cell(m.get("comm"), _time(m.get("comm")), cmax, "b-comm")
            + _bar_cell(m.get("bytes"), _bytes(m.get("bytes")), bmax, "b-comm")
            + _bar_cell(m.get("memory"), _bytes(m.get("memory")), mmax, "b-mem")
            + _alternatives_cell(m) + "</tr>")
    tot = [sum(_num(m.get(k)) for m in mods) for k in ("time", "comm", "bytes", "memory")]
    foot = (f'<tr><td></td><th scope="row">total ({len(mods)} modules)</th>{"<td></td>" * len(axes)}'
            f'<td class="num">{_e(_time(tot[0]))}</td><td class="num">{_e(_time(tot[1]))}</td>'
            f'<td class="num">{_e(_bytes(tot[2]))}</td><td class="num">{_e(_bytes(tot[3]))}</td><td></td></tr>')
    table = (f'<table class="sortable" id="modules"><thead><tr>{head}</tr></thead>'
             f'<tbody>{"".join(body)}</tbody><tfoot>{foot}</tfoot></table>')
    legend = ('<p class="legend">placement on each mesh axis: ' + _chip("S(d)") + " split along dim d, "
              + _chip("B") + " broadcast (every device holds it whole), " + _chip("P") + " partial (a sum still to "
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
            listed |= {_fqn(str(k), path) for k in (m.get("placements") or {})}
    rest = {k: v for k, v in plan.placements.items() if k not in listed}
    if not rest:
        return ""
    rows = "".join(
        f'<tr><td class="mod" data-v="{_e(k)}"><code>{_e(k)}</code></td>'
        + "".join(_axis_cell({k: str(v)}, "", ax, axes) for ax in axes) + "</tr>"
        for k, v in sorted(rest.items()))
    head = _th("input or parameter", "name") + "".join(_th(ax, f"axis:{ax}") for ax in axes)
    return (f'<h3>Inputs and other placements</h3><div class="scroll"><table class="sortable" id="placements">'
            f'<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>')


def _communication(plan: "Plan") -> str:
    out = ['<section id="communication"><h2>Communication</h2>']
    mods = [m for m in plan.modules if isinstance(m, dict) and _num(m.get("bytes")) > 0]
    total = sum(_num(m.get("bytes")) for m in mods)
    if mods:
        top = sorted(mods, key=lambda m: -_num(m.get("bytes")))[:MAX_COMM_BARS]
        shown = {id(m) for m in top}
        mods_in_order = [m for m in mods if id(m) in shown]
        bmax = max(_num(m.get("bytes")) for m in mods_in_order)
        rows = "".join(
            f'<div class="hrow"><span class="hlabel" title="{_e(m.get("path") or "(root)")}">'
            f'{_e(m.get("path") or "(root)")}</span><span class="htrack"><span class="hbar b-comm" '
            f'style="width:{100 * _num(m.get("bytes")) / bmax:.1f}%"></span></span>'
            f'<span class="hval">{_e(_bytes(m.get("bytes")))} ({_e(_pct(_num(m.get("bytes")), total))}), '
            f'{_e(_time(m.get("comm")))}</span></div>' for m in mods_in_order)
        more = (f'<p class="sub">{len(mods) - len(mods_in_order)} more modules move less.</p>'
                if len(mods) > len(mods_in_order) else "")
        out.append(f'<h3>Bytes moved per module</h3><p class="sub">{_e(_bytes(total))} in all, in graph order.</p>'
                   f'<div class="hchart" id="comm-modules">{rows}</div>{more}')
    else:
        out.append('<p>No module moves any data: every op reads its inputs where they are.</p>')

    cols = [c for c in plan.collectives if isinstance(c, dict)]
    if cols:
        tmax = max(_num(c.get("bytes")) * _num(c.get("count"), 1) for c in cols)
        rows = "".join(
            f'<tr><td data-v="{_e(c.get("kind"))}">{_e(c.get("kind"))}</td><td data-v="{_e(c.get("axis"))}">'
            f'{_e(c.get("axis"))}</td><td>{_e(c.get("phase", ""))}</td>'
            f'<td>{"yes" if c.get("bucketed") else "no"}</td>'
            f'<td class="num" data-v="{_v(c.get("bytes"))}">{_e(_bytes(c.get("bytes")))}</td>'
            f'<td class="num" data-v="{_v(c.get("count", 1))}">{_e(c.get("count", 1))}</td>'
            + _bar_cell(_num(c.get("bytes")) * _num(c.get("count"), 1),
                        _bytes(_num(c.get("bytes")) * _num(c.get("count"), 1)), tmax, "b-comm") + "</tr>"
            for c in cols)
        head = (_th("kind", "kind") + _th("axis", "axis") + _th("phase", "phase") + _th("bucketed", "bucketed")
                + _th("bytes per call", "bytes", num=True) + _th("count", "count", num=True)
                + _th("total", "total", num=True))
        out.append(f'<h3>Collectives</h3><p class="sub">bucket size {_e(_bytes(plan.bucket_size))}</p>'
                   f'<div class="scroll"><table class="sortable" id="collectives"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{rows}</tbody></table></div>')
    else:
        out.append('<h3>Collectives</h3><p>none</p>')

    rs = [r for r in plan.reshardings if isinstance(r, dict)]
    if rs:
        shown = rs[:MAX_RESHARDINGS]
        rows = "".join(
            f'<tr><td data-v="{_e(r.get("module", ""))}"><code>{_e(r.get("module") if r.get("module") is not None else "-")}'
            f'</code></td><td>{_e(r.get("kind", ""))}</td><td><code>{_e(r.get("tensor"))}</code></td>'
            f'<td><code>{_e(r.get("consumer"))}</code></td>'
            f'<td data-v="{_e(r.get("from"))}">{_placement_chips(r.get("from"))} \u2192 {_placement_chips(r.get("to"))}</td>'
            f'<td class="num" data-v="{_v(r.get("bytes"))}">{_e(_bytes(r.get("bytes")))}</td>'
            f'<td class="num" data-v="{_v(r.get("time"))}">{_e(_time(r.get("time")))}</td>'
            f'<td>{_e(_steps(r.get("steps") or ()))}</td></tr>' for r in shown)
        head = (_th("module", "module") + _th("kind", "kind") + _th("tensor", "tensor") + _th("consumer", "consumer")
                + _th("from \u2192 to", "fromto") + _th("tensor bytes", "bytes", num=True)
                + _th("time", "time", num=True) + _th("steps", "steps"))
        more = (f'<p class="sub">{len(rs) - len(shown)} more reshardings not shown.</p>'
                if len(rs) > len(shown) else "")
        out.append(f'<details id="reshardings-details"><summary>Reshardings ({len(rs)})</summary>'
                   f'<div class="scroll"><table class="sortable" id="reshardings"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{rows}</tbody></table></div>{more}</details>')
    out.append("</section>")
    return "".join(out)


def _placement_chips(text: Any) -> str:
    if text is None:
        return '<span class="none">-</span>'
    parts = _entries(str(text))
    return '<span class="chips">' + "".join(_chip(p) for p in parts) + "</span>" if parts else _e(text)


def _steps(steps: Iterable[Any]) -> str:
    out = [f"{s.get('kind')} on {s.get('axis')} {_bytes(s.get('bytes'))} {_time(s.get('time'))}"
           for s in steps if isinstance(s, dict)]
    return ", ".join(out) or "local (no communication)"


def _memory_parts(plan: "Plan") -> list[tuple[str, float]]:
    mem = plan.memory or {}
    keys = [k for k in MEMORY_PARTS if k in mem] + sorted(k for k in mem if k not in MEMORY_PARTS)
    return [(k, _num(mem[k])) for k in keys]


def _memory(plan: "Plan") -> str:
    parts = _memory_parts(plan)
    total = sum(v for _, v in parts)
    peak, budget = _num(plan.peak_memory), _num(plan.memory_budget)
    W, LW, BW = 720.0, 110.0, 560.0  # width, label width, bar width
    scale = max(total, peak, budget, 1e-30)
    svg = [f'<svg class="chart" id="memory-chart" width="{_f(W)}" height="112" viewBox="0 0 {_f(W)} 112" role="img" '
           f'aria-label="memory per device against the budget">']

    def stack(y: float, sc: float, label: str) -> None:
        svg.append(f'<text x="0" y="{_f(y + 15)}" class="lbl">{_e(label)}</text>')
        x = LW
        svg.append(f'<rect x="{_f(LW)}" y="{_f(y)}" width="{_f(BW)}" height="22" class="track"/>')
        for k, v in parts:
            w = BW * v / sc if sc > 0 else 0.0
            svg.append(f'<rect x="{_f(x)}" y="{_f(y)}" width="{_f(w)}" height="22" class="mseg m-{_e(_css(k))}">'
                       f'<title>{_e(k)} {_e(_bytes(v))} ({_e(_pct(v, total))} of the total)</title></rect>')
            x += w

    stack(8, scale, "vs budget")
    bx = LW + BW * budget / scale
    px = LW + BW * peak / scale
    svg.append(f'<line x1="{_f(bx)}" y1="2" x2="{_f(bx)}" y2="36" class="budget"/>'
               f'<text x="{_f(min(bx, LW + BW) - 2)}" y="46" class="note" text-anchor="end">budget '
               f'{_e(_bytes(budget))}</text>')
    svg.append(f'<line x1="{_f(px)}" y1="4" x2="{_f(px)}" y2="34" class="peak"><title>peak {_e(_bytes(peak))}</title></line>')
    stack(62, max(total, peak, 1e-30), "breakdown")
    px2 = LW + BW * peak / max(total, peak, 1e-30)
    svg.append(f'<line x1="{_f(px2)}" y1="58" x2="{_f(px2)}" y2="88" class="peak"/>'
               f'<text x="{_f(LW)}" y="104" class="note">peak {_e(_bytes(peak))} = {_e(_pct(peak, budget))} '
               f'of the budget ({"fits" if peak <= budget else "DOES NOT FIT"})</text>')
    svg.append("</svg>")
    rows = "".join(
        f'<tr><td><span class="swatch m-{_e(_css(k))}"></span>{_e(k)}</td><td class="num" data-v="{_v(v)}">'
        f'{_e(_bytes(v))}</td><td class="num" data-v="{_v(v)}">{_e(_pct(v, total))}</td>'
        f'<td class="num" data-v="{_v(v)}">{_e(_pct(v, budget))}</td></tr>' for k, v in parts)
    head = (_th("component", "component") + _th("per device", "bytes", num=True)
            + _th("of the total", "share", num=True) + _th("of the budget", "budget", num=True))
    foot = (f'<tr><th scope="row">total</th><td class="num">{_e(_bytes(total))}</td><td></td>'
            f'<td class="num">{_e(_pct(total, budget))}</td></tr>'
            f'<tr><th scope="row">peak</th><td class="num">{_e(_bytes(peak))}</td><td></td>'
            f'<td class="num">{_e(_pct(peak, budget))}</td></tr>')
    return (f'<section id="memory"><h2>Memory per device</h2>{"".join(svg)}'
            f'<table class="sortable" id="memory-table"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>'
            f'<tfoot>{foot}</tfoot></table></section>')


def _css(name: str) -> str:
    return re.sub(r"[^a-z0-9_-]", "_", name.lower())


def _baselines(plan: "Plan") -> str:
    out = ['<section id="baselines"><h2>Against the recipes</h2>']
    step = _num(plan.step_time)
    base = plan.baselines or {}
    ok = {n: b for n, b in base.items() if isinstance(b, dict) and "error" not in b}
    errors = {n: b for n, b in base.items() if not (isinstance(b, dict) and "error" not in b)}
    chosen = plan.source[len("recipe:"):] if plan.source.startswith("recipe:") else None
    label = "this plan" + (f" ({plan.source})" if plan.source != "search" else " (search)")
    entries = [(step, 0, label, True, plan.fits, None)]
    for n, b in ok.items():
        t = b.get("step_time")
        entries.append((_num(t, math.inf) if _finite(t) else math.inf, 1, n, bool(b.get("fits")),
                        bool(b.get("fits")), b))
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    tmax = max([e[0] for e in entries if math.isfinite(e[0])] + [1e-30])
    LW, BW, RH = 190.0, 400.0, 26.0
    H = RH * len(entries) + 8
    svg = [f'<svg class="chart" id="baselines-chart" width="{_f(LW + BW + 440)}" height="{_f(H)}" viewBox="0 0 {_f(LW + BW + 440)} {_f(H)}" role="img" '
           f'aria-label="step time of this plan and of each recipe">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" class="hatch-bg"/>'
           '<line x1="0" y1="0" x2="0" y2="6" class="hatch-line"/></pattern></defs>']
    for i, (t, is_recipe, name, _, fits, b) in enumerate(entries):
        y = 4 + RH * i
        w = BW * t / tmax if math.isfinite(t) else 0.0
        cls = "plan" if not is_recipe else ("recipe" if fits else "nofit")
        fill = ' fill="url(#hatch)"' if cls == "nofit" else ""
        bits = [_time(t) if math.isfinite(t) else "no estimate"]
        if is_recipe and math.isfinite(t) and step > 0:
            bits.append(f"{t / step:.2f}\u00d7")
        if is_recipe and not fits:
            bits.append(f"does not fit: peak {_bytes(b.get('peak_memory'))} > {_bytes(plan.memory_budget)}")
        if name == chosen and is_recipe:
            bits.append("chosen")
        if not is_recipe and not fits:
            bits.append("does not fit")
        short = name if len(name) <= 28 else name[:27] + "\u2026"
        svg.append(f'<g class="brow b-{cls}" data-name="{_e(name)}"><text x="{_f(LW - 6)}" y="{_f(y + 16)}" '
                   f'class="lbl" text-anchor="end">{_e(short)}<title>{_e(name)}</title></text>'
                   f'<rect x="{_f(LW)}" y="{_f(y)}" width="{_f(w)}" height="{_f(RH - 6)}" class="bar-{cls}"{fill}/>'
                   f'<text x="{_f(LW + w + 6)}" y="{_f(y + 16)}" class="val">{_e("; ".join(bits))}</text></g>')
    svg.append("</svg>")
    out.append(f'<p class="sub">step time per recipe (shorter is faster; \u00d7: the recipe\'s step time over this plan\'s); hatched: the recipe does not fit in '
               f'{_e(_bytes(plan.memory_budget))} per device.</p>' + "".join(svg))
    if ok:
        rows = []
        for n in sorted(ok):
            b = ok[n]
            t = b.get("step_time")
            ratio = f"{_num(t) / step:.2f}\u00d7" if _finite(t) and step > 0 else "-"
            fits = bool(b.get("fits"))
            fits_cell = "yes" if fits else '<span class="bad">no</span>'
            rows.append(
                f'<tr class="{"" if fits else "nofit"}"><td data-v="{_e(n)}">{_e(n)}{" (chosen)" if n == chosen else ""}</td>'
                f'<td class="num" data-v="{_v(t)}">{_e(_time(t))}</td><td class="num" data-v="{_v(_num(t) / step if step > 0 else 0)}">{_e(ratio)}</td>'
                f'<td class="num" data-v="{_v(b.get("peak_memory"))}">{_e(_bytes(b.get("peak_memory")))}</td>'
                f'<td>{fits_cell}</td></tr>')
        head = (_th("recipe", "recipe") + _th("step time", "step_time", num=True)
                + _th("vs this plan", "ratio", num=True) + _th("peak memory", "peak_memory", num=True)
                + _th("fits", "fits"))
        out.append(f'<div class="scroll"><table class="sortable" id="recipes"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{"".join(rows)}</tbody></table></div>')
    if errors:
        items = "".join(f'<li><b>{_e(n)}</b>: {_e(b.get("error") if isinstance(b, dict) else b)}</li>'
                        for n, b in sorted(errors.items()))
        out.append(f'<h3>Recipes that could not be applied</h3><ul class="errors-list" id="recipe-errors">{items}</ul>')
    if not base:
        out.append("<p>No recipe was evaluated.</p>")
    out.append("</section>")
    return "".join(out)


# -- page -----------------------------------------------------------------------------------------------

_CSP = ("default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:; "
        "base-uri 'none'; form-action 'none'")

_CSS = """
:root{--fg:#1d232b;--muted:#5b6572;--line:#d8dde3;--bg:#fff;--soft:#f4f6f8;
--S:#2f6fd6;--B:#8a939e;--P:#d9822b;--X:#7b4fc9;--compute:#3b8e5a;--comm:#d9822b;--mem:#2f6fd6;--bad:#c62828}
*{box-sizing:border-box}
body{margin:0;padding:20px 28px;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
color:var(--fg);background:var(--bg)}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid var(--line);padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
code{font:12.5px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.lead{color:var(--muted);margin:0 0 12px}.sub{color:var(--muted);font-size:12.5px;display:block}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(330px,1fr));gap:8px 22px;margin:0}
.fact{background:var(--soft);border-radius:6px;padding:8px 10px}
.fact dt{font-size:11.5px;text-transform:uppercase;letter-spacing:.04em;color:var(--muted)}.fact dd{margin:2px 0 0}
.split{position:relative;display:flex;height:10px;background:#e6e9ed;border-radius:3px;margin-top:6px;overflow:visible}
.seg{display:block;height:100%}.seg-compute{background:var(--compute)}.seg-comm{background:var(--comm)}
.seg-mem{background:var(--mem)}.seg-over{background:var(--bad)}
.budgetmark{position:absolute;top:-3px;bottom:-3px;width:2px;margin-left:-1px;background:var(--bad)}
.key{display:inline-block;width:10px;height:10px;border-radius:2px;margin:0 4px 0 2px;vertical-align:-1px}
.key-compute{background:var(--compute)}.key-comm{background:var(--comm)}
.ok{color:var(--compute);font-weight:600}.bad{color:var(--bad);font-weight:600}
.scroll{overflow-x:auto}
table{border-collapse:collapse;margin:6px 0 4px;font-size:13px}
th,td{border-bottom:1px solid var(--line);padding:4px 8px;text-align:left;vertical-align:top}
thead th{position:sticky;top:0;background:var(--soft);white-space:nowrap}
table.sortable thead th{cursor:pointer;user-select:none}
table.sortable thead th[aria-sort=ascending]::after{content:" \\25B2";font-size:10px}
table.sortable thead th[aria-sort=descending]::after{content:" \\25BC";font-size:10px}
tfoot td,tfoot th{font-weight:600;border-top:2px solid var(--line)}
td.num{text-align:right;white-space:nowrap;position:relative}
.cellbar{position:absolute;left:0;top:3px;bottom:3px;opacity:.22;border-radius:2px}
.cellval{position:relative}
.b-time{background:var(--compute)}.b-comm{background:var(--comm)}.b-mem{background:var(--mem)}
tbody tr:hover{background:#f7f9fb}
.pl{display:inline-block;min-width:26px;text-align:center;padding:0 5px;margin:1px 2px 1px 0;border-radius:3px;
color:#fff;font:600 12px/18px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.pl-S{background:var(--S)}.pl-B{background:var(--B)}.pl-P{background:var(--P)}.pl-X{background:var(--X)}
.plg{display:inline-block;margin-right:6px;white-space:nowrap}.pn{font-size:12px;color:var(--muted)}
.none{color:var(--muted)}.root{color:var(--muted);font-style:italic}
.legend{font-size:12.5px;color:var(--muted)}
.alts details summary{cursor:pointer}.alts ol{text-align:left;margin:4px 0;padding-left:20px;white-space:normal;
max-width:640px;font-size:12px}.delta{font-weight:600}
.hchart{display:grid;grid-template-columns:minmax(120px,260px) minmax(200px,1fr) auto;gap:3px 10px;align-items:center}
.hrow{display:contents}.hlabel{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;overflow:hidden;
text-overflow:ellipsis;white-space:nowrap}
.htrack{background:#eef0f3;height:12px;border-radius:2px}.hbar{display:block;height:100%;border-radius:2px}
.hval{font-size:12.5px;white-space:nowrap;color:var(--muted)}
svg.chart{max-width:100%;height:auto;display:block;margin:6px 0}
svg text{font:12px system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;fill:var(--fg)}
svg .note{fill:var(--muted);font-size:11px}svg .val{fill:var(--muted)}
svg .track{fill:#eef0f3}svg .budget{stroke:var(--bad);stroke-width:2;stroke-dasharray:4 3}
svg .peak{stroke:var(--fg);stroke-width:1.5}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;margin-right:6px;vertical-align:-1px;background:#b0b6bd}
.mseg{fill:#b0b6bd}
.m-params{fill:#2f6fd6;background:#2f6fd6}.m-grads{fill:#7fa8e8;background:#7fa8e8}
.m-optimizer{fill:#8e5ac8;background:#8e5ac8}.m-activations{fill:#3b8e5a;background:#3b8e5a}
svg .bar-plan{fill:var(--compute)}svg .bar-recipe{fill:#8a939e}svg .b-plan .lbl{font-weight:700}
svg .hatch-bg{fill:#f3d3d3}svg .hatch-line{stroke:var(--bad);stroke-width:2}svg .b-nofit .val{fill:var(--bad)}
tr.nofit td{color:var(--bad)}
.errors-list li{margin:2px 0}
#errors{background:#fde8e8;color:var(--bad);border:1px solid var(--bad);padding:8px 10px;border-radius:6px;
white-space:pre-wrap;font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
footer{margin-top:30px;color:var(--muted);font-size:12px}
"""

#: installed first, in <head>: any script error shows in #errors (and the browser test reads it)
_ERROR_JS = """
window.autoparErrors=[];
function autoparReport(msg){window.autoparErrors.push(String(msg));var e=document.getElementById('errors');
if(e){e.hidden=false;e.textContent='This page\\'s script failed:\\n'+window.autoparErrors.join('\\n');}}
window.addEventListener('error',function(ev){autoparReport('Uncaught '+(ev.message||ev)+(ev.lineno?' (line '+ev.lineno+')':''));});
window.addEventListener('unhandledrejection',function(ev){autoparReport('Unhandled rejection: '+ev.reason);});
"""

_SORT_JS = """
(function(){
'use strict';
function cellKey(row,col,num){
  var c=row.cells[col];if(!c){return num?-Infinity:'';}
  var v=c.getAttribute('data-v');if(v===null){v=c.textContent.trim();}
  if(num){var f=parseFloat(v);return isNaN(f)?-Infinity:f;}
  return v.toLowerCase();
}
function sortTable(table,col,dir){
  var th=table.tHead.rows[0].cells[col];if(!th){return false;}
  var num=th.getAttribute('data-type')==='num';
  var body=table.tBodies[0];var rows=Array.prototype.slice.call(body.rows);
  var keyed=rows.map(function(r,i){return {k:cellKey(r,col,num),i:i,r:r};});
  keyed.sort(function(a,b){
    var c=num?(a.k<b.k?-1:a.k>b.k?1:0):(a.k<b.k?-1:a.k>b.k?1:0);
    if(dir==='descending'){c=-c;}
    return c!==0?c:a.i-b.i;
  });
  keyed.forEach(function(x){body.appendChild(x.r);});
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(h){h.removeAttribute('aria-sort');});
  th.setAttribute('aria-sort',dir);
  return true;
}
function columnIndex(table,key){
  var cells=table.tHead.rows[0].cells;
  for(var i=0;i<cells.length;i++){if(cells[i].getAttribute('data-key')===key){return i;}}
  var n=parseInt(key,10);return isNaN(n)?-1:n;
}
function fromHash(){
  var m=/^#sort=([^:]+):([^:]+)(?::(asc|desc))?$/.exec(decodeURIComponent(location.hash||''));
  if(!m){return;}
  var table=document.getElementById(m[1]);if(!table||!table.tHead){return;}
  var col=columnIndex(table,m[2]);if(col<0){return;}
  sortTable(table,col,m[3]==='desc'?'descending':'ascending');
}
var tables=document.querySelectorAll('table.sortable');
Array.prototype.forEach.call(tables,function(table){
  if(!table.tHead||!table.tBodies.length){return;}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,col){
    th.tabIndex=0;
    th.title=(th.title?th.title+' \\u2014 ':'')+'click to sort';
    function go(){
      var dir=th.getAttribute('aria-sort')==='ascending'?'descending':'ascending';
      sortTable(table,col,dir);
      if(table.id&&history.replaceState){
        history.replaceState(null,'','#sort='+table.id+':'+(th.getAttribute('data-key')||col)+':'+(dir==='descending'?'desc':'asc'));
      }
    }
    th.addEventListener('click',go);
    th.addEventListener('keydown',function(ev){if(ev.key==='Enter'||ev.key===' '){ev.preventDefault();go();}});
  });
});
fromHash();
window.addEventListener('hashchange',fromHash);
document.documentElement.setAttribute('data-ready','1');
})();
"""


def render_html(plan: "Plan", title: Optional[str] = None) -> str:
    """The plan as one self-contained HTML page (inline CSS, script and SVG; nothing fetched).

    ``title`` (the model's name, say) heads the page; the default names the mesh. Deterministic:
    equal plans, or a plan and the same plan saved and loaded, give identical text."""
    p = _canonical(plan)
    axes = p.mesh.get("axes") or {}
    mesh_txt = " \u00d7 ".join(f"{k}={v}" for k, v in axes.items()) or "no mesh axes"
    heading = title if title else f"autopar plan: {mesh_txt} ({p.mesh.get('device', '?')})"
    body = "".join([
        '<div id="errors" role="alert" hidden></div>',
        _header(p, heading),
        "<nav>",
        " \u00b7 ".join(f'<a href="#{a}">{t}</a>' for a, t in (
            ("modules-section", "modules"), ("communication", "communication"), ("memory", "memory"),
            ("baselines", "recipes"))),
        "</nav>",
        "<main>",
        _modules(p),
        _communication(p),
        _memory(p),
        _baselines(p),
        "</main>",
        f'<footer>autopar plan, schema version {_e(p.schema_version)}; graph {_e((p.fingerprint or {}).get("graph", ""))}'
        "</footer>",
    ])
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{_e(_CSP)}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<meta name="generator" content="autopar">'
        '<link rel="icon" href="data:,">'
        f"<title>{_e(heading)}</title>"
        f"<style>{_CSS}</style>"
        f"<script>{_ERROR_JS}</script>"
        "</head>\n<body>"
        f"{body}"
        f"<script>{_SORT_JS}</script>"
        "</body></html>\n"
    )


def write_html(plan: "Plan", path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
    """Write ``render_html(plan, title)`` to ``path`` as UTF-8 (through a temporary file, so a
    reader never sees half a page)."""
    text = render_html(plan, title=title)
    target = os.fspath(path)
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        fh.write(text)
    os.replace(tmp, target)


__all__ = ["render_html", "write_html"]
