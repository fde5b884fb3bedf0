"""Long-context planning: LLaMA-3-8B dims (32 layers), one sequence of ``--seq`` tokens on
``--devices`` H100s (nodes of 8), ``autopar.Mesh.devices`` choosing the factorization (a ``cp``
sequence axis among them), bf16-mixed AdamW. Prints the planning time (wall and this process's CPU
seconds), the chosen shape, its predicted step time and tokens/s per GPU, its memory against the
budget, each attention op's form per axis, and what the search rejected with its price: the other
factorizations and the hand-written recipes.

``--workload 4k`` plans the 4k-token workload instead (batch ``--batch``, sequence 4096, ``--layers``
layers) and prints a digest of the plan's decisions (placements, op strategies, step time, peak) so
that two trees can be compared side by side: run it once with this tree first on ``PYTHONPATH`` and
once with the base commit's. Both workloads also print a hash of the whole plan file
(``Plan.to_json()``, without its timings): equal hashes, byte-identical plans.

    python benchmarks/long_context.py [--seq 131072] [--devices 8] [--layers 32] [--markdown]
    python benchmarks/long_context.py --workload 4k [--batch 8] [--devices 8] [--layers 8]
    python benchmarks/long_context.py --mesh cp=2,tp=4 [--checkpointing full]

``--mesh`` plans that mesh directly instead of the factorization search (``--checkpointing`` pins the
recomputation): the price of a shape the search rejected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time


def _model(layers: int, batch: int, seq: int):
    from autopar.models import make

    return make("llama", size="llama3-8b", batch=batch, seq=seq, device="meta", n_layers=layers,
                max_seq_len=max(seq, 8192))


def plan(layers: int, batch: int, seq: int, devices: int, axes=None, checkpointing=None):
    """``(plan, wall seconds, CPU seconds)`` of the model on ``Mesh.devices(devices)`` H100s (on
    ``Mesh(axes)`` when given)."""
    import autopar

    model, args = _model(layers, batch, seq)
    mesh = (autopar.Mesh(axes, device="h100") if axes else autopar.Mesh.devices(devices, device="h100", node_size=8))
    kw = {"checkpointing": checkpointing} if checkpointing else {}
    t0, c0 = time.perf_counter(), time.process_time()
    p = autopar.plan(model, mesh, args, precision="bf16-mixed", progress=False, **kw)
    return p, time.perf_counter() - t0, time.process_time() - c0


def digest(p) -> str:
    """A hash of the plan's decisions: placements, every op's strategy, the step time and the peak."""
    what = {"placements": p.placements, "strategies": [n["strategy"] for n in p.nodes],
            "step_time": round(p.step_time, 12), "peak": int(p.peak_memory), "mesh": list(p.mesh_shape)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def plan_hash(p) -> str:
    """A hash of the plan file (``Plan.to_json()``: no timings)."""
    return hashlib.sha256(p.to_json().encode()).hexdigest()[:16]


def _shape(d: dict) -> str:
    return " x ".join(f"{k}{v}" for k, v in d.items())


def report(p, wall: float, cpu: float, seq: int, batch: int, devices: int) -> list[str]:
    gib = 2 ** 30
    tps = seq * batch / p.step_time / devices
    ms = p.mesh_search or {}
    out = [f"chosen: {_shape(ms.get('chosen', {}) or dict(zip(p.axis_names, p.mesh_shape)))} (mesh {dict(zip(p.axis_names, p.mesh_shape))})",
           f"planning: {wall:.1f} s wall, {cpu:.1f} s CPU",
           f"step {p.step_time:.3f} s (compute {p.compute_time:.3f} s, communication {p.comm_time:.3f} s), "
           f"{tps:,.0f} tokens/s per GPU",
           f"peak {p.peak_memory / gib:.1f} GiB of {p.memory_budget / gib:.1f} GiB ({'fits' if p.fits else 'over'}): "
           + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in p.memory.items()),
           "recomputed: " + (f"{len(p.checkpointing)} layer instances "
                             f"({', '.join(sorted(set(p.checkpointing.values())))})" if p.checkpointing else "none")]
    forms = {}
    for m in p.modules:
        for a in m.get("attention") or []:
            alts = ", ".join(f"{x['name']} {x['delta'] * 1e3:+.1f} ms" for x in a.get("alternatives") or [])
            forms.setdefault((a["axis"], a["form"], alts), 0)
            forms[(a["axis"], a["form"], alts)] += 1
    for (axis, form, alts), k in sorted(forms.items()):
        out.append(f"attention on {axis}: {form} ({k} op{'s' if k > 1 else ''}); other forms: {alts or 'none'}")
    out.append("rejected factorizations:")
    for r in ms.get("compared", []):
        if r["shape"] == ms.get("chosen"):
            continue
        if "error" in r:
            out.append(f"  {_shape(r['shape'])}: {r['error'][:400]}")
        else:
            out.append(f"  {_shape(r['shape'])}: step {r['step_time']:.3f} s, peak {r['peak_memory'] / gib:.1f} GiB"
                       f"{'' if r['fits'] else ' (over the budget)'}")
    out.append("recipes on the chosen mesh:")
    for name, b in sorted((p.baselines or {}).items()):
        if "error" in b:
            out.append(f"  {name}: {b['error'][:140]}")
        else:
            out.append(f"  {name}: step {b['step_time']:.3f} s, peak {b['peak_memory'] / gib:.1f} GiB"
                       f"{'' if b['fits'] else ' (over the budget)'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("long", "4k"), default="long")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mesh", default=None, help="axes such as cp=2,tp=4: plan that mesh directly")
    ap.add_argument("--checkpointing", default=None, help="with --mesh: none, full or selective")
    a = ap.parse_args()
    import autopar

    print(f"autopar from {autopar.__file__}")
    if a.workload == "4k":
        layers = a.layers or 8
        p, wall, cpu = plan(layers, a.batch, 4096, a.devices)
        print(f"4k workload: {layers} layers, batch {a.batch}, sequence 4096, {a.devices} H100s")
        print(f"chosen: {_shape((p.mesh_search or {}).get('chosen', {}))}, step {p.step_time:.4f} s, "
              f"peak {p.peak_memory / 2 ** 30:.2f} GiB")
        print(f"planning: {wall:.1f} s wall, {cpu:.1f} s CPU")
        print(f"decisions digest: {digest(p)}")
        print(f"plan file hash: {plan_hash(p)}")
        return
    layers = a.layers or 32
    axes = {k: int(v) for k, v in (x.split("=") for x in a.mesh.split(","))} if a.mesh else None
    p, wall, cpu = plan(layers, 1, a.seq, a.devices, axes, a.checkpointing)
    print(f"LLaMA-3-8B dims, {layers} layers, one sequence of {a.seq:,} tokens, {a.devices} H100s")
    print("\n".join(report(p, wall, cpu, a.seq, 1, a.devices)))
    print(f"plan file hash: {plan_hash(p)}")


if __name__ == "__main__":
    main()
