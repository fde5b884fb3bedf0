"""Searched plans against the hand-written recipes, for GPT and LLaMA models on H100 meshes.

For every (family, size, mesh) cell: plan a training step (bf16 mixed precision, AdamW — the h100
defaults) with ``autopar.planner.intra.run_passes`` and print the searched plan's estimated step time, peak
memory per device and source ("search", or the recipe it fell back to), the search's own plan
(what the ILP found, before the best-of with the recipes), every recipe's step time
and peak memory (or its error), and two checks:

- ``faster``: the chosen plan is no slower than the best recipe that fits the memory budget (with
  ``--checkpointing``, recomputing or not);
- ``fits``: the chosen plan fits wherever any recipe fits.

Where nothing fits, the cell says so with the memory the leanest plan would need (the
``InfeasibleError`` message). A failure in one cell is printed in that cell; the table goes on.

Global batch × sequence per mesh (sequence 2048 throughout; 1 sequence per data-parallel replica
or more, so DDP/FSDP apply everywhere):

    (8,)      8 × 2048       (2, 4)     8 × 2048
    (8, 8)   64 × 2048       (4, 8, 8) 256 × 2048

    python benchmarks/recipes.py [--families gpt llama] [--sizes 125M 1B ...]
        [--meshes 8 2x4 8x8 4x8x8] [--layers N] [--quick] [--markdown] [--checkpointing]

With ``--checkpointing`` every recipe is priced a second time with every layer recomputed (the
better of ``"full"`` and ``"selective"``); the plan column says what the search recomputes.

The captured graph is shared between meshes with the same batch (``graph=``); per-cell wall time
is capture (when the cell captured) plus the planning passes.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
import time
import traceback

FAMILY_SIZES = {
    "gpt": ["125M", "350M", "1.3B", "2.7B", "6.7B", "13B", "30B", "70B"],
    "llama": ["1B", "3B", "llama3-8b", "llama3-70b"],
}
LAYER_KEY = {"gpt": "n_layer", "llama": "n_layers"}
MESHES = {
    "8": ({"dp": 8}, 8),
    "2x4": ({"dp": 2, "tp": 4}, 8),
    "8x8": ({"dp": 8, "tp": 8}, 64),
    "4x8x8": ({"pp_dp": 4, "dp": 8, "tp": 8}, 256),
}
SEQ = 2048
QUICK = dict(families=["gpt", "llama"], sizes=["125M", "1B"], meshes=["8", "2x4"])
GiB = 1024 ** 3


def _gib(b) -> str:
    return "-" if b is None or not math.isfinite(b) else f"{b / GiB:.1f}"


def _ms(t) -> str:
    return f"{t * 1e3:.1f}"


def _recompute_text(p) -> str:
    """What the plan recomputes: "none" or per layer group "k/count mode"."""
    rc = p.recompute
    if rc is None or not rc.any:
        return "none"
    return ", ".join(f"{k}/{t.count} {m}" for t, m, k in zip(p.terms, rc.modes, rc.counts) if k)


def checkpointed_recipes(graph, model, inputs, mesh, names) -> dict:
    """Each recipe priced with every layer recomputed, per mode; the better of the two (fitting
    first, then faster) with its mode, or the error."""
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions

    out = {}
    for name in names:
        found = []
        for mode in ("full", "selective"):
            try:
                q = run_passes(model, mesh, inputs, options=PlanOptions(progress=False, graph=graph, recipe=name,
                                                                       checkpointing=mode))
            except Exception as e:  # noqa: BLE001 - shown in the cell
                out.setdefault(name, {"error": f"{type(e).__name__}: {e}"})
                continue
            budget = q.problem.memory_budget
            found.append({"step_time": q.cost.step_time, "peak_memory": int(q.cost.peak_memory),
                          "fits": q.cost.peak_memory <= budget, "mode": mode})
        if found:
            out[name] = min(found, key=lambda b: (not b["fits"], b["step_time"]))
    return out


def run_cell(graph, model, inputs, mesh_key, recipes_names, checkpointing: bool = False):
    """One planning run; returns a dict describing the cell (with ``checkpointing``, each recipe
    priced again with every layer recomputed: ``cell["checkpointed"]``)."""
    import autopar
    from autopar.planner.intra import run_passes
    from autopar.planner.options import PlanOptions
    from autopar.errors import InfeasibleError

    axes, _ = MESHES[mesh_key]
    mesh = autopar.Mesh(axes, device="h100")
    cell = {"mesh": "(" + ", ".join(str(v) for v in axes.values()) + ("," if len(axes) == 1 else "") + ")"}
    t0 = time.perf_counter()
    try:
        p = run_passes(model, mesh, inputs, options=PlanOptions(progress=False, graph=graph))
    except InfeasibleError as e:
        cell.update(status="infeasible", error=str(e), plan_s=time.perf_counter() - t0)
        return cell
    except Exception as e:  # noqa: BLE001 - one cell's failure must not stop the table
        cell.update(status="error", error=f"{type(e).__name__}: {e}", plan_s=time.perf_counter() - t0,
                    tb=traceback.format_exc())
        return cell
    cell["plan_s"] = time.perf_counter() - t0
    budget = p.problem.memory_budget
    if checkpointing:
        cell["checkpointed"] = checkpointed_recipes(graph, model, inputs, mesh, recipes_names)
    cell.update(status="ok", step=p.cost.step_time, peak=float(p.cost.peak_memory), source=p.source,
                recompute=_recompute_text(p),
                budget=budget, baselines=p.baselines, phases=p.phases,
                solver=(p.solution.stats if p.solution is not None else None),
                searched=(None if p.searched is None else
                          {"step_time": p.searched.step_time, "peak_memory": int(p.searched.peak_memory),
                           "fits": p.searched.peak_memory <= budget}))
    try:  # propagation only (no annotations here: every node's cheapest local choice), same graph
        q = run_passes(model, mesh, inputs, options=PlanOptions(progress=False, graph=graph, search="propagate"))
        cell["propagate"] = {"step_time": q.cost.step_time, "peak_memory": int(q.cost.peak_memory),
                             "fits": q.cost.peak_memory <= budget}
    except Exception as e:  # noqa: BLE001
        cell["propagate"] = {"error": f"{type(e).__name__}: {e}"}
    fitting = [b for b in p.baselines.values() if "error" not in b and b["fits"]]
    fitting += [b for b in cell.get("checkpointed", {}).values() if "error" not in b and b["fits"]]
    fits = p.cost.peak_memory <= budget
    if fitting:
        best = min(b["step_time"] for b in fitting)
        cell["best_recipe"] = best
        cell["faster"] = p.cost.step_time <= best * (1 + 1e-9)
        cell["fits_ok"] = fits
        cell["speedup"] = best / p.cost.step_time
    else:
        cell["best_recipe"] = None
        cell["faster"] = None  # nothing to compare with
        cell["fits_ok"] = None
    return cell


def recipe_text(b: dict) -> str:
    if "error" in b:
        return "error: " + b["error"]
    return f"{_ms(b['step_time'])} ms / {_gib(b['peak_memory'])} GiB" + ("" if b["fits"] else " (over)")


def verdict(cell) -> str:
    if cell["status"] == "infeasible":
        return "nothing fits"
    if cell["status"] == "error":
        return "ERROR"
    if cell["faster"] is None:
        return "no recipe fits; search fits" if cell["peak"] <= cell["budget"] else "no recipe fits"
    ok = cell["faster"] and cell["fits_ok"]
    return ("ok" if ok else "FAIL") + f" (x{cell['speedup']:.2f} vs best recipe)"


def _short_infeasible(msg: str) -> str:
    # "... the leanest plan found (X) needs N GiB (params ...); ..." -> "leanest (X) needs N GiB"
    try:
        i = msg.index("the leanest plan found")
        j = msg.index(" (params", i)
        return msg[i + len("the "):j].replace("plan found ", "")
    except ValueError:
        return msg[:160]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["gpt", "llama"], choices=sorted(FAMILY_SIZES))
    ap.add_argument("--sizes", nargs="+", default=None, help="sizes to keep (any family's names)")
    ap.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    ap.add_argument("--layers", type=int, default=None, help="cap the number of layers (default: full depth)")
    ap.add_argument("--quick", action="store_true", help="125M and 1B on (8,) and (2, 4)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table at the end")
    ap.add_argument("--checkpointing", action="store_true",
                    help="also price each recipe with every layer recomputed (the better of full and selective)")
    args = ap.parse_args(argv)
    if args.quick:
        args.families = [f for f in args.families if f in QUICK["families"]]
        args.sizes = QUICK["sizes"] if args.sizes is None else args.sizes
        args.meshes = QUICK["meshes"]

    import torch

    torch.set_num_threads(1)
    import autopar.models as M
    from autopar import recipes as R

    cells = []
    t_all = time.perf_counter()
    for fam in args.families:
        for size in FAMILY_SIZES[fam]:
            if args.sizes is not None and size not in args.sizes:
                continue
            graphs: dict[int, tuple] = {}
            for mk in args.meshes:
                batch = MESHES[mk][1]
                row = {"family": fam, "size": size, "batch": batch, "seq": SEQ}
                capture_s = 0.0
                try:
                    if batch not in graphs:
                        graphs.clear()
                        gc.collect()
                        over = {LAYER_KEY[fam]: args.layers} if args.layers else {}
                        if args.layers:
                            full = M.PRESETS[fam][size][LAYER_KEY[fam]]
                            over = {LAYER_KEY[fam]: min(args.layers, full)}
                        model, inputs = M.make(fam, size=size, batch=batch, seq=SEQ, device="meta", **over)
                        from autopar.ir.capture import capture

                        t0 = time.perf_counter()
                        graph = capture(model, tuple(inputs))
                        capture_s = time.perf_counter() - t0
                        nparams = M.num_params(model)
                        layers = getattr(model.cfg if hasattr(model, "cfg") else None, LAYER_KEY[fam], None)
                        graphs[batch] = (graph, model, inputs, nparams, layers)
                    graph, model, inputs, nparams, layers = graphs[batch]
                    row.update(params=nparams, layers=layers)
                    cell = run_cell(graph, model, inputs, mk, R.NAMES, args.checkpointing)
                except Exception as e:  # noqa: BLE001
                    cell = {"mesh": mk, "status": "error", "error": f"{type(e).__name__}: {e}", "plan_s": 0.0,
                            "tb": traceback.format_exc()}
                row.update(cell)
                row["capture_s"] = capture_s
                row["wall_s"] = capture_s + cell.get("plan_s", 0.0)
                cells.append(row)
                print_row(row, R.NAMES)
                sys.stdout.flush()
    total = time.perf_counter() - t_all
    print(f"\n{len(cells)} cells in {total:.0f} s")
    summarize(cells)
    if args.markdown:
        print()
        print_markdown(cells, R.NAMES)
    return 0


def print_row(r, names) -> None:
    head = (f"{r['family']:<5} {r['size']:<10} {r.get('params', 0) / 1e9:6.2f}B L{r.get('layers')} "
            f"{r['batch']}x{r['seq']} mesh {r['mesh']:<10} wall {r['wall_s']:.1f} s "
            f"(capture {r['capture_s']:.1f}, plan {r.get('plan_s', 0):.1f})")
    print(head)
    if r["status"] == "ok":
        print(f"    search   {_ms(r['step'])} ms / {_gib(r['peak'])} GiB  source={r['source']}  "
              f"recompute {r['recompute']}  budget {_gib(r['budget'])} GiB  -> {verdict(r)}")
        if r.get("searched"):
            print(f"    {'search only':<12} {recipe_text(r['searched'])}  (the search's own plan)")
        for n in names:
            b = r["baselines"].get(n)
            if b is not None:
                c = r.get("checkpointed", {}).get(n)
                more = "" if c is None else f"   recomputed: {recipe_text(c)}" + (f" ({c['mode']})" if "mode" in c else "")
                print(f"    {n:<12} {recipe_text(b)}{more}")
        if r.get("propagate"):
            print(f"    {'propagate':<12} {recipe_text(r['propagate'])}")
    else:
        print(f"    {r['status'].upper()}: {r['error']}")
        if r.get("tb"):
            print("    " + r["tb"].replace("\n", "\n    "))


def summarize(cells) -> None:
    ok = [c for c in cells if c["status"] == "ok"]
    comp = [c for c in ok if c["faster"] is not None]
    print(f"cells planned: {len(ok)}/{len(cells)}; infeasible: "
          f"{sum(c['status'] == 'infeasible' for c in cells)}; errors: {sum(c['status'] == 'error' for c in cells)}")
    print(f"no slower than best fitting recipe: {sum(c['faster'] for c in comp)}/{len(comp)}; "
          f"fits wherever a recipe fits: {sum(c['fits_ok'] for c in comp)}/{len(comp)}")
    print(f"source search: {sum(c['source'] == 'search' for c in ok)}/{len(ok)}; fell back to a recipe: "
          + ", ".join(f"{c['family']} {c['size']} {c['mesh']} -> {c['source']}" for c in ok if c['source'] != 'search'))
    walls = [c["wall_s"] for c in cells]
    if walls:
        print(f"per-cell wall: max {max(walls):.1f} s, mean {sum(walls) / len(walls):.1f} s")


def print_markdown(cells, names) -> None:
    hdr = ["model", "size", "batch×seq", "mesh", "plan (ms / GiB, source)", "search only"] + list(names) + \
        ["propagate", "verdict", "wall s"]
    print("| " + " | ".join(hdr) + " |")
    print("|" + "---|" * len(hdr))
    for r in cells:
        fam = {"gpt": "GPT", "llama": "LLaMA"}[r["family"]]
        lay = f" (L{r['layers']})" if r.get("layers") else ""
        base = [fam, r["size"] + lay, f"{r['batch']}×{r['seq']}", r["mesh"]]
        if r["status"] == "ok":
            src = r["source"].replace("recipe:", "")
            s = f"**{_ms(r['step'])} / {_gib(r['peak'])}** {src}" + (
                "" if r.get("recompute", "none") == "none" else f", recompute {r['recompute']}")
            own = r.get("searched")
            rec = ["-" if own is None else f"{_ms(own['step_time'])} / {_gib(own['peak_memory'])}"
                   + ("" if own["fits"] else " ✗")]
            for n in names:
                b = r["baselines"].get(n)
                if b is None:
                    rec.append("")
                elif "error" in b:
                    e = b["error"]
                    rec.append("n/a (1-D mesh)" if "needs a mesh with a data axis" in e
                               else "error: " + e[:60].replace("|", "/"))
                else:
                    rec.append(f"{_ms(b['step_time'])} / {_gib(b['peak_memory'])}" + ("" if b["fits"] else " ✗"))
                c = r.get("checkpointed", {}).get(n)
                if c is not None and "error" not in c and rec[-1] and not rec[-1].startswith(("n/a", "error")):
                    rec[-1] += (f"; {c['mode']}: {_ms(c['step_time'])} / {_gib(c['peak_memory'])}"
                                + ("" if c["fits"] else " ✗"))
            b = r.get("propagate") or {"error": "not run"}
            rec.append("error: " + b["error"][:60].replace("|", "/") if "error" in b else
                       f"{_ms(b['step_time'])} / {_gib(b['peak_memory'])}" + ("" if b["fits"] else " ✗"))
            v = verdict(r)
        elif r["status"] == "infeasible":
            s = "nothing fits: " + _short_infeasible(r["error"])
            rec = [""] * (len(names) + 2)
            v = "nothing fits"
        else:
            s = "ERROR: " + r["error"][:80].replace("|", "/")
            rec = [""] * (len(names) + 2)
            v = "ERROR"
        print("| " + " | ".join(base + [s] + rec + [v, f"{r['wall_s']:.1f}"]) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
