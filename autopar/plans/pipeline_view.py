"""A pipelined plan's lines in ``summary``, ``explain`` and ``diff`` (``plan.pipeline``, schema version 5;
per-stage recomputation, batch-coupled ops and the mesh search: version 6)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from autopar.plans.format import human_bytes, human_time

if TYPE_CHECKING:
    from autopar.plans.entries import PipelineChoice
    from autopar.plans.schema import Plan


def _span(paths: list) -> str:
    return ", ".join(map(str, paths)) if len(paths) <= 4 else f"{paths[0]}, {paths[1]} ... {paths[-1]} ({len(paths)})"


def mesh_search_lines(plan: "Plan") -> list[str]:
    """``Mesh.devices``' factorization search: the shape chosen and every shape compared."""
    ms: Optional[dict] = getattr(plan, "mesh_search", None)
    if not ms:
        return []

    def shape(d: dict) -> str:
        # a sequence axis (cp) only where the shape has one
        return " x ".join(f"{k}{d.get(k, 1)}" for k in ("pp", "dp", "cp", "tp") if k != "cp" or k in d)

    out = ["", f"mesh search: {ms.get('devices')} devices (nodes of {ms.get('node_size')}), chose "
               f"{shape(ms.get('chosen') or {})}; compared:"]
    for r in ms.get("compared") or []:
        if "error" in r:
            out.append(f"  {shape(r['shape'])}: {r['error'][:100]}")
        else:
            out.append(f"  {shape(r['shape'])}: {human_time(r.get('step_time', 0.0))}, "
                       f"{human_bytes(r.get('peak_memory', 0))}{'' if r.get('fits') else ' (does not fit)'}"
                       f"{', pipelined' if r.get('pipelined') else ''}")
    return out


def summary_lines(plan: "Plan") -> list[str]:
    """The mesh search, if any, then the pipeline: axes, schedule, micro-batches, bubble, and per
    stage its modules, times and its rank's memory."""
    pl: Optional[PipelineChoice] = getattr(plan, "pipeline", None)
    if not pl:
        return mesh_search_lines(plan)
    axes = ", ".join(f"{n}={s}" for n, s in zip(pl.mesh_names, pl.mesh_shape))
    out = ["", f"pipeline on axis {pl.axis!r} ({axes}; placements above are per stage, on the other axes, "
               f"per micro-batch):",
           f"  {pl.schedule}, {pl.microbatches} micro-batches, {pl.virtual_stages} stage(s) per "
           f"rank; bubble {100 * pl.bubble:.1f}%, replayed makespan {human_time(pl.makespan or 0.0)}, "
           f"gradient sync exposed {human_time(pl.sync_time or 0.0)}, one boundary transfer "
           f"{human_time(pl.p2p_time or 0.0)}"]
    ranks = pl.stage_ranks or []
    times = pl.stage_times or []
    flight = pl.in_flight or []
    mem = pl.rank_memory or []
    redo = pl.recompute or []
    for s, paths in enumerate(pl.stages):
        r = ranks[s] if s < len(ranks) else s
        t = times[s] if s < len(times) else [0.0, 0.0, 0.0]
        rc = redo[s] if s < len(redo) else None
        again = (f"; recomputes {len(rc.layers)} layer(s) ({rc.mode})" if rc is not None and rc.layers else "")
        out.append(f"  stage {s} (rank {r}): {_span(paths)}; fwd {human_time(t[0])}, bwd {human_time(t[1] + t[2])} "
                   f"per micro-batch, {flight[s] if s < len(flight) else '?'} in flight; rank memory "
                   f"{human_bytes(mem[r]) if r < len(mem) else '?'}{again}")
    others = (pl.compared or [])[:6]
    if len(others) > 1:
        out.append("  compared: " + "; ".join(
            f"{c.schedule} m={c.microbatches} v={c.virtual_stages} {human_time(c.step_time or 0.0)}"
            f" {human_bytes(c.peak_memory or 0)}{' (estimated)' if c.estimated else ''}" for c in others))
    if pl.batch_coupled:
        out.append(f"  batch-coupled ops ({', '.join(pl.batch_coupled[:4])}): the reference is the "
                   f"{pl.reference or 'micro-batched'} single-device run")
    return mesh_search_lines(plan) + out


def explain_lines(plan: "Plan", path: str) -> list[str]:
    """Which pipeline stage (and rank) holds ``path``."""
    pl: Optional[PipelineChoice] = getattr(plan, "pipeline", None)
    if not pl or not path:
        return []
    ranks = pl.stage_ranks or []
    out = []
    for s, paths in enumerate(pl.stages):
        if any(p == path or path.startswith(p + ".") or p.startswith(path + ".") for p in paths):
            out.append(f"pipeline stage {s} of {len(pl.stages)} (rank {ranks[s] if s < len(ranks) else s} on axis "
                       f"{pl.axis!r}, {pl.schedule}, {pl.microbatches} micro-batches)")
    return out


def diff_lines(a: "Plan", b: "Plan") -> list[str]:
    """What differs between two plans' pipelines (and their mesh searches' choices)."""
    pa: Optional[PipelineChoice] = getattr(a, "pipeline", None)
    pb: Optional[PipelineChoice] = getattr(b, "pipeline", None)
    ma = (getattr(a, "mesh_search", None) or {}).get("chosen")
    mb = (getattr(b, "mesh_search", None) or {}).get("chosen")
    head = [f"mesh search chose: {ma or 'no search'} -> {mb or 'no search'}"] if ma != mb else []
    if pa == pb:
        return head
    if not pa or not pb:
        was, now = ("none" if not pa else pa.schedule), ("none" if not pb else pb.schedule)
        return head + [f"pipeline: {was} -> {now}"]
    out = head
    for k in ("schedule", "microbatches", "virtual_stages"):
        if getattr(pa, k) != getattr(pb, k):
            out.append(f"pipeline {k}: {getattr(pa, k)} -> {getattr(pb, k)}")
    if pa.stages != pb.stages:
        out.append("pipeline stages: " + " | ".join(str(len(s)) for s in pa.stages) + " -> "
                   + " | ".join(str(len(s)) for s in pb.stages) + " modules per stage")
    if pa.bubble != pb.bubble:
        out.append(f"pipeline bubble: {100 * pa.bubble:.1f}% -> {100 * pb.bubble:.1f}%")
    ra = [len(r.layers) for r in pa.recompute or []]
    rb = [len(r.layers) for r in pb.recompute or []]
    if ra != rb:
        out.append(f"pipeline recomputed layers per stage: {ra or 'none'} -> {rb or 'none'}")
    if pa.rank_memory != pb.rank_memory:
        out.append("pipeline memory per rank: " + ", ".join(human_bytes(x) for x in pa.rank_memory or [])
                   + " -> " + ", ".join(human_bytes(x) for x in pb.rank_memory or []))
    return out


__all__ = ["diff_lines", "explain_lines", "mesh_search_lines", "summary_lines"]
