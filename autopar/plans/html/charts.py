"""The plan's HTML page's charts: memory per device against the budget, and the plan against the recipes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autopar.plans.format import finite_float
from autopar.plans.html.cells import (
    bytes_text,
    css_class,
    escape,
    header_cell,
    is_number,
    percent,
    sort_key,
    svg_coord,
    time_text,
)

if TYPE_CHECKING:
    from autopar.plans.schema import Plan

#: memory components in display order (others a plan may carry follow, sorted)
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")


def _memory_parts(plan: "Plan") -> list[tuple[str, float]]:
    """The plan's memory components in display order, as (name, bytes)."""
    mem = plan.memory or {}
    keys = [k for k in MEMORY_PARTS if k in mem] + sorted(k for k in mem if k not in MEMORY_PARTS)
    return [(k, finite_float(mem[k])) for k in keys]


def memory_section(plan: "Plan") -> str:
    """Memory per device: stacked against the budget, the breakdown, and a table."""
    parts = _memory_parts(plan)
    total = sum(v for _, v in parts)
    peak, budget = finite_float(plan.peak_memory), finite_float(plan.memory_budget)
    W, LW, BW = 720.0, 110.0, 560.0  # width, label width, bar width
    scale = max(total, peak, budget, 1e-30)
    svg = [f'<svg class="chart" id="memory-chart" width="{svg_coord(W)}" height="112" viewBox="0 0 {svg_coord(W)} 112" role="img" '
           f'aria-label="memory per device against the budget">']

    def stack(y: float, sc: float, label: str) -> None:
        svg.append(f'<text x="0" y="{svg_coord(y + 15)}" class="lbl">{escape(label)}</text>')
        x = LW
        svg.append(f'<rect x="{svg_coord(LW)}" y="{svg_coord(y)}" width="{svg_coord(BW)}" height="22" class="track"/>')
        for k, v in parts:
            w = BW * v / sc if sc > 0 else 0.0
            svg.append(f'<rect x="{svg_coord(x)}" y="{svg_coord(y)}" width="{svg_coord(w)}" height="22" class="mseg m-{escape(css_class(k))}">'
                       f'<title>{escape(k)} {escape(bytes_text(v))} ({escape(percent(v, total))} of the total)</title></rect>')
            x += w

    stack(8, scale, "vs budget")
    bx = LW + BW * budget / scale
    px = LW + BW * peak / scale
    svg.append(f'<line x1="{svg_coord(bx)}" y1="2" x2="{svg_coord(bx)}" y2="36" class="budget"/>'
               f'<text x="{svg_coord(min(bx, LW + BW) - 2)}" y="46" class="note" text-anchor="end">budget '
               f'{escape(bytes_text(budget))}</text>')
    svg.append(f'<line x1="{svg_coord(px)}" y1="4" x2="{svg_coord(px)}" y2="34" class="peak"><title>peak {escape(bytes_text(peak))}</title></line>')
    stack(62, max(total, peak, 1e-30), "breakdown")
    px2 = LW + BW * peak / max(total, peak, 1e-30)
    svg.append(f'<line x1="{svg_coord(px2)}" y1="58" x2="{svg_coord(px2)}" y2="88" class="peak"/>'
               f'<text x="{svg_coord(LW)}" y="104" class="note">peak {escape(bytes_text(peak))} = {escape(percent(peak, budget))} '
               f'of the budget ({"fits" if peak <= budget else "DOES NOT FIT"})</text>')
    svg.append("</svg>")
    rows = "".join(
        f'<tr><td><span class="swatch m-{escape(css_class(k))}"></span>{escape(k)}</td><td class="num" data-v="{sort_key(v)}">'
        f'{escape(bytes_text(v))}</td><td class="num" data-v="{sort_key(v)}">{escape(percent(v, total))}</td>'
        f'<td class="num" data-v="{sort_key(v)}">{escape(percent(v, budget))}</td></tr>' for k, v in parts)
    head = (header_cell("component", "component") + header_cell("per device", "bytes", num=True)
            + header_cell("of the total", "share", num=True) + header_cell("of the budget", "budget", num=True))
    foot = (f'<tr><th scope="row">total</th><td class="num">{escape(bytes_text(total))}</td><td></td>'
            f'<td class="num">{escape(percent(total, budget))}</td></tr>'
            f'<tr><th scope="row">peak</th><td class="num">{escape(bytes_text(peak))}</td><td></td>'
            f'<td class="num">{escape(percent(peak, budget))}</td></tr>')
    return (f'<section id="memory"><h2>Memory per device</h2>{"".join(svg)}'
            f'<table class="sortable" id="memory-table"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>'
            f'<tfoot>{foot}</tfoot></table></section>')


def baselines_section(plan: "Plan") -> str:
    """The plan's step time against each recipe's (chart and table), and the recipes that failed."""
    out = ['<section id="baselines"><h2>Against the recipes</h2>']
    step = finite_float(plan.step_time)
    base = plan.baselines or {}
    ok = {n: b for n, b in base.items() if isinstance(b, dict) and "error" not in b}
    errors = {n: b for n, b in base.items() if not (isinstance(b, dict) and "error" not in b)}
    chosen = plan.source[len("recipe:"):] if plan.source.startswith("recipe:") else None
    label = "this plan" + (f" ({plan.source})" if plan.source != "search" else " (search)")
    entries = [(step, 0, label, True, plan.fits, None)]
    for n, b in ok.items():
        t = b.get("step_time")
        entries.append((finite_float(t, math.inf) if is_number(t) else math.inf, 1, n, bool(b.get("fits")),
                        bool(b.get("fits")), b))
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    tmax = max([e[0] for e in entries if math.isfinite(e[0])] + [1e-30])
    LW, BW, RH = 190.0, 400.0, 26.0
    H = RH * len(entries) + 8
    svg = [f'<svg class="chart" id="baselines-chart" width="{svg_coord(LW + BW + 440)}" height="{svg_coord(H)}" viewBox="0 0 {svg_coord(LW + BW + 440)} {svg_coord(H)}" role="img" '
           f'aria-label="step time of this plan and of each recipe">',
           '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
           'patternTransform="rotate(45)"><rect width="6" height="6" class="hatch-bg"/>'
           '<line x1="0" y1="0" x2="0" y2="6" class="hatch-line"/></pattern></defs>']
    for i, (t, is_recipe, name, _, fits, b) in enumerate(entries):
        y = 4 + RH * i
        w = BW * t / tmax if math.isfinite(t) else 0.0
        cls = "plan" if not is_recipe else ("recipe" if fits else "nofit")
        fill = ' fill="url(#hatch)"' if cls == "nofit" else ""
        bits = [time_text(t) if math.isfinite(t) else "no estimate"]
        if is_recipe and math.isfinite(t) and step > 0:
            bits.append(f"{t / step:.2f}\u00d7")
        if is_recipe and not fits:
            bits.append(f"does not fit: peak {bytes_text(b.get('peak_memory'))} > {bytes_text(plan.memory_budget)}")
        if name == chosen and is_recipe:
            bits.append("chosen")
        if not is_recipe and not fits:
            bits.append("does not fit")
        short = name if len(name) <= 28 else name[:27] + "\u2026"
        svg.append(f'<g class="brow b-{cls}" data-name="{escape(name)}"><text x="{svg_coord(LW - 6)}" y="{svg_coord(y + 16)}" '
                   f'class="lbl" text-anchor="end">{escape(short)}<title>{escape(name)}</title></text>'
                   f'<rect x="{svg_coord(LW)}" y="{svg_coord(y)}" width="{svg_coord(w)}" height="{svg_coord(RH - 6)}" class="bar-{cls}"{fill}/>'
                   f'<text x="{svg_coord(LW + w + 6)}" y="{svg_coord(y + 16)}" class="val">{escape("; ".join(bits))}</text></g>')
    svg.append("</svg>")
    out.append(f'<p class="sub">step time per recipe (shorter is faster; \u00d7: the recipe\'s step time over this plan\'s); hatched: the recipe does not fit in '
               f'{escape(bytes_text(plan.memory_budget))} per device.</p>' + "".join(svg))
    if ok:
        rows = []
        for n in sorted(ok):
            b = ok[n]
            t = b.get("step_time")
            ratio = f"{finite_float(t) / step:.2f}\u00d7" if is_number(t) and step > 0 else "-"
            fits = bool(b.get("fits"))
            fits_cell = "yes" if fits else '<span class="bad">no</span>'
            rows.append(
                f'<tr class="{"" if fits else "nofit"}"><td data-v="{escape(n)}">{escape(n)}{" (chosen)" if n == chosen else ""}</td>'
                f'<td class="num" data-v="{sort_key(t)}">{escape(time_text(t))}</td><td class="num" data-v="{sort_key(finite_float(t) / step if step > 0 else 0)}">{escape(ratio)}</td>'
                f'<td class="num" data-v="{sort_key(b.get("peak_memory"))}">{escape(bytes_text(b.get("peak_memory")))}</td>'
                f'<td>{fits_cell}</td></tr>')
        head = (header_cell("recipe", "recipe") + header_cell("step time", "step_time", num=True)
                + header_cell("vs this plan", "ratio", num=True) + header_cell("peak memory", "peak_memory", num=True)
                + header_cell("fits", "fits"))
        out.append(f'<div class="scroll"><table class="sortable" id="recipes"><thead><tr>{head}</tr></thead>'
                   f'<tbody>{"".join(rows)}</tbody></table></div>')
    if errors:
        items = "".join(f'<li><b>{escape(n)}</b>: {escape(b.get("error") if isinstance(b, dict) else b)}</li>'
                        for n, b in sorted(errors.items()))
        out.append(f'<h3>Recipes that could not be applied</h3><ul class="errors-list" id="recipe-errors">{items}</ul>')
    if not base:
        out.append("<p>No recipe was evaluated.</p>")
    out.append("</section>")
    return "".join(out)


__all__ = ["MEMORY_PARTS", "baselines_section", "memory_section"]
