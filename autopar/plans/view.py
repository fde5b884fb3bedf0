"""Rendering of a Plan for the terminal: ``summary``, ``explain`` and ``diff`` (``Plan.summary`` etc. call these).

Everything here reads only the Plan's own data, so a saved plan can be shown, explained and compared
without the model or a solve. Lines stay within ``WIDTH`` characters where the content allows. Every
text returned goes through ``printable``: names from a model or a file cannot drive the terminal.
"""

from __future__ import annotations

import difflib
import math
import textwrap
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterable

from autopar.errors import PlanError
from autopar.ir.attention_forms import FORMS
from autopar.plans.names import alternative_label, namer, op_label
from autopar.plans.pipeline_view import diff_lines, explain_lines, summary_lines
from autopar.plans.format import (
    SOLVER_TIMING_KEYS,
    canon,
    clip,
    device_count,
    human_bytes,
    human_time,
    mesh_text,
    printable,
    relative_name,
)

if TYPE_CHECKING:  # the Plan's methods call into this module: no import of it at run time
    from autopar.plans.schema import Plan

WIDTH = 120
MAX_ROWS = 60
#: the memory kinds in the order the summary lists them (others follow, sorted)
MEMORY_ORDER = ("params", "grads", "optimizer", "activations")
#: what the table's columns mean, printed under it
LEGEND = ("compute ms: the module's ops on one device; comm ms: its reshardings' collectives, each timed alone "
          "(most run hidden behind compute, so the column does not add up to the step's communication below, "
          "which is only what communication adds to the step); moved: the bytes those collectives carry; "
          "memory: its parameters' bytes (with their gradients and optimizer state) and its activations', per device")


# -- small helpers ------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def _in_scope(module: str, path: str) -> bool:
    return path == "" or module == path or module.startswith(path + ".")


def _compact(placements: dict[str, str], path: str) -> str:
    """``{"a.wq": "B, S(0)", "a.wk": "B, S(0)"}`` under ``a`` -> ``"wk,wq: B,S(0)"``: names in sorted order, so
    that a plan reads the same before and after a save (the file's keys are sorted)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for fqn, p in sorted(placements.items()):
        groups[p.replace(" ", "")].append(relative_name(fqn, path))
    return "; ".join(f"{','.join(names)}: {p}" for p, names in groups.items())


def _wrap_items(head: str, items: list[str], sep: str = ", ", tail: str = "") -> list[str]:
    """``head`` then ``items`` joined by ``sep``, broken between items (never inside one) at WIDTH."""
    lines, cur = [], head
    for i, item in enumerate(items):
        piece = item + (sep if i < len(items) - 1 else tail)
        if len(cur) + len(piece.rstrip()) > WIDTH and cur.strip():
            lines.append(cur.rstrip())
            cur = "  "
        cur += piece
    return lines + [cur.rstrip()]


def _module_paths(plan: "Plan") -> list[str]:
    seen: dict[str, None] = {}
    for m in plan.modules:
        seen.setdefault(m.get("path", ""), None)
    for n in plan.nodes:
        seen.setdefault(n.get("module", ""), None)
    return list(seen)


def _steps_text(steps: Iterable[dict]) -> str:
    return ", ".join(f"{s.get('kind')} on {s.get('axis')} {human_bytes(s.get('bytes', 0))} {human_time(s.get('time', 0.0))}"
                     for s in steps) or "local (no communication)"


def _resharding_line(r: dict, indent: str, name, show_consumer: bool = False) -> list[str]:
    """One resharding, its tensor (and consumer) by user names (``name``: ``names.namer``), and its collectives."""
    consumer = str(r.get("consumer"))
    if r.get("kind") == "grad" and consumer.startswith("param:"):  # a gradient reduced to its parameter's placement
        what, who = f"grad of {consumer[6:]}", ""
    else:
        what = f"{r.get('kind', 'activation')} {name(r.get('tensor'), r)}"
        who = f" for {name(consumer)}" if show_consumer else ""
    head = (f"{indent}<- {what}{who}: {r.get('from')} -> {r.get('to')}, "
            f"{human_bytes(r.get('bytes', 0))} tensor, {human_time(r.get('time', 0.0))}")
    body = textwrap.wrap(_steps_text(r.get("steps") or ()), WIDTH - len(indent) - 6)
    return [head] + [f"{indent}     {line}" for line in body]


# -- summary ----------------------------------------------------------------------------------------

def mfu_text(plan) -> str:
    """``"MFU 41.3% (model FLOPs 3.2 PFLOP per step), 4,792 tokens/s per device"``, or "" for a plan
    that does not know it (schema version 4 and older)."""
    if not getattr(plan, "model_flops", 0):
        return ""
    text = f"MFU {100 * plan.mfu:.1f}% (model FLOPs {plan.model_flops:.3g} per step: 3 x forward matmuls and attention)"
    if plan.tokens_per_step:
        text += f", {plan.tokens_per_second_per_device:,.0f} tokens/s per device"
    return text


def summary(plan: "Plan", full: bool = False) -> str:
    """Per-module table, totals, memory split, collectives, baselines, solver and planning times."""
    prec = plan.precision.get("name", "?")
    mode = "training" if plan.training else "inference"
    lines = [clip(f"autopar plan: mesh {mesh_text(plan.mesh)}, {device_count(plan.mesh)} devices, {prec}, {mode}, "
                   f"source {plan.source}", WIDTH)]
    mods = plan.modules
    modw = min(max([len(m.get("path") or "(root)") for m in mods] + [6]), 36)
    plw = WIDTH - modw - 4 * 10 - 5 * 2
    header = f"{'module':<{modw}}  {'placements':<{plw}}  {'compute ms':>10}  {'comm ms':>10}  {'moved':>10}  {'memory':>10}"
    lines += [header, "-" * len(header)]
    shown = mods if full or len(mods) <= MAX_ROWS else mods[:MAX_ROWS]
    for m in shown:
        path = m.get("path") or "(root)"
        path = path if len(path) <= modw else ".." + path[-(modw - 2):]
        pl = textwrap.wrap(_compact(m.get("placements") or {}, m.get("path", "")), plw, break_on_hyphens=False) or ["-"]
        lines.append(f"{path:<{modw}}  {pl[0]:<{plw}}  {_ms(m.get('time', 0.0)):>10}  {_ms(m.get('comm', 0.0)):>10}  "
                     f"{human_bytes(m.get('bytes', 0)):>10}  {human_bytes(m.get('memory', 0)):>10}")
        lines += [f"{'':<{modw}}  {extra}" for extra in pl[1:]]
    if len(shown) < len(mods):
        lines.append(f"... {len(mods) - len(shown)} more modules (summary(full=True) shows all)")
    tot = [sum(m.get(k, 0) for m in mods) for k in ("time", "comm", "bytes", "memory")]
    lines += ["-" * len(header),
              f"{'total':<{modw}}  {'':<{plw}}  {_ms(tot[0]):>10}  {_ms(tot[1]):>10}  "
              f"{human_bytes(tot[2]):>10}  {human_bytes(tot[3]):>10}"]
    lines += textwrap.wrap(LEGEND, WIDTH, break_on_hyphens=False)
    in_modules = {k for m in mods for k in (m.get("placements") or {})} | set(plan.graph.get("fqns") or ())
    inputs = {k: v for k, v in plan.placements.items() if k not in in_modules}
    if inputs:
        lines += _wrap_items("inputs: ", [f"{k} {v}" for k, v in inputs.items()], "; ")
    blocks = plan.graph.get("blocks") or {}
    split = [f"{k} dim {d} ({c} blocks)" for k, bs in blocks.items() for d, c in bs
             if any(p.strip() == f"S({d})" for p in plan.placements.get(k, "").split(","))]
    if split:
        lines += _wrap_items("split block by block (each device a piece of every block; DTensor _StridedShard): ",
                             split, "; ")
    lines.append("")
    lines.append(f"step time {human_time(plan.step_time)}  (compute {human_time(plan.compute_time)}, "
                 f"communication {human_time(plan.comm_time)})")
    mfu = mfu_text(plan)
    if mfu:
        lines.append(mfu)
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    kinds = [k for k in MEMORY_ORDER if k in plan.memory] + sorted(k for k in plan.memory if k not in MEMORY_ORDER)
    split = [f"{k} {human_bytes(plan.memory[k])}" for k in kinds]
    lines += _wrap_items(f"peak memory {human_bytes(plan.peak_memory)} of {human_bytes(plan.memory_budget)} per device "
                         f"({verdict}): ", split)
    lines += _layer_groups(plan)
    lines += summary_lines(plan)
    if plan.collectives:
        lines += _wrap_items(f"collectives (bucket size {human_bytes(plan.bucket_size)}): ",
                             [_collective_text(c) for c in plan.collectives], "; ")
    lines += _baselines(plan)
    lines += _wrap_items("", _solver_parts(plan.solver))
    if plan.phases:
        lines += _wrap_items("planning: ", [f"{k} {human_time(v)}" for k, v in plan.phases.items()])
    return printable("\n".join(lines))


def _layer_groups(plan: "Plan", path: str = "") -> list[str]:
    """Per group of alike layers (under ``path``): what recomputes and what that saves and costs."""
    groups = [g for g in getattr(plan, "layer_groups", []) or []
              if not path or any(_in_scope(p, path) or _in_scope(path, p) for p in g.get("paths", []))]
    if not groups:
        return []
    out = ["", "activation checkpointing (per group of alike layers; per instance: saved when not recomputed, "
               "kept when recomputed, re-run time):"]
    for g in groups:
        k, n, mode = g.get("checkpointed", 0), g.get("count", 0), g.get("mode", "none")
        what = f"{k} of {n} recomputed ({mode}: {_span(g.get('paths', [])[:k])})" if k else f"none of {n} recomputed"
        saved = g.get("saved_bytes", 0) - g.get("input_bytes", 0)
        out.append(f"  {g.get('prefix') or '(root)'}: {what}; saves {human_bytes(g.get('saved_bytes', 0))}, "
                   f"keeps {human_bytes(g.get('input_bytes', 0))}, re-run {human_time(g.get('recompute_time', 0.0))}"
                   + (f"; in all {human_bytes(k * saved)} less memory, {human_time(k * g.get('recompute_time', 0.0))} "
                      f"more time" if k else ""))
        kb, kt = g.get("kept_bytes", 0), g.get("kept_time", 0.0)
        kept = g.get("kept", n if g.get("kept_gathers") else 0)
        if kept or kb:
            what = (f"{kept} of {n} keep their gathered parameters for the backward" if kept
                    else "gathered parameters gathered again in the backward")
            out.append(f"    kept gathers: {what}; per instance holds {human_bytes(kb)} from forward to backward, "
                       f"saves {human_time(kt)} of backward gathers"
                       + (f"; in all {human_bytes(kept * kb)} more memory, {human_time(kept * kt)} less gathering"
                          if kept else ""))
    return out


def _span(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}" if paths else "-"


def _collective_text(c: dict) -> str:
    b = " bucketed" if c.get("bucketed") else ""
    return (f"{c.get('count', 1)} x {c.get('kind')} on {c.get('axis')} {c.get('phase', '')}{b} "
            f"{human_bytes(c.get('bytes', 0))} each").replace("  ", " ")


def _baselines(plan: "Plan") -> list[str]:
    if not plan.baselines:
        return ["baselines: none evaluated"]
    w = max(max(len(k) for k in plan.baselines), len("recipe"))
    out = ["", "baselines (vs plan: baseline step time / plan step time; the ops a tensor-parallel recipe leaves "
               "open are",
           "  completed greedily here, and exactly when planned alone with recipe=NAME, which may be faster):",
           f"  {'recipe':<{w}}  {'step time':>10}  {'vs plan':>8}  {'peak memory':>11}  fits"]
    for name in sorted(plan.baselines):
        b = plan.baselines[name]
        if "error" in b:
            out.append(clip(f"  {name:<{w}}  error: {b['error']}", WIDTH))
            continue
        st = b.get("step_time")
        ratio = f"{st / plan.step_time:.2f}x" if st is not None and plan.step_time else "-"
        mark = "  <- chosen" if plan.source == f"recipe:{name}" else ""
        out.append(f"  {name:<{w}}  {human_time(st):>10}  {ratio:>8}  {human_bytes(b.get('peak_memory', 0)):>11}  "
                   f"{'yes' if b.get('fits') else 'no'}{mark}")
    return out


#: the solver's status in plain words
STATUS_WORDS = {"OPTIMAL": "proven the best plan under the cost model",
                "FEASIBLE": "a valid plan, not proven the best",
                "INFEASIBLE": "no plan meets the constraints", "NOT_SOLVED": "stopped before finding a plan"}


def _gap_text(s: dict) -> str:
    """The optimality gap in words: how far from the best possible the plan may be, or why that is unknown."""
    gap = s.get("gap")
    if isinstance(gap, (int, float)):
        return f"gap {gap:.3g} (within {100 * gap:.3g}% of the best bound)"
    if isinstance(s.get("rounds"), int):
        per = s.get("relative_gap_per_round")
        within = f", each within {100 * per:.3g}% of that round's best" if isinstance(per, (int, float)) else ""
        return (f"solved one mesh axis at a time in {s['rounds']} rounds{within}; gap unknown (no bound over all axes "
                f"at once)")
    return "gap unknown" if "gap" in s else ""


def _solver_parts(s: dict) -> list[str]:
    """The solver line's items: which solver, its status and gap in words, the problem's size, its time."""
    if not s:
        return ["solver: (none)"]
    parts = [f"solver {s.get('solver', '?')}"]
    if "status" in s:
        words = STATUS_WORDS.get(str(s["status"]))
        parts.append(f"status {s['status']}" + (f" ({words})" if words else ""))
    parts += [_gap_text(s)] if _gap_text(s) else []
    for k in ("variables", "constraints"):
        if isinstance(s.get(k), int):
            parts.append(f"{s[k]:,} {k}")
    if isinstance(s.get("wall_time"), (int, float)):
        parts.append(f"{human_time(s['wall_time'])} wall")
    if isinstance(s.get("deterministic_time"), (int, float)):
        parts.append(f"deterministic time {s['deterministic_time']:.3g}")
    return parts


# -- explain ----------------------------------------------------------------------------------------

def _resolve(plan: "Plan", path: str) -> tuple[str, str | None]:
    """(module path, parameter FQN or None) for a module path or a parameter FQN."""
    paths = _module_paths(plan)
    fqns = list(dict.fromkeys(list(plan.graph.get("fqns") or ()) + [k for k in plan.placements if not k.startswith("input:")]))
    if path == "" or path in paths or any(_in_scope(p, path) for p in paths):
        return path, None
    if path in fqns:
        return (path.rsplit(".", 1)[0] if "." in path else ""), path
    close = [c for c in paths + fqns if path and path in c][:3]
    close += [c for c in difflib.get_close_matches(path, paths + fqns, n=5, cutoff=0.5) if c not in close]
    hint = f"did you mean: {', '.join(close[:5])}?" if close else \
        f"modules in this plan: {', '.join(p or '(root)' for p in paths[:8])}{' ...' if len(paths) > 8 else ''}"
    raise PlanError(f"no module or parameter {path!r} in this plan; {hint}")


def explain(plan: "Plan", module_path: str) -> str:
    """Chosen strategy of each op under a module, per-op compute and incoming reshardings, the
    parameters' placements and reshardings, and the module's alternatives."""
    path, fqn = _resolve(plan, module_path)
    name = namer(plan)
    axes = ", ".join(plan.axis_names)
    nodes = [n for n in plan.nodes if _in_scope(n.get("module", ""), path)]
    mods = [m for m in plan.modules if _in_scope(m.get("path", ""), path)]
    label = path or "(root)"
    lines: list[str] = []
    if fqn is not None:
        lines.append(f"parameter {fqn}: {plan.placements.get(fqn, '(no placement)')} over ({axes}), in module {label}")
    t, c = sum(m.get("time", 0.0) for m in mods), sum(m.get("comm", 0.0) for m in mods)
    b, mem = sum(m.get("bytes", 0) for m in mods), sum(m.get("memory", 0) for m in mods)
    lines.append(f"module {label}: {len(nodes)} ops, compute {human_time(t)}, communication {human_time(c)}, "
                 f"moved {human_bytes(b)}, memory {human_bytes(mem)}")
    params = {k: v for k, v in plan.placements.items() if not k.startswith("input:") and _in_scope(k.rsplit(".", 1)[0] if "." in k else "", path)}
    if params:
        w = min(max(len(k) for k in params), 60)
        lines.append(f"parameters (placement over {axes}):")
        lines += [f"  {k:<{w}}  {v}{'   <-' if k == fqn else ''}" for k, v in params.items()]
    by_consumer: dict[str, list[dict]] = defaultdict(list)
    for r in plan.reshardings:
        by_consumer[str(r.get("consumer"))].append(r)
    names = {n.get("name") for n in nodes}
    if nodes:
        lines.append(f"ops (graph order; strategy per mesh axis {axes}):")
    for n in nodes:
        lines.append(f"  {op_label(n)}  ({n.get('op')})  compute {human_time(n.get('compute', 0.0))}")
        tags = n.get("tags") or []
        for i, sig in enumerate(n.get("strategy") or []):
            ax = plan.axis_names[i] if i < len(plan.axis_names) else f"axis{i}"
            tag = f"  [{tags[i]}]" if i < len(tags) and tags[i] else ""
            lines.append(f"      {ax}: {sig}{tag}")
        lines += _experts_line(plan, n)
        ins = " | ".join(str(x) for x in n.get("inputs") or []) or "-"
        outs = " | ".join("-" if x is None else str(x) for x in n.get("outputs") or []) or "-"
        lines.append(clip(f"      in: {ins}   out: {outs}", WIDTH))
        for r in by_consumer.get(str(n.get("name")), []):
            lines += _resharding_line(r, "      ", name)
    others = [r for r in plan.reshardings if str(r.get("consumer")) not in names and (
        _in_scope(str(r.get("module", "")), path) and r.get("module") is not None
        or (str(r.get("consumer", "")).startswith("param:") and _in_scope(str(r["consumer"])[6:].rsplit(".", 1)[0], path)))]
    if fqn is not None:
        mine = [str(r.get("consumer")) == f"param:{fqn}" or name(r.get("tensor"), r) == fqn for r in others]
        others = [r for r, m in zip(others, mine) if m] + [r for r, m in zip(others, mine) if not m]
    if others:
        lines.append("parameter and other reshardings:")
        for r in others:
            lines += _resharding_line(r, "  ", name, show_consumer=True)
    mode = (getattr(plan, "checkpointing", {}) or {}).get(path)
    if mode:
        lines.append(f"checkpointed ({mode}): its activations are recomputed in the backward")
    if path and path in (getattr(plan, "kept_gathers", []) or []):
        lines.append("kept gathers: its parameters gathered in the forward are kept for the backward, not gathered again")
    lines += _layer_groups(plan, path)
    lines += explain_lines(plan, path)
    lines += attention_lines(mods, name)
    for m in mods:
        alts = m.get("alternatives") or []
        if not alts:
            continue
        lines.append(f"alternatives for {m.get('path') or '(root)'} (chosen: compute {human_time(m.get('time', 0.0))}, "
                     f"communication {human_time(m.get('comm', 0.0))}; delta = change in step time):")
        labels = [alternative_label(plan, a.get("name")) for a in alts]
        w = max(len(label) for label in labels)
        for label, a in sorted(zip(labels, alts), key=lambda la: la[1].get("delta", 0.0)):
            d = a.get("delta", 0.0)
            lines.append(f"  {label:<{w}}  {('+' if d >= 0 else '') + human_time(d):>10}  "
                         f"(compute {human_time(a.get('time', 0.0))}, communication {human_time(a.get('comm', 0.0))})")
    return printable("\n".join(lines))


def _experts_line(plan: "Plan", node: dict) -> list[str]:
    """Which mesh axes an expert-parallel grouped product splits its experts over (its own
    factorization of the devices: it need not match what the ops around it split)."""
    tags = node.get("tags") or []
    on = [i for i, t in enumerate(tags) if t == "experts"]
    if not on:
        return []
    names, shape = plan.axis_names, plan.mesh_shape
    ways = math.prod(shape[i] for i in on if i < len(shape))
    how = "one all-to-all per axis, outer axis first" if len(on) > 1 else "one all-to-all"
    return [f"      experts over {' x '.join(names[i] if i < len(names) else f'axis{i}' for i in on)} "
            f"({ways} ways): each row travels to its expert's device and back ({how})"]


def attention_lines(mods: list[dict], name) -> list[str]:
    """Each attention op's form per mesh axis (``ir.attention_forms.FORMS``) and why: what each other
    form would add to the step time, everything else held."""
    lines = []
    for m in mods:
        for a in m.get("attention") or []:
            form = str(a.get("form"))
            what = FORMS[form].what if form in FORMS else form
            alts = sorted(a.get("alternatives") or [], key=lambda x: x.get("delta", 0.0))
            why = ", ".join(f"{x.get('name')} {('+' if x.get('delta', 0.0) >= 0 else '') + human_time(x.get('delta', 0.0))}"
                            for x in alts) or "no other form splits it there"
            lines.append(f"attention {name(a.get('op'), None)} on {a.get('axis')}: {form} ({what}); "
                         f"other forms, change in step time: {why}")
    return lines


# -- diff -------------------------------------------------------------------------------------------

def _same(a: Any, b: Any) -> bool:
    return canon(a) == canon(b)


def _delta(label: str, a: float, b: float, fmt) -> str:
    pct = f", {(b - a) / a * 100:+.1f}%" if a else ""
    sign = "+" if b >= a else "-"
    return f"{label}: {fmt(a)} -> {fmt(b)} ({sign}{fmt(abs(b - a))}{pct})"


def diff(a: "Plan", b: "Plan", limit: int = 40) -> str:
    """Differences from plan ``a`` to plan ``b`` ("plans are identical" when none). Planning wall
    times are not compared."""
    out: list[str] = []
    if not _same(a.fingerprint.get("graph"), b.fingerprint.get("graph")):
        out.append("graph: the plans were made for different graphs (fingerprints differ)")
    if a.source != b.source:
        out.append(f"source: {a.source} -> {b.source}")
    if not _same(a.mesh, b.mesh):
        ma, mb = mesh_text(a.mesh), mesh_text(b.mesh)
        out.append(f"mesh: {ma} -> {mb}" if ma != mb else f"mesh: {ma}, hardware figures or links differ")
    if not _same(a.precision, b.precision):
        keys = [k for k in sorted(set(a.precision) | set(b.precision)) if a.precision.get(k) != b.precision.get(k)]
        out.append("precision: " + ", ".join(f"{k} {a.precision.get(k)} -> {b.precision.get(k)}" for k in keys))
    if a.training != b.training:
        out.append(f"training: {a.training} -> {b.training}")
    for label, x, y, fmt in (("memory budget", a.memory_budget, b.memory_budget, human_bytes),
                             ("step time", a.step_time, b.step_time, human_time),
                             ("compute time", a.compute_time, b.compute_time, human_time),
                             ("communication time", a.comm_time, b.comm_time, human_time),
                             ("peak memory", a.peak_memory, b.peak_memory, human_bytes)):
        if not _same(x, y):
            out.append(_delta(label, x, y, fmt))
    for k in sorted(set(a.memory) | set(b.memory)):
        if not _same(a.memory.get(k, 0), b.memory.get(k, 0)):
            out.append(_delta(f"  memory {k}", a.memory.get(k, 0), b.memory.get(k, 0), human_bytes))
    if a.fits != b.fits:
        out.append(f"fits in memory: {a.fits} -> {b.fits}")
    changed = [k for k in sorted(set(a.placements) | set(b.placements)) if a.placements.get(k) != b.placements.get(k)]
    if changed:
        out.append(f"placements ({len(changed)} differ):")
        w = min(max(len(k) for k in changed), 60)
        out += [f"  {k:<{w}}  {a.placements.get(k, '(absent)')} -> {b.placements.get(k, '(absent)')}" for k in changed[:limit]]
        if len(changed) > limit:
            out.append(f"  ... {len(changed) - limit} more")
    sa = {n.get("name"): n.get("strategy") for n in a.nodes}
    sb = {n.get("name"): n.get("strategy") for n in b.nodes}
    ops = [k for k in sa if k in sb and sa[k] != sb[k]]
    if ops:
        first = ", ".join(namer(a)(k) for k in ops[:5])
        out.append(f"op strategies: {len(ops)} of {len(sa)} ops differ (first: {first})")
    if set(sa) != set(sb):
        out.append(f"ops: {len(sa)} -> {len(sb)} (the graphs differ)")
    for label, x, y in (("reshardings", a.reshardings, b.reshardings), ("collectives", a.collectives, b.collectives)):
        if not _same(x, y):
            out.append(f"{label}: {len(x)} -> {len(y)}" + ("" if len(x) != len(y) else " (contents differ)"))
    if a.checkpointing != b.checkpointing:
        out.append(f"checkpointing: {len(a.checkpointing)} -> {len(b.checkpointing)} layer instances recomputed"
                   + ("" if len(a.checkpointing) != len(b.checkpointing) else " (which or how differs)"))
    out += diff_lines(a, b)
    if a.kept_gathers != b.kept_gathers:
        out.append(f"kept gathers: {len(a.kept_gathers)} -> {len(b.kept_gathers)} layer instances")
    if a.bucket_size != b.bucket_size:
        out.append(f"bucket size: {human_bytes(a.bucket_size)} -> {human_bytes(b.bucket_size)}")
    rest = [k for k in ("nodes", "modules", "baselines", "graph") if not _same(getattr(a, k), getattr(b, k))]
    sol_a = {k: v for k, v in a.solver.items() if k not in SOLVER_TIMING_KEYS}
    sol_b = {k: v for k, v in b.solver.items() if k not in SOLVER_TIMING_KEYS}
    rest += ["solver"] if not _same(sol_a, sol_b) else []
    if not out and rest:
        out.append("decisions and estimates are equal; details differ in: " + ", ".join(rest))
    if not out:
        return "plans are identical"
    return printable("\n".join(["plans differ (first -> second):"] + [clip(line, WIDTH) for line in out]))


__all__ = ["MAX_ROWS", "WIDTH", "diff", "explain", "summary"]
