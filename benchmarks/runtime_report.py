"""The report of ``benchmarks/runtime.py``: predicted against measured (Spearman and Pearson),
the searched plan against the fastest measured plan of its case, as markdown tables."""

from __future__ import annotations

import json
import math
import os
import statistics

from runtime_ranks import GRAD_TOL, LLAMA_KV_HEADS, LOSS_TOL


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2 + 1  # ties share the mean rank
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def plan_key(family: str, shape, recipe: str, mult: int) -> str:
    return f"{family} ({', '.join(map(str, shape))}{',' if len(shape) == 1 else ''}) {recipe}" + (
        f" b x{mult}" if mult != 1 else "")


def case_of(key: str) -> str:
    """The case (family, mesh, batch) of a plan's key: the key without its recipe."""
    head, rest = key.split(") ", 1)
    parts = rest.split(" ")
    return head + ")" + ("".join(" " + x for x in parts[1:]))


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def report(cfg, res, plans, steps, warmup, calib_s, profile, args) -> int:
    T = res["times"]
    med = {k: statistics.median(v["fwd_bwd"]) for k, v in T.items()}
    omed = {k: statistics.median(v["opt"]) for k, v in T.items()}
    spread = {k: (min(v["fwd_bwd"]), max(v["fwd_bwd"])) for k, v in T.items()}
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}

    def coll(k):
        c = res["collectives"][k]
        return f"{sum(c.values())} (" + " ".join(f"{v} {short.get(n, n)}" for n, v in sorted(c.items())) + ")"
    print(f"\nGPT and LLaMA (GQA {LLAMA_KV_HEADS} kv heads, SwiGLU) n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} "
          f"n_head={cfg['n_head']} vocab={cfg['vocab_size']}, "
          f"global batch {cfg['batch']} x seq {cfg['seq']}, fp32, {res['world']} gloo processes, "
          f"torch {res['torch']}; warmup {warmup}, median of {steps} steps (max over ranks), interleaved")
    print(f"autopar at {_git_rev()}")
    print(f"load average (1 min) before / after the launch: {res['load'][0]:.1f} / {res['load'][1]:.1f}")
    print(f"profile: {profile}" + (f" (calibrated in {calib_s:.1f} s)" if calib_s is not None else "") +
          f": {res['profile_figures']}")
    for line in res.get("calibration") or ():
        print(f"    {line}")
    print(f"setup in the ranks (reference, compile x{len(plans)}, checks): {res['setup_s']:.1f} s; "
          f"compile per plan: {', '.join(f'{v:.1f}' for v in res['compile_s'].values())} s\n")

    print("### autopar against hand-written, mesh (4,)\n")
    print("| variant | loss (ref) | max rel. grad err | collectives per fwd+bwd | fwd+bwd ms median [min-max] | AdamW (foreach) step ms | ratio fwd+bwd | ratio fwd+bwd+opt |")
    print("|---|---|---|---|---|---|---|---|")
    for mine, hand in (("gpt (4,) megatron_tp", "hand:dtensor_tp"), ("gpt (4,) ddp", "hand:ddp")):
        if mine not in T:
            continue
        for k in (mine, hand):
            c = res["checks"][k]
            lo, hi = spread[k]
            r1 = med[mine] / med[hand]
            r2 = (med[mine] + omed[mine]) / (med[hand] + omed[hand])
            ratio = (f"**{r1:.2f}**", f"{r2:.2f}") if k == mine else ("1", "1")
            label = {"hand:dtensor_tp": "hand-written: DTensor parallelize_module (Colwise/Rowwise)",
                     "hand:ddp": "hand-written: torch DistributedDataParallel"}.get(k) or f"autopar {k}"
            print(f"| {label} | {c['loss']:.6f} ({c['ref_loss']:.6f}) | {c['grad_err']:.1e} | {coll(k)} | {ms(med[k])} "
                  f"[{ms(lo)}-{ms(hi)}] | {ms(omed[k])} | {ratio[0]} | {ratio[1]} |")

    print("\n### predicted (calibrated cpu profile) against measured\n")
    print("Measured: one training step (forward + backward + AdamW foreach step: what a plan's step time "
          "prices), max over ranks; median [min-max] of the timed steps.\n")
    print("| plan | source | batch | predicted ms (compute / comm) | measured step ms median [min-max] | measured / predicted | collectives per fwd+bwd (planned per step) | check: loss err, grad err |")
    print("|---|---|---|---|---|---|---|---|")
    smed = {k: statistics.median(v["step"]) for k, v in T.items()}
    srange = {k: (min(v["step"]), max(v["step"])) for k, v in T.items()}
    xs, ys = [], []
    for p in plans:
        k = p["key"]
        c = res["checks"].get(k)
        chk = f"{c['loss_err']:.0e}, {c['grad_err']:.0e}" if c else "(other batch)"
        lo, hi = srange[k]
        print(f"| {k} | {p['source']} | {p['batch']}x{cfg['seq']} | {ms(p['step_time'])} ({ms(p['compute_time'])} / "
              f"{ms(p['comm_time'])}) | {ms(smed[k])} [{ms(lo)}-{ms(hi)}] | {smed[k] / p['step_time']:.2f} | {coll(k)} "
              f"({p.get('n_collectives', '?')}) | {chk} |")
        xs.append(p["step_time"])
        ys.append(smed[k])
    rho = spearman(xs, ys)
    print(f"\nSpearman rank correlation, predicted vs measured, {len(xs)} plans: **{rho:.2f}**")
    ncoll = [sum(res["collectives"][p["key"]].values()) for p in plans]
    print(f"Spearman rank correlation, number of collectives vs measured: {spearman(ncoll, ys):.2f}")
    pearson_log = _pearson([math.log(x) for x in xs], [math.log(y) for y in ys])
    print(f"Pearson correlation of log times: {pearson_log:.2f}; "
          f"measured/predicted median {statistics.median(y / x for x, y in zip(xs, ys)):.2f}")
    print("\n### the searched plan in each case\n")
    print("| case | searched plan ms median [min-max] | fastest measured | its ms median [min-max] | predicted fastest | verdict |")
    print("|---|---|---|---|---|---|")
    cases: dict = {}
    for p in plans:
        cases.setdefault(case_of(p["key"]), []).append(p)
    fails = 0
    for case, ps in cases.items():
        srch = next((p for p in ps if p["recipe"] == "search"), None)
        if srch is None:
            continue
        best = min(ps, key=lambda p: smed[p["key"]])
        pbest = min(ps, key=lambda p: p["step_time"])
        s_lo, s_hi = srange[srch["key"]]
        b_lo, b_hi = srange[best["key"]]
        if best is srch:
            verdict = "fastest"
        elif s_lo <= b_hi:
            verdict = "overlaps the fastest"
        else:
            verdict = "**slower**"
            fails += 1
        print(f"| {case} | {ms(smed[srch['key']])} [{ms(s_lo)}-{ms(s_hi)}] | {best['recipe']} | {ms(smed[best['key']])} "
              f"[{ms(b_lo)}-{ms(b_hi)}] | {pbest['recipe']} | {verdict} |")
    print(f"\nsearched plan fastest or within the fastest's min-max in {len(cases) - fails} of {len(cases)} cases; "
          f"Spearman {rho:.2f} over {len(xs)} plans")
    if res.get("cprofile"):
        print("\n### cProfile, rank 0, 3 forward+backward steps each\n")
        for k, text in res["cprofile"].items():
            print(f"#### {k}\n```\n{text.strip()}\n```")
    bad = [k for k, c in res["checks"].items() if not (c["loss_err"] < LOSS_TOL and c["grad_err"] < GRAD_TOL)]
    if bad:
        print(f"\nMISMATCH against the single-process reference (loss rel. err >= {LOSS_TOL:g} or grad rel. err >= "
              f"{GRAD_TOL:g}): {', '.join(bad)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cfg=cfg, res=res, plans=[{k: v for k, v in p.items() if k != "json"} for p in plans]), f, indent=1)
    return 1 if bad else 0


def _git_rev() -> str:
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "../autopar"], cwd=here,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + (" + uncommitted changes in autopar/" if dirty else "")
    except Exception:  # noqa: BLE001 - not a git checkout
        return "unknown revision"


def _pearson(a, b) -> float:
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    num = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    den = math.sqrt(sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b))
    return num / den if den else float("nan")
