"""The expert layers' own factorization of the mesh, priced: a Hugging Face MoE of
``benchmarks/moe_scale.py`` (built on meta in bf16, default ``grouped_mm`` experts) planned with its
grouped products held to one layout at a time, against the search's own choice.

Layouts over the mesh's ``dp`` x ``tp`` (``ir/rules/expert.py``):

- ``search``: whatever the search chooses (every layout below is among its options);
- ``no experts``: no grouped product expert-parallel (rows or columns split, weights gathered);
- ``experts on tp`` / ``experts on dp``: the experts over one axis, the other free (it splits the
  rows: each group exchanges its own, or within an expert: expert-tensor parallelism);
- ``experts on dp, expert-tensor on tp``: the experts over dp, each expert's columns or contraction
  split on tp;
- ``experts over dp x tp``: the experts over both axes (a hierarchical exchange, one all-to-all per
  axis), whatever attention splits on them.

A layout is held by keeping, for every ``aten._grouped_mm``, only the strategies that run their
experts over exactly that set of axes (the rule's own strategies, filtered): the rest of the plan is
searched as usual, and the reshards between the products' layout and attention's are priced by the
edges. ``--devices`` also plans ``Mesh.devices(count)``, whose factorization considers an ``ep`` axis.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/moe_folding.py [--model qwen3_30b] [--layers 2]
        [--batch 256] [--devices] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from typing import Callable, Optional

from moe_scale import MODELS, build

GROUPED = "aten._grouped_mm.default"


def _held(axes: Optional[frozenset], other: Optional[Callable] = None) -> Callable:
    """A filter of a grouped product's strategies: experts over exactly ``axes`` (None: any)."""
    def keep(strategy) -> bool:
        tagged = frozenset(i for i, s in enumerate(strategy) if s.tag == "experts")
        return (axes is None or tagged == axes) and (other is None or other(strategy))
    return keep


LAYOUTS = {
    "search": _held(None),
    "no experts": _held(frozenset()),
    "experts on tp": _held(frozenset({1})),
    "experts on dp": _held(frozenset({0})),
    "experts on dp, expert-tensor on tp": _held(frozenset({0}), lambda s: s[1].tag in ("S:n", "S:k")),
    "experts over dp x tp": _held(frozenset({0, 1})),
}


def plan_held(model, kwargs, axes: dict, keep: Callable):
    """The plan with every grouped product's strategies filtered by ``keep``."""
    import autopar
    from autopar.ir.rules.base import RULES

    rule = RULES[GROUPED]
    compose = rule.compose
    rule.compose = lambda call, strats, mesh_shape: [s for s in compose(call, strats, mesh_shape) if keep(s)]
    try:
        return autopar.plan(model, autopar.Mesh(axes, device="h100"), (), kwargs, progress=False)
    finally:
        rule.compose = compose


def figures(plan, wall: float) -> dict:
    """The plan's step, throughput, memory, and its grouped products' tags (per mesh axis)."""
    tags = collections.Counter(", ".join(n.get("tags", [])) for n in plan.nodes if n.get("op") == GROUPED)
    return {"step_s": plan.step_time, "tokens_per_s_per_gpu": plan.tokens_per_second_per_device,
            "peak_gib": plan.peak_memory / 2**30, "fits": bool(plan.fits), "plan_s": wall,
            "grouped_mm_strategies": dict(tags)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_30b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--devices", action="store_true", help="also plan Mesh.devices(count) (the factorization search)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import autopar

    model, kwargs, axes = build(a.model, a.layers, a.batch)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, keep in LAYOUTS.items():
            t = time.perf_counter()
            try:
                plan = plan_held(model, kwargs, axes, keep)
                r = {"layout": name, **figures(plan, time.perf_counter() - t)}
                if name == "search":
                    first = next((n for n in plan.nodes if n.get("op") == GROUPED), None)
                    r["explain"] = [ln.strip() for ln in plan.explain(first.get("module", "")).splitlines()
                                    if ln.strip().startswith("experts over")][:2] if first else []
            except autopar.errors.AutoparError as e:
                r = {"layout": name, "error": str(e).splitlines()[0][:300]}
            rows.append(r)
            print(json.dumps(r), flush=True)
        if a.devices:
            count = 1
            for n in axes.values():
                count *= n
            t = time.perf_counter()
            plan = autopar.plan(model, autopar.Mesh.devices(count, device="h100"), (), kwargs, progress=False)
            r = {"layout": f"Mesh.devices({count})", "chosen": plan.mesh_search["chosen"],
                 **figures(plan, time.perf_counter() - t),
                 "compared": [{"shape": c["shape"], "step_s": c.get("step_time"), "fits": c.get("fits"),
                               "error": c.get("error")} for c in plan.mesh_search["compared"]]}
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
