"""Hardware models: per-device compute, memory and link figures that the cost model prices against.

A ``Hardware`` is plain data (JSON round-trips exactly), so a plan can record what it was priced on.
Presets hold datasheet figures; ``autopar.cost_model.calibrate`` measures this machine and writes a
profile that ``get_hardware(..., profile=path)`` loads. Planning itself never measures.

Bandwidths are per device and one way, as the collectives achieve them (the ring formulas' beta):
on the GPU presets NCCL's bus bandwidth (nccl-tests' ``busbw``, defined so that a ring collective
takes ``(n-1)/n x bytes / busbw``: ``autopar.cost_model.comm``), which NCCL's protocol overhead keeps
below the one-way line rate (half a datasheet's bidirectional NVLink figure). Peak FLOP/s are
dense (no 2:4 sparsity) figures. ``inter_node`` is one NIC (one rail); ``nics_per_node`` says how
many a node has, so an axis whose group has several members per node is priced with several rails
(``autopar.cost_model.mesh.axis_link``).

Achieved throughput is a function of shape (``autopar.cost_model.efficiency``): each preset's
``efficiency`` holds the parameters of its curves, each with the kernel-level measurement it comes
from cited beside it.

Profile files: version 1 had no ``nics_per_node``; a profile that gives ``devices_per_node`` but not
``nics_per_node`` (every version 1 file) loads with one NIC per device, as version 1 priced it.
Version 3 replaced ``matmul_efficiency``/``memory_efficiency`` (two constants) by ``efficiency``; a
file with the two constants loads with them as a flat ``Efficiency`` (priced as it was).
``overlap_slowdown`` (compute throughput lost beside a hidden collective) may be left out: a
description without it has 0 (as everything written before it priced), a profile with a ``base``
keeps the base preset's; ``autopar calibrate --nprocs N`` measures it. Version 4 adds each link's
``factors`` (per collective kind, measured time over the ring formula's; see ``Link``); a link of an
older file has none (every kind at its ring price, as it was priced).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from autopar.cost_model.efficiency import Efficiency

#: Extra keys a profile file may carry besides the Hardware fields.
PROFILE_META = ("autopar_profile", "base")
PROFILE_VERSION = 4  # 2 adds nics_per_node; 3 replaces the two efficiency constants by ``efficiency``;
#: 4 adds a link's per-kind ``factors`` (a link without them loads with none: every kind at its ring price)
#: the constants schema version 4 plans and version 1-2 profiles carry instead of ``efficiency``
LEGACY_EFFICIENCY = ("matmul_efficiency", "memory_efficiency")
#: fields a hardware description may leave out, with the value it then has: plans of schema version
#: 5 and older and profiles written before ``overlap_slowdown`` priced overlap as free
OPTIONAL_FIELDS = {"overlap_slowdown": 0.0}


#: the collective kinds a link prices (``autopar.cost_model.comm.collective_time``); a per-kind
#: factor (``Link.factors``) may be given for each
COLLECTIVE_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def _check_factors(factors: Any) -> tuple[tuple[str, float], ...]:
    """``factors`` (a mapping or pairs of kind -> factor) as sorted pairs, each kind a collective
    kind and each factor a positive finite number; a ValueError names the first that is not."""
    items = factors.items() if isinstance(factors, dict) else factors
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise ValueError(f"Link factors must map a collective kind to a number, got {factors!r}") from None
    out: dict[str, float] = {}
    for kind, v in pairs:
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"Link factors: unknown collective kind {kind!r}; expected one of {COLLECTIVE_KINDS}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            raise ValueError(f"Link factors: the factor of {kind} must be a positive finite number, got {v!r}")
        out[kind] = float(v)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class Link:
    """The link model of one mesh axis: alpha (seconds per collective step) and beta (bytes/s),
    and per collective kind a factor on its ring-algorithm time.

    ``factors`` holds what a backend's implementation of a kind costs over the ring formula
    ``comm.collective_time`` gives it with this alpha and beta: a kind left out (every kind on the
    GPU presets, whose NCCL runs the ring algorithms the formulas describe) has factor 1. It exists
    because a backend may not run the algorithm a kind's name says: torch's gloo backend runs
    ``reduce_scatter_tensor`` as an all-reduce of the whole tensor whose chunk each rank keeps
    (``ProcessGroupGloo::reduce_scatter_tensor_coalesced``; torch 2.13's profiler records it as
    ``gloo:all_reduce``), so it costs what an all-reduce does, about twice its ring price.
    ``autopar calibrate --nprocs N`` measures every kind and fits the factors with the link
    (``calibrate_procs.fit_link``). Given as a dict or pairs; kept as sorted pairs (hashable).
    """

    latency: float  # seconds per collective step (alpha)
    bandwidth: float  # bytes/s, one-way per device (beta)
    factors: tuple[tuple[str, float], ...] = ()  # collective kind -> time over its ring formula's

    def __post_init__(self) -> None:
        for field in ("latency", "bandwidth"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
                raise ValueError(f"Link {field} must be a positive finite number, got {v!r}")
        object.__setattr__(self, "factors", _check_factors(self.factors))

    def factor(self, kind: str) -> float:
        """The factor on ``kind``'s ring-formula time (1.0 where none was measured or given)."""
        for k, v in self.factors:
            if k == kind:
                return v
        return 1.0

    def to_dict(self) -> dict:
        """JSON-able figures of the link (``factors`` only where there are any: a link without
        them writes what schema version 6 and profile version 3 wrote)."""
        d: dict[str, Any] = {"latency": float(self.latency), "bandwidth": float(self.bandwidth)}
        if self.factors:
            d["factors"] = dict(self.factors)
        return d

    @staticmethod
    def from_dict(d: Any) -> "Link":
        """From ``{"latency":..., "bandwidth":..., "factors": {...}}`` (``factors`` optional), a
        ``(latency, bandwidth)`` pair or a Link."""
        if isinstance(d, Link):
            return d
        if isinstance(d, dict):
            extra = set(d) - {"latency", "bandwidth", "factors"}
            if extra or "latency" not in d or "bandwidth" not in d:
                raise ValueError(f"a link needs the keys 'latency' and 'bandwidth' (and optionally 'factors'), "
                                 f"got {sorted(d)}")
            factors = d.get("factors", {})
            if not isinstance(factors, dict):
                raise ValueError(f"a link's 'factors' must map a collective kind to a number, got {factors!r}")
            return Link(float(d["latency"]), float(d["bandwidth"]), factors)
        if isinstance(d, (tuple, list)) and len(d) == 2:
            return Link(float(d[0]), float(d[1]))
        raise ValueError(f"cannot read a link from {d!r}: give Link(latency, bandwidth) or (latency, bandwidth)")


@dataclass(frozen=True)
class Hardware:
    """One device kind: what the roofline, the collectives and the memory budget are priced with."""

    name: str
    peak_flops: dict[str, float]  # dtype name ("bfloat16", "float16", "float32", "float64") -> dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory: int  # bytes per device
    intra_node: Link  # NVLink (GPU presets) / gloo between local processes (cpu)
    inter_node: Link  # one NIC (one rail) of InfiniBand (GPU presets)
    devices_per_node: int
    nics_per_node: int  # inter-node NICs (rails) per node; NCCL runs one ring per rail
    efficiency: Efficiency  # achieved fraction of peak / bandwidth as a function of shape
    launch_floor: float  # seconds per kernel
    flash_attention: bool  # price fused attention as flash attention (no materialised scores)
    default_precision: str  # "bf16-mixed" on GPU presets, "fp32" on cpu
    #: fraction of compute throughput lost while a hidden collective runs beside it (its kernels
    #: take SMs and memory bandwidth); priced as ``s * min(traffic, compute)`` per overlap group
    #: (``autopar.passes.search.problem``). 0: overlap is free (plans of schema version 5 and older,
    #: profiles without the field). See the presets for the sources.
    overlap_slowdown: float = 0.0

    def __hash__(self) -> int:  # peak_flops is a dict: hash the JSON form instead
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype name (``"float32"``); dtypes without a figure use float32's."""
        dtype = dtype.replace("torch.", "")
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("float32") or min(self.peak_flops.values())

    def to_dict(self) -> dict:
        """JSON-able; ``Hardware.from_dict(hw.to_dict()) == hw``."""
        return {
            "name": self.name,
            "peak_flops": {k: float(v) for k, v in self.peak_flops.items()},
            "hbm_bandwidth": float(self.hbm_bandwidth),
            "memory": int(self.memory),
            "intra_node": self.intra_node.to_dict(),
            "inter_node": self.inter_node.to_dict(),
            "devices_per_node": int(self.devices_per_node),
            "nics_per_node": int(self.nics_per_node),
            "efficiency": self.efficiency.to_dict(),
            "launch_floor": float(self.launch_floor),
            "flash_attention": bool(self.flash_attention),
            "default_precision": self.default_precision,
            "overlap_slowdown": float(self.overlap_slowdown),
        }

    @staticmethod
    def from_dict(d: dict) -> "Hardware":
        """The hardware a plan or profile file describes (``to_dict``'s inverse). A description with
        ``matmul_efficiency`` and ``memory_efficiency`` instead of ``efficiency`` (plans of schema
        version 4 and older, profiles of version 1-2) gets them as a flat ``Efficiency``."""
        d = legacy_efficiency(d)
        names = [f.name for f in dataclasses.fields(Hardware)]
        missing = [n for n in names if n not in d and n not in OPTIONAL_FIELDS]
        unknown = [k for k in d if k not in names]
        if missing or unknown:
            raise ValueError(
                "hardware description: "
                + (f"missing fields {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown fields {unknown}" if unknown else "")
                + f" (fields are {names})"
            )
        hw = Hardware(
            name=str(d["name"]),
            peak_flops={str(k): float(v) for k, v in d["peak_flops"].items()},
            hbm_bandwidth=float(d["hbm_bandwidth"]),
            memory=int(d["memory"]),
            intra_node=Link.from_dict(d["intra_node"]),
            inter_node=Link.from_dict(d["inter_node"]),
            devices_per_node=int(d["devices_per_node"]),
            nics_per_node=int(d["nics_per_node"]),
            efficiency=Efficiency.from_dict(d["efficiency"]),
            launch_floor=float(d["launch_floor"]),
            flash_attention=bool(d["flash_attention"]),
            default_precision=str(d["default_precision"]),
            overlap_slowdown=float(d.get("overlap_slowdown", OPTIONAL_FIELDS["overlap_slowdown"])),
        )
        hw.validate()
        return hw

    def validate(self) -> None:
        """Raise ValueError naming the first figure that cannot be right."""
        if not self.peak_flops or any(not v > 0 for v in self.peak_flops.values()):
            raise ValueError(f"{self.name}: peak_flops must be a non-empty dtype -> positive FLOP/s map")
        self.efficiency.validate()
        for f in ("hbm_bandwidth", "memory", "devices_per_node", "nics_per_node"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{self.name}: {f} must be positive, got {getattr(self, f)!r}")
        if self.launch_floor < 0:
            raise ValueError(f"{self.name}: launch_floor must be >= 0, got {self.launch_floor!r}")
        if not 0.0 <= self.overlap_slowdown < 1.0:
            raise ValueError(f"{self.name}: overlap_slowdown (fraction of compute throughput lost beside a "
                             f"collective) must be in [0, 1), got {self.overlap_slowdown!r}")


def legacy_efficiency(d: dict) -> dict:
    """``d`` with ``matmul_efficiency``/``memory_efficiency`` folded into a flat ``efficiency``
    (an older plan's or profile's hardware); ``d`` itself when it has neither."""
    if not any(k in d for k in LEGACY_EFFICIENCY):
        return d
    out = {k: v for k, v in d.items() if k not in LEGACY_EFFICIENCY}
    if "efficiency" not in out and all(k in d for k in LEGACY_EFFICIENCY):
        out["efficiency"] = Efficiency.flat(float(d["matmul_efficiency"]), float(d["memory_efficiency"])).to_dict()
    return out


# ---------------------------------------------------------------------------------------------
# Presets (datasheet figures; achieved fractions from kernel-level measurements, cited)

# H100 SXM5: 989 TFLOP/s dense bf16/fp16 on tensor cores. fp32 is 67 TFLOP/s, the non-tensor-core
# figure: torch leaves TF32 matmuls off by default (allow_tf32=False), so fp32 matmuls do not reach
# the 494 TFLOP/s TF32 figure. fp64 67 TFLOP/s (fp64 tensor core). HBM3 3.35 TB/s, 80 GB.
# Links at what NCCL achieves on them (nccl-tests bus bandwidth, the ring formulas' beta), per NCCL's
# maintainers:
# - NVLink 4 (900 GB/s bidirectional, 450 GB/s one way line rate): on 8 H100, all_gather and
#   all_reduce bus bandwidth saturates at 360 GB/s, "exactly what we'd expect on H100" (S. Jeaugey,
#   github.com/NVIDIA/nccl-tests issue 326, 2025-06-24, on a user's 128 MB-16 GB all_gather_perf and
#   all_reduce_perf runs); "450GB/s is the line rate. With the protocol overhead (~20%) NCCL can get
#   an effective NVLink bandwidth of 370GB/s", seen as busBw of the non-all-reduce collectives or of
#   ring all-reduce (nccl-tests issue 212, 2024-05-06). 360 GB/s. (An all-reduce on NVLink SHARP
#   reaches a busBw of ~480 GB/s, the same comment: not modelled; autopar prices every kind as a ring.)
# - One 400 Gb/s NDR InfiniBand NIC per GPU, eight rails per 8-GPU node (DGX/HGX H100), 50 GB/s line
#   rate: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA's NCCL team, nccl-tests
#   issue 290, 2025-03-03); "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC"
#   (nccl-tests issue 267, 2025-01-23). 48 GB/s, the figure both give.
_NVLINK4 = Link(latency=4e-6, bandwidth=360e9)
_IB_NDR = Link(latency=10e-6, bandwidth=48e9)
_H100_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12, "float64": 67e12}

# Achieved fractions (autopar.cost_model.efficiency), what torch's own kernels reach: cuBLAS matmuls
# and the flash attention torch's SDPA runs (FlashAttention-2).
# - mm_max: the Maximum Achievable Matmul FLOPS table (S. Bekman, "Machine Learning Engineering",
#   github.com/stas00/ml-engineering, compute/accelerator/README.md, BF16, CUDA 12.1): H100 SXM 792.1
#   of 989 TFLOP/s (80.1%), A100 SXM 267.9 of 312 (85.9%): the best shape of a scan of large ones,
#   and the fastest of 100 timed iterations (compute/accelerator/benchmarks/README.md), not their
#   mean. A training step runs matmuls back to back on random-looking data, where the power limit
#   sets the clock: on A100, cuBLAS at 8192^3 through PyTorch runs at 257 TFLOP/s on torch.randn
#   inputs against 295 on zeros (H. He, "Strangely, Matrix Multiplications on GPUs Run Faster When
#   Given 'Predictable' Data", thonking.ai, 2024). A100's mm_max is set so the curve gives that 257
#   (82.4%) at 8192^3: 0.84 (was 0.86, the scan's best). H100 keeps 0.80: the curve gives 753, 767
#   and 778 TFLOP/s at 6144^3, 8192^3 and 12288^3, against cuBLAS (CUDA 12.6) at 741, 798 and 823
#   on normal-distributed inputs (github.com/pranjalssh/fast.cu, README.md and logs.txt, kernel 0).
# - mm_half_mn: a quarter of one wave of output tiles (SMs x tile area: H100 132 x 128x256, A100 108
#   x 128x128): too few tiles leave SMs idle (wave quantization; Anthony et al., "The Case for
#   Co-Designing Model Architectures with Hardware", arXiv:2401.14489, GEMM figures); mm_half_k: a
#   few 64-wide K tiles of prologue/epilogue per output tile (the same paper's K sweeps flatten from
#   K ~ 1-2k). Both are a smooth reading of those curves, not a fit of them.
# - attn_fwd/attn_bwd: FlashAttention-2 (T. Dao, arXiv:2307.08691, Figs. 4-7, head dim 128, long
#   sequences): A100 forward up to ~73% of peak, backward ~60% (fwd+bwd ~200 TFLOP/s); H100 forward
#   ~37%, backward ~32% (fwd+bwd up to ~335 TFLOP/s, the paper's H100 figure; FlashAttention-3,
#   Shah et al. arXiv:2407.08608, Figs. 5-8, shows FA2 at 300-370 TFLOP/s forward on H100).
#   attn_half_seq 256: the same figures' rate at sequence 512 is ~2/3 of the 16k rate;
#   attn_half_head_dim 32: head dim 64 runs at ~0.85 of head dim 128.
# - mem_max 0.85, mem_half_bytes 1 MiB: an estimate (copies and elementwise kernels run at 85-92% of
#   the datasheet HBM bandwidth once large; a kernel moving ~1 MiB is latency-bound); no single
#   published table is used; benchmarks/gpu_calibrate.py measures it.
_H100_EFF = Efficiency(mm_max=0.80, mm_half_mn=0.25 * 132 * 128 * 256, mm_half_k=128.0, attn_fwd=0.37,
                       attn_bwd=0.32, attn_half_seq=256.0, attn_half_head_dim=32.0, mem_max=0.85,
                       mem_half_bytes=float(1 << 20))
_A100_EFF = Efficiency(mm_max=0.84, mm_half_mn=0.25 * 108 * 128 * 128, mm_half_k=128.0, attn_fwd=0.73,
                       attn_bwd=0.60, attn_half_seq=256.0, attn_half_head_dim=32.0, mem_max=0.85,
                       mem_half_bytes=float(1 << 20))
# cpu: a guess (run `autopar calibrate`, which fits these on the machine): one core's BLAS reaches
# ~70% of its peak on large matmuls; a core has no SMs to fill, so small shapes lose little beyond
# the per-op launch floor (a quick calibration here fitted half-constants of ~20 output elements and
# K ~0); torch's CPU attention ran at about the matmul rate forward and a third of it backward, with
# little dependence on the sequence, and pads no head dim (flat: half-constants 0); copies ~80% of
# the bandwidth.
# Overlap slowdown (``overlap_slowdown``): compute running beside a collective loses SMs (NCCL's
# kernels hold one thread block per channel for the collective's whole duration) and HBM bandwidth.
# - S. Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
#   Learning: Performance and Power Implications", arXiv:2507.03114 (2025), abstract: training GPT-
#   and LLaMA-style models on 4 GPUs each of A100, H100, MI250 and MI210, compute kernels that overlap
#   communication run on average 18.9% longer (at most 40%) than with no communication beside them.
#   18.9% longer is 1/1.189 of the rate: 0.159 of the throughput lost. The figure is an average over
#   the four GPUs (the abstract gives no per-GPU split), so the H100 and A100 presets take the same
#   value; it is a whole run's compute against compute alone, so if not all of the compute had a
#   collective beside it, the loss while one runs is larger: 0.159 is the low reading.
# - A kernel-level check on H100 (NVIDIA developer forum, "Compute-Communication Overlap Causes
#   Severe GEMM Performance Degradation because of Tail Effect"): a GEMM of exactly 132 tiles
#   (one wave on 132 SMs) beside an ncclAllGather of 24 blocks drops from ~80% to ~47% MFU (time
#   ~1.7x) because the blocks the collective holds push tiles into a second wave; 24 of 132 SMs is
#   0.18 of the machine, the loss a many-wave GEMM (no tail) would see. The 0.159 sits at this
#   SM-share figure, far below the single-wave worst case.
# cpu: 0 (not measured; gloo's collectives run on their own threads; ``autopar calibrate`` leaves it).
_OVERLAP_SLOWDOWN_GPU = 1.0 - 1.0 / 1.189
_CPU_EFF = Efficiency(mm_max=0.7, mm_half_mn=64.0, mm_half_k=8.0, attn_fwd=0.7, attn_bwd=0.3,
                      attn_half_seq=0.0, attn_half_head_dim=0.0, mem_max=0.8, mem_half_bytes=4096.0)

PRESETS: dict[str, Hardware] = {
    "h100": Hardware(
        name="h100",
        peak_flops=dict(_H100_FLOPS),
        hbm_bandwidth=3.35e12,
        memory=80_000_000_000,
        intra_node=_NVLINK4,
        inter_node=_IB_NDR,
        devices_per_node=8,
        nics_per_node=8,
        efficiency=_H100_EFF,
        launch_floor=5e-6,
        flash_attention=True,
        default_precision="bf16-mixed",
        overlap_slowdown=_OVERLAP_SLOWDOWN_GPU,
    ),
    # H200 SXM: the H100's compute and NVLink; 141 GB of HBM3e at 4.8 TB/s.
    "h200": Hardware(
        name="h200",
        peak_flops=dict(_H100_FLOPS),
        hbm_bandwidth=4.8e12,
        memory=141_000_000_000,
        intra_node=_NVLINK4,
        inter_node=_IB_NDR,
        devices_per_node=8,
        nics_per_node=8,
        efficiency=_H100_EFF,  # same SMs and clocks; stas00's table lists H100/H200 SXM at 794.5 (80.3%)
        launch_floor=5e-6,
        flash_attention=True,
        default_precision="bf16-mixed",
        overlap_slowdown=_OVERLAP_SLOWDOWN_GPU,
    ),
    # A100 80GB SXM: 312 TFLOP/s dense bf16/fp16; fp32 19.5 (non-tensor-core, as for the H100);
    # fp64 19.5 (tensor core). HBM2e 2039 GB/s. Links at what NCCL achieves, as for the H100:
    # - NVLink 3 (600 GB/s bidirectional, 300 one way: 12 links of 25 GB/s each way): "Each NVLink
    #   has a line rate of 25GB/s (in each direction) which converts to ~20GB/s effective bandwidth
    #   with a 128B payload size. The total effective bandwidth should therefore be 240GB/s on A100,
    #   but some other bottlenecks on the GPUs limits it to ~230GB/s" (S. Jeaugey, nccl-tests issue
    #   149, 2023-07-05, on 8 A100 SXM4 all_reduce_perf). 230 GB/s.
    # - One 200 Gb/s HDR InfiniBand NIC per GPU (25 GB/s line rate), eight per node (DGX A100):
    #   "24GB/s inter-node" busBw at 8 GB with one HDR NIC (S. Jeaugey, NVIDIA/nccl issue 412,
    #   2023-04-24, on 8 A800 per node); "On an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we
    #   measure 192GB/s AllReduce BusBW" (NVIDIA/nccl issue 812, quoted in issue 1576), 24 per NIC.
    #   24 GB/s.
    "a100": Hardware(
        name="a100",
        peak_flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12, "float64": 19.5e12},
        hbm_bandwidth=2.039e12,
        memory=80_000_000_000,
        intra_node=Link(latency=5e-6, bandwidth=230e9),
        inter_node=Link(latency=10e-6, bandwidth=24e9),
        devices_per_node=8,
        nics_per_node=8,
        efficiency=_A100_EFF,
        launch_floor=5e-6,
        flash_attention=True,
        default_precision="bf16-mixed",
        overlap_slowdown=_OVERLAP_SLOWDOWN_GPU,
    ),
    # A modest guess for local CPU processes talking over gloo (run `calibrate` for real figures):
    # one process at ~50 GFLOP/s fp32, ~10 GB/s memory bandwidth, gloo over loopback TCP at ~50 us
    # per step and ~2 GB/s. devices_per_node is large so every mesh axis counts as "intra"; one
# "NIC" per process, so a larger mesh prices as before.
    "cpu": Hardware(
        name="cpu",
        peak_flops={"bfloat16": 25e9, "float16": 25e9, "float32": 50e9, "float64": 25e9},
        hbm_bandwidth=10e9,
        memory=8_000_000_000,
        intra_node=Link(latency=50e-6, bandwidth=2e9),
        inter_node=Link(latency=50e-6, bandwidth=2e9),
        devices_per_node=64,
        nics_per_node=64,
        efficiency=_CPU_EFF,
        launch_floor=10e-6,
        flash_attention=False,
        default_precision="fp32",
    ),
}


def _preset(device: str) -> Hardware:
    key = str(device).lower()
    if key not in PRESETS:
        raise ValueError(f"unknown device {device!r}: known presets are {sorted(PRESETS)} (or pass a calibrated profile)")
    return PRESETS[key]


def _merge(base: Hardware, fields: dict) -> Hardware:
    """``base`` with the fields in ``fields`` replaced (links, peak_flops and efficiency merged key by key)."""
    d = base.to_dict()
    for k, v in fields.items():
        if k in ("peak_flops", "intra_node", "inter_node", "efficiency") and isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    return Hardware.from_dict(d)


def save_profile(hw: Hardware, path: str | os.PathLike, base: Optional[str] = None) -> None:
    """Write ``hw`` as a profile JSON file (every field, so it loads without a preset)."""
    doc: dict[str, Any] = {"autopar_profile": PROFILE_VERSION}
    if base is not None:
        doc["base"] = base
    doc.update(hw.to_dict())
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")


def _read_profile(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"hardware profile {str(path)!r} does not exist (write one with autopar's calibrate)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"hardware profile {str(path)!r} must hold a JSON object")
    return d


def _profile_fields(d: dict) -> dict:
    """The Hardware fields a profile gives; one NIC per device where it gives ``devices_per_node``
    but not ``nics_per_node`` (version 1 files, which priced every inter-node axis at one NIC per
    device)."""
    fields = legacy_efficiency({k: v for k, v in d.items() if k not in PROFILE_META})
    if "devices_per_node" in fields and "nics_per_node" not in fields:
        fields["nics_per_node"] = fields["devices_per_node"]
    return fields


def load_profile(path: str | os.PathLike) -> Hardware:
    """Read a profile written by ``save_profile``; a partial one is completed from its ``base`` preset."""
    d = _read_profile(path)
    base = d.get("base")
    fields = _profile_fields(d)
    if base is not None:
        return _merge(_preset(base), fields)
    return Hardware.from_dict(fields)


def get_hardware(device: str = "h100", profile: str | os.PathLike | None = None) -> Hardware:
    """The preset for ``device``; with ``profile``, the fields that profile file gives override it."""
    hw = _preset(device)
    if profile is None:
        return hw
    return _merge(hw, _profile_fields(_read_profile(profile)))


__all__ = ["COLLECTIVE_KINDS", "Efficiency", "Hardware", "Link", "PRESETS", "get_hardware", "legacy_efficiency", "load_profile",
           "save_profile"]
