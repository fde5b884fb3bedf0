"""Calibration inside the processes of a run: ``nprocs`` local gloo processes measure at once.

A program on ``nprocs`` local processes does not run at the speed one process measures alone: the
processes share the machine's cores (4 processes on 2 cores each get about half a core), so its
compute, its memory traffic and its per-op dispatch run slower; and a collective issued between
ops costs more than one timed on idle processes, since every member has to be scheduled to take
its part (its CPU cost under contention). So ``calibrate(path, nprocs=N)`` measures everything in
``N`` processes that run the same measurements at the same moment (``_worker``):

- the compute figures of ``calibrate.measure_compute`` (matmul rate and its shape curves, memory
  bandwidth, attention, the per-op dispatch floor), each process timing its own and the figures
  taken as the median over processes of the median over repetitions (not the best: a best time
  is the moment a neighbour happened to wait);
- each collective kind the programs run (all-reduce, all-gather, reduce-scatter, all-to-all), at a
  few sizes, through the path programs use (torch's functional collectives on a one-worker gloo
  group, waited at once), *in context*: a block of compute with one collective after each piece
  against the same block without them, interleaved; the difference per collective is its cost
  (the max over processes of each block's time, as a step's time is the slowest rank's).

- how much a collective issued before compute and waited after it slows the step (``overlap_of``):
  the fraction of compute throughput lost while it runs (``Hardware.overlap_slowdown``): on a GPU a
  collective's kernels take a few SMs (a small fraction); with more processes than cores, gloo's
  worker thread takes a core a rank would compute on (near 1: the traffic is paid in full).

``fit_link`` turns the collective costs into the link's (latency, bandwidth) and a factor per kind
(``Link.factors``) by least squares of relative error against ``comm.collective_time``'s ring
formulas: the latency and bandwidth are the all-reduce's, and each other kind's factor is what its
implementation costs over its ring price. On gloo that matters for reduce-scatter, which torch runs
as an all-reduce of the whole tensor (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``; the
profiler records ``gloo:all_reduce`` for it): its factor comes out near 2, so the planner prices it
as what runs.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import tempfile
import time
from typing import Callable

import torch

from autopar.cost_model.comm import collective_time, ring_time
from autopar.cost_model.hardware import Link

#: the collective kinds measured, as the cost model names them
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: bytes of the tensor as the group sees it (``comm.collective_time``'s ``nbytes``)
SIZES = (1 << 10, 256 << 10, 4 << 20)
QUICK_SIZES = (1 << 10, 256 << 10)


def _collective(kind: str, nbytes: int, n: int, group) -> Callable[[], object]:
    """A call that issues one ``kind`` collective of ``nbytes`` (the group's view) as a lowered
    program does (``autopar._torch_compat``'s functional collectives) and returns its result, to
    be waited (``_wait``)."""
    from autopar import _torch_compat as tc

    elems = max(n, nbytes // 4)
    elems -= elems % n
    if kind == "all_reduce":
        x = torch.ones(elems)
        return lambda: tc.functional_all_reduce(x, "sum", group)
    if kind == "reduce_scatter":
        x = torch.ones(elems)
        return lambda: tc.functional_reduce_scatter(x, "sum", 0, group)
    if kind == "all_gather":
        x = torch.ones(elems // n)
        return lambda: tc.functional_all_gather(x, 0, group)
    if kind == "all_to_all":
        x = torch.ones(n, elems // (n * n))
        return lambda: tc.functional_all_to_all(x, group)
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


def _wait(t):
    return t.wait() if type(t) is not torch.Tensor and hasattr(t, "wait") else t


def _blocks(filler: Callable[[], object], coll: Callable[[], object], count: int, reps: int, barrier) -> list:
    """``reps`` pairs of block times (seconds): ``count`` fillers alone, then ``count`` fillers
    each followed by the collective (the order alternates, so drift hits both alike)."""
    out = []
    for r in range(reps):
        pair = [0.0, 0.0]
        for mode in ((0, 1) if r % 2 == 0 else (1, 0)):
            barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                filler()
                if mode:
                    coll()
            pair[mode] = time.perf_counter() - t0
        out.append(pair)
    return out


def _overlap_blocks(filler: Callable[[], object], issue: Callable[[], object], reps: int, barrier) -> list:
    """``reps`` triples of block times (seconds per collective): compute alone; compute, then the
    collective issued and waited (exposed); the collective issued, then the compute, then waited
    (what a program does with its parameter gathers and gradient reductions). The compute per
    collective is about what the collective costs between compute (measured first)."""
    count = 4

    def exposed_once() -> None:
        filler()
        _wait(issue())

    for _ in range(2):
        exposed_once()
    barrier()
    t0 = time.perf_counter()
    for _ in range(count):
        exposed_once()
    t_both = (time.perf_counter() - t0) / count
    t0 = time.perf_counter()
    filler()
    t_fill = max(time.perf_counter() - t0, 1e-6)
    per = max(1, min(50, round(max(t_both - t_fill, t_fill) / t_fill)))

    def compute() -> None:
        for _ in range(per):
            filler()

    def exposed() -> None:
        compute()
        _wait(issue())

    def hidden() -> None:
        h = issue()
        compute()
        _wait(h)

    out = []
    for r in range(reps):
        row = [0.0, 0.0, 0.0]
        for which in ((0, 1, 2) if r % 2 == 0 else (2, 1, 0)):
            fn = (compute, exposed, hidden)[which]
            barrier()
            t0 = time.perf_counter()
            for _ in range(count):
                fn()
            row[which] = (time.perf_counter() - t0) / count
        out.append(row)
    return out


#: the largest slowdown calibrate reports: 1 would mean compute stops while a collective runs
MAX_SLOWDOWN = 0.99


def overlap_of(blocks_by_rank: list) -> float:
    """``Hardware.overlap_slowdown`` from ``_overlap_blocks``' times (the slowest rank's block in each
    repetition): with compute ``C`` alone, the collective ``T`` = exposed - ``C``, and the two
    overlapped taking ``hidden``, the cost model's ``hidden = max(C, T) + s * min(C, T)``
    (``autopar.passes.search.problem``) gives ``s``, clamped to [0, ``MAX_SLOWDOWN``]. Where the
    collective takes the cores compute needs (more processes than cores), ``s`` is near 1: the
    traffic is paid in full even when issued early.

    ``s`` is read per repetition (its three blocks ran back to back, so a load change between
    repetitions hits all three alike) and the median taken; repetitions where the collective took no
    time beside compute (``T <= 0``: noise swamped it) say nothing and are left out. When none is
    left the measurement is inconclusive and ``MAX_SLOWDOWN`` is returned: overlap never priced as
    free when it could not be seen to be (a free overlap makes the search hide every collective)."""
    reps = len(blocks_by_rank[0])
    rows = [[max(r[i][j] for r in blocks_by_rank) for j in range(3)] for i in range(reps)]
    found = []
    for comp, exposed, hidden in rows:
        traffic = exposed - comp
        if comp > 0 and traffic > 0:
            found.append(min(MAX_SLOWDOWN, max(0.0, (hidden - max(comp, traffic)) / min(comp, traffic))))
    return statistics.median(found) if found else MAX_SLOWDOWN


def _worker(rank: int, world: int, port: int, out_dir: str, quick: bool) -> None:
    """One measuring process: compute figures, then collectives in context; writes
    ``rank{r}.json``. Joins the store the parent hosts on ``port`` as a client."""
    import torch.distributed as dist

    from autopar import _torch_compat as tc
    from autopar.cost_model.measure import measure_compute

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        group = tc.new_one_worker_gloo_groups([list(range(world))], datetime.timedelta(seconds=300))[0]
        dist.barrier()
        compute = measure_compute(quick, pick=statistics.median)
        # a filler of about the size of a program's ops between collectives: a few small matmuls
        a, b = torch.randn(128, 128), torch.randn(128, 128)
        c = torch.empty(128, 128)

        def filler() -> None:
            for _ in range(4):
                torch.mm(a, b, out=c)

        reps = 3 if quick else 5
        colls = {}
        for kind in KINDS:
            for nbytes in (QUICK_SIZES if quick else SIZES):
                issue = _collective(kind, nbytes, world, group)

                def fn(issue=issue) -> None:
                    _wait(issue())
                for _ in range(2):
                    fn()  # warm up (connections, buffers)
                count = 8 if nbytes <= (256 << 10) else 3
                colls[f"{kind}:{nbytes}"] = dict(count=count, blocks=_blocks(filler, fn, count, reps, dist.barrier))
        # more repetitions than the collectives': one figure, read per repetition (``overlap_of``)
        overlap = _overlap_blocks(filler, _collective("all_reduce", 256 << 10, world, group), 2 * reps + 1,
                                  dist.barrier)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(compute=compute, collectives=colls, overlap=overlap), f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_in_processes(nprocs: int, quick: bool = False) -> dict:
    """Run the measurements in ``nprocs`` local gloo processes at once -> ``{"compute": {figure:
    median over processes}, "collectives": {(kind, nbytes): seconds per collective in context}, "overlap": fraction
    (``overlap_of``)}``."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # the parent hosts the store on a port the OS picks (port 0): two measurements, or a
    # measurement beside a test run, cannot race for a port
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(nprocs, store.port, tmp, quick), nprocs=nprocs, join=True)
        ranks = []
        for r in range(nprocs):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    del store
    compute = {k: statistics.median(float(r["compute"][k]) for r in ranks) for k in ranks[0]["compute"]}
    colls = {}
    for key, first in ranks[0]["collectives"].items():
        kind, nbytes = key.split(":")
        count = first["count"]
        # a block's time is the slowest process's; per collective: (with - without) / count
        per = []
        for i in range(len(first["blocks"])):
            without = max(r["collectives"][key]["blocks"][i][0] for r in ranks)
            with_ = max(r["collectives"][key]["blocks"][i][1] for r in ranks)
            per.append((with_ - without) / count)
        colls[(kind, int(nbytes))] = max(statistics.median(per), 1e-7)
    return dict(compute=compute, collectives=colls, overlap=overlap_of([r["overlap"] for r in ranks]))


#: the kind whose ring formula the fitted latency and bandwidth describe: its factor is 1 by
#: definition, every other measured kind's factor is its cost over its ring price (``Link.factors``)
REFERENCE_KIND = "all_reduce"
#: rounds of the alternating fit (each lowers the squared relative error; it stops when it settles)
FIT_ROUNDS = 200


def _fit_terms(rows: list) -> tuple[float, float]:
    """(alpha, 1/beta) minimising the sum over ``rows`` of ``(a * alpha + b / beta - 1) ** 2``
    (each row ``(a, b)``: a measurement's latency and byte coefficients over its time), both kept
    positive (a term the data cannot resolve falls back to fitting the other alone)."""
    saa = sum(a * a for a, _ in rows)
    sbb = sum(b * b for _, b in rows)
    sab = sum(a * b for a, b in rows)
    sa = sum(a for a, _ in rows)
    sb = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha = inv_beta = -1.0
    if det > 0:
        alpha = (sa * sbb - sb * sab) / det
        inv_beta = (saa * sb - sab * sa) / det
    if not (alpha > 0 and inv_beta > 0):
        if alpha > 0:  # only the latency resolved: bandwidth from the largest message
            inv_beta = max(1e-15, sb / sbb - sab / sbb * alpha) if sbb else 1e-15
        else:
            alpha = 1e-9
            inv_beta = sb / sbb if sbb else 1e-15
    return alpha, max(inv_beta, 1e-15)


def fit_link(costs: dict, n: int) -> Link:
    """The link whose ``collective_time`` best reproduces ``costs`` (``{(kind, nbytes): seconds}``
    over a group of ``n``): least squares of the relative error over the latency, the bandwidth
    and, per measured kind other than ``REFERENCE_KIND``, a factor on its ring time
    (``Link.factors``), fitted alternately (the link with the factors fixed, then each factor, the
    scale of its kind's ring prices that fits its measurements best, with the link fixed) until the
    figures settle. The factors are what makes a calibrated gloo mesh price reduce-scatter as what
    gloo runs: an all-reduce of the whole tensor (about twice its ring time); without the reference
    kind among ``costs`` every kind is priced by its ring formula alone (no factors)."""
    meas = []
    for (kind, nbytes), t in sorted(costs.items()):
        lat = ring_time(kind, 0, n, Link(1.0, 1e300))  # seconds per unit of latency
        per_byte = ring_time(kind, nbytes, n, Link(1e-300, 1.0))  # seconds per unit of 1/bandwidth
        meas.append((kind, lat / t, per_byte / t))  # relative: each row's target is 1
    kinds = sorted({k for k, _, _ in meas} - {REFERENCE_KIND}) if any(k == REFERENCE_KIND for k, _, _ in meas) else []
    factor = {k: 1.0 for k in kinds}
    alpha, inv_beta = _fit_terms([(a, b) for _, a, b in meas])
    for _ in range(FIT_ROUNDS if kinds else 0):
        alpha, inv_beta = _fit_terms([(factor.get(k, 1.0) * a, factor.get(k, 1.0) * b) for k, a, b in meas])
        moved = 0.0
        for k in kinds:
            p = [alpha * a + inv_beta * b for kk, a, b in meas if kk == k]  # ring price over measured
            new = sum(p) / sum(x * x for x in p)
            moved = max(moved, abs(new / factor[k] - 1.0))
            factor[k] = new
        if moved < 1e-12:
            break
    return Link(latency=alpha, bandwidth=1.0 / inv_beta, factors=factor)


def describe_link_fit(costs: dict, n: int, link: Link) -> list[str]:
    """One line per measured collective: measured and fitted seconds (for the calibration's report)."""
    out = []
    for (kind, nbytes), t in sorted(costs.items()):
        fit = collective_time(kind, nbytes, n, link)
        out.append(f"{kind} {nbytes} B: measured {t * 1e6:.0f} us, priced {fit * 1e6:.0f} us "
                   f"({fit / t if t else math.nan:.2f}x; {link.factor(kind):.2f}x its ring time)")
    return out


__all__ = ["KINDS", "REFERENCE_KIND", "describe_link_fit", "fit_link", "measure_in_processes", "overlap_of"]
