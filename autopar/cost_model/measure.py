"""Timing primitives of the calibration: matmuls, copies, attention, the per-op dispatch floor,
and the fit of the shape curves (``autopar.cost_model.efficiency``) to them.

``measure_compute`` runs them all in this process; ``autopar.cost_model.calibrate`` calls it here
or in every process of a run at once (``calibrate_procs``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from autopar.cost_model import efficiency as eff
from autopar.cost_model.efficiency import Efficiency
from autopar.cost_model.hardware import PRESETS

#: how repeated timings are summarised: the best alone (one process on a quiet machine); the
#: in-process calibration (``calibrate_procs``) sets the median, as its processes share the cores
_PICK: list = [min]


def _best_time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _PICK[0](times)


#: bytes of operands each timing cycles through: more than a last-level cache holds, so every
#: op reads its operands from memory, as a program's ops read tensors other ops wrote (a matmul
#: timed on the same small operands again and again runs from cache, up to 2-3x faster here)
POOL_BYTES = 64 << 20


def _pool_size(nbytes_each: int) -> int:
    return max(1, min(64, POOL_BYTES // max(1, nbytes_each)))


def time_matmul(m: int, n: int, k: int, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """Seconds of one (m x k) @ (k x n) matmul, its operands cold (``POOL_BYTES``)."""
    size = torch.empty((), dtype=dtype).element_size()
    pool = _pool_size(size * (m * k + k * n + m * n))
    ops = [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype), torch.empty(m, n, dtype=dtype))
           for _ in range(pool)]
    inner = max(pool, min(4 * pool, int(2e7 // max(1, m * n * k))))  # tiny ones repeat so the clock resolves them

    def run() -> None:
        for i in range(inner):
            a, b, out = ops[i % pool]
            torch.mm(a, b, out=out)

    return _best_time(run, reps) / inner


def measure_matmul(n: int = 1024, dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """FLOP/s of an ``n``-cubed matmul."""
    return 2.0 * n**3 / time_matmul(n, n, n, dtype, reps)


#: the memory-bound ops timed, with the tensors each reads (it writes one): a copy and binary
#: arithmetic, what most of a program's non-matmul ops and the optimizer's update run. (Timing
#: transcendental activations too was tried: at 3-6x the time per byte here they made the rate
#: price every add and the AdamW step that much too slow, and the search traded collectives for
#: optimizer sharding that measured slower.)
ELEMENTWISE = (
    ("copy", 1, lambda x, y, o: o.copy_(x)),
    ("add", 2, lambda x, y, o: torch.add(x, y, out=o)),
    ("mul", 2, lambda x, y, o: torch.mul(x, y, out=o)),
)


def time_copy(nbytes: int, reps: int = 5) -> float:
    """Seconds per byte-equivalent pass of the ``ELEMENTWISE`` ops on float32 tensors of
    ``nbytes`` each, operands cold: the time of one op moving ``2 * nbytes`` (read + write) at the
    mix's rate (the ops' total bytes over their total time)."""
    n = max(1, nbytes // 4)
    pool = _pool_size(3 * 4 * n)
    bufs = [(torch.rand(n), torch.rand(n), torch.empty(n)) for _ in range(pool)]
    inner = max(pool, min(4 * pool, int((8 << 20) // max(1, nbytes))))
    moved = sum((k + 1) for _, k, _ in ELEMENTWISE) * 4 * n

    def run() -> None:
        for i in range(inner):
            x, y, o = bufs[i % pool]
            for _, _, fn in ELEMENTWISE:
                fn(x, y, o)

    t = _best_time(run, reps) / inner  # seconds for the whole mix once
    return t * (2 * 4 * n) / moved


def measure_memory_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes/s of the ``ELEMENTWISE`` mix on large tensors (read + write counted)."""
    return 2.0 * (nbytes // 4) * 4 / time_copy(nbytes, reps)


def time_attention(seq: int, head_dim: int = 64, heads: int = 4, reps: int = 3) -> tuple[float, float]:
    """Seconds of SDPA's forward and of its backward (float32, batch 1, not causal)."""
    q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    f = torch.nn.functional.scaled_dot_product_attention
    t_fwd = _best_time(lambda: f(q, k, v), reps)

    def both() -> None:
        f(q, k, v).sum().backward()

    t_both = _best_time(both, reps)
    return t_fwd, max(t_both - t_fwd, 1e-9)


def fit_half(x_small: float, ratio: float) -> float:
    """The half-constant h of ``x / (x + h)`` that makes a size ``x_small`` run at ``ratio`` of
    the large size's rate (the large one taken as saturated); 0 (flat) when it is not slower."""
    if not 0 < ratio < 1:
        return 0.0
    return x_small * (1.0 / ratio - 1.0)


def _attention_flops(seq: int, head_dim: int, heads: int) -> float:
    return 4.0 * heads * seq * seq * head_dim


def fit_efficiency(base: Efficiency, quick: bool, launch: float, reps: int) -> tuple[Efficiency, float, float]:
    """Measure the shape tables on this machine: returns the fitted ``Efficiency`` with the float32
    matmul peak (FLOP/s) and memory bandwidth (bytes/s) it is relative to."""
    big = 384 if quick else 1024
    t_big = time_matmul(big, big, big, reps=reps)
    peak = 2.0 * big**3 / t_big

    def rate(m: int, n: int, k: int) -> float:
        return 2.0 * m * n * k / max(time_matmul(m, n, k, reps=reps) - launch, 1e-9)

    small_mn = 16 if quick else 32
    h_mn = fit_half(small_mn * small_mn, rate(small_mn, small_mn, big) / peak)
    small_k = 8 if quick else 16
    h_k = fit_half(small_k, rate(big, big, small_k) / peak)
    # mm_max: so the fitted curve passes through the large measurement (peak is its rate)
    mm_max = 1.0 / (eff._sat(big * big, h_mn) * eff._sat(big, h_k))

    nb_big = (8 << 20) if quick else (32 << 20)
    bw = 2.0 * nb_big / time_copy(nb_big, reps)
    nb_small = 16 << 10
    bw_small = 2.0 * nb_small / max(time_copy(nb_small, reps) - launch, 1e-9)
    h_mem = fit_half(2 * nb_small, bw_small / bw)
    mem_max = 1.0 / eff._sat(2 * nb_big, h_mem)

    d, heads = 64, 4
    s1, s2 = (64, 256) if quick else (128, 512)
    e = {}
    for s in (s1, s2):
        tf, tb = time_attention(s, d, heads, reps)
        fl = _attention_flops(s, d, heads)
        e[s] = (fl / (peak * max(tf - launch, 1e-9)), 2.5 * fl / (peak * max(tb - launch, 1e-9)))

    def two_point(e1: float, e2: float) -> tuple[float, float]:
        r = e1 / e2
        den = r * s2 - s1
        h = s1 * s2 * (1 - r) / den if den > 0 and r < 1 else 0.0
        return min(2.0, e2 * (s2 + h) / s2), h

    fwd, h_seq = two_point(e[s1][0], e[s2][0])
    bwd, _ = two_point(e[s1][1], e[s2][1])
    fitted = Efficiency(mm_max=min(mm_max, 2.0), mm_half_mn=h_mn, mm_half_k=h_k, attn_fwd=fwd, attn_bwd=min(bwd, 2.0),
                        attn_half_seq=h_seq, attn_half_head_dim=base.attn_half_head_dim, mem_max=min(mem_max, 2.0),
                        mem_half_bytes=h_mem)
    fitted.validate()
    return fitted, peak, bw


def measure_launch_floor(reps: int = 2000) -> float:
    """Seconds per tiny op as a lowered program runs it: an ``fx.GraphModule`` calling ``reps``
    aten ops (``aten.add.Tensor`` on one element, each a new tensor) in its generated Python, the
    way the program runtime dispatches every local op. The cost model charges it per op
    (``Hardware.launch_floor``): on a CPU it is the interpreter's and the dispatcher's overhead,
    far above a GPU's kernel launch."""
    import torch.fx as fx

    g = fx.Graph()
    x = g.placeholder("x")
    y = x
    add = torch.ops.aten.add.Tensor
    for _ in range(reps):
        y = g.call_function(add, (y, x))
    g.output(y)
    gm = fx.GraphModule(torch.nn.Module(), g)
    one = torch.ones(1)
    return _best_time(lambda: gm(one), 3) / reps


def measure_compute(quick: bool = False, base: Efficiency | None = None, pick: Callable = min) -> dict:
    """The compute figures of this process (floats): ``launch_floor`` (s), ``float32`` and
    ``float64`` (FLOP/s), ``memory`` (bytes/s) and the fitted efficiency's fields (``eff.*``).
    ``pick`` summarises each measurement's repetitions: ``min`` alone on a machine, the median
    where processes share the cores (the best would be the moment a neighbour waited)."""
    base = base or PRESETS["cpu"].efficiency
    reps = 2 if quick else 5
    _PICK[0], saved = pick, _PICK[0]
    try:
        launch = measure_launch_floor(200 if quick else 2000)
        efficiency, fp32, mem = fit_efficiency(base, quick, launch, reps)
        fp64 = measure_matmul(256 if quick else 1024, torch.float64, reps)
    finally:
        _PICK[0] = saved
    out = dict(launch_floor=launch, float32=fp32, float64=fp64, memory=mem)
    out.update({f"eff.{k}": v for k, v in efficiency.to_dict().items()})
    return out


__all__ = ["fit_efficiency", "fit_half", "measure_compute", "measure_launch_floor", "measure_matmul",
           "measure_memory_bandwidth", "time_attention", "time_copy", "time_matmul"]
