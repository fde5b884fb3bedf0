"""Measure this machine and write a hardware profile (the "cpu" preset with measured figures).

Measured (``autopar.cost_model.measure``): the float32 (and float64) matmul rate, memory
bandwidth (a large copy), the per-op dispatch floor of the program runtime (an ``fx`` graph of
aten ops), and the shape tables of ``autopar.cost_model.efficiency``: matmuls with few output
elements and with a short reduction, copies of a few sizes, and attention (SDPA forward and
backward) at two sequence lengths. The large-op rates are stored as peaks; the efficiency curves
are fitted to the measured ratios of small to large (``fit_half``), so the roofline reproduces the
measurements. Planning never measures: ``Mesh(..., device="cpu", profile=path)`` loads the file
this writes.

With ``nprocs >= 2`` (``autopar calibrate --nprocs 4``) everything is measured under the
conditions a program on ``nprocs`` local gloo processes runs in (``calibrate_procs``): the
processes measure at the same moment, so they share the cores as a run's ranks do, and every
collective kind is timed between pieces of compute through the path programs use; the link's
latency and bandwidth, and a factor per collective kind over its ring-formula time
(``Link.factors``: gloo's reduce-scatter runs as an all-reduce and costs about twice its ring
price), are fitted to those costs (``calibrate_procs.fit_link``). A profile so made
prices programs of that many processes on this machine; with ``nprocs`` 1 the figures are one
process's alone and the link keeps the preset's.

    autopar calibrate --nprocs 4 -o cpu-profile.json
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from autopar.cost_model.calibrate_procs import describe_link_fit, fit_link, measure_in_processes
from autopar.cost_model.efficiency import Efficiency
from autopar.cost_model.hardware import PRESETS, Hardware, save_profile
from autopar.cost_model.measure import fit_efficiency, fit_half, measure_compute

def _efficiency(fig: dict) -> Efficiency:
    return Efficiency.from_dict({k[len("eff."):]: v for k, v in fig.items() if k.startswith("eff.")})


def calibrate(path: str | os.PathLike, nprocs: int = 2, quick: bool = False, base: str = "cpu",
              report: Optional[list] = None) -> Hardware:
    """Measure this machine, write the profile to ``path`` (``save_profile``) and return it.

    ``nprocs`` >= 2 measures inside that many concurrent gloo processes (the conditions of a run of
    ``nprocs`` local ranks, see the module docstring); 1 measures this process alone and keeps the
    preset's link figures. ``quick`` uses small sizes and few repetitions (seconds, mostly process
    start-up). ``report`` (a list) receives one line per measured collective, measured against
    priced.
    """
    if nprocs < 1:
        raise ValueError(f"calibrate: nprocs must be >= 1, got {nprocs}")
    preset = PRESETS[base]
    link = preset.intra_node
    lines: list[str] = []
    overlap = preset.overlap_slowdown
    if nprocs >= 2:
        got = measure_in_processes(nprocs, quick)
        fig = got["compute"]
        link = fit_link(got["collectives"], nprocs)
        overlap = got["overlap"]
        lines = describe_link_fit(got["collectives"], nprocs, link)
        lines.append(f"compute throughput lost beside a collective issued before it: {overlap:.2f} (overlap_slowdown)")
    else:
        fig = measure_compute(quick, preset.efficiency)
    fp32, fp64 = fig["float32"], fig["float64"]
    ratio = fp32 / preset.peak_flops["float32"]  # no fast 16-bit path measured: keep the preset's ratios
    flops = {k: v * ratio for k, v in preset.peak_flops.items()}
    flops.update({"float32": fp32, "float64": fp64})
    hw = dataclasses.replace(
        preset,
        name=f"{base}-calibrated" + (f"-{nprocs}procs" if nprocs >= 2 else ""),
        peak_flops=flops,
        hbm_bandwidth=fig["memory"],
        intra_node=link,
        inter_node=link,
        efficiency=_efficiency(fig),
        launch_floor=fig["launch_floor"],
        overlap_slowdown=overlap,
    )
    hw.validate()
    save_profile(hw, path, base=base)
    if report is not None:
        report.extend(lines)
    return hw


__all__ = ["calibrate", "fit_efficiency", "fit_half", "fit_link", "measure_compute"]
