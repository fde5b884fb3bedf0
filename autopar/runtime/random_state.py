"""The state of a compiled program's random draws (dropout): its seed and step on every rank.

A program with random ops draws from a counter-based generator keyed on ``(seed, step, op,
element)`` (``ir.rules.random_ops``): ``share_seed`` gives every rank rank 0's seed, drawn from
torch's default generator; ``ParallelModule`` advances the step once per forward, runs each
backward at its forward's step (``at_step``) and keeps ``[seed, step]`` in its ``state_dict`` under
``RANDOM_KEY`` (``random_entry`` / ``load_random_entry``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from autopar.ir.rules.random_ops import draw_seed
from autopar.program.program import Program

#: The ``state_dict`` entry of a program with random ops: ``int64 [seed, step]`` (the next forward's
#: step), a replicated DTensor. The single-device model has no such entry: drop it to load there.
RANDOM_KEY = "_autopar_random"


def share_seed(program: Program) -> None:
    """Every rank draws a seed (their generators advance alike); all use rank 0's. A collective:
    call it on every rank, for a program with random ops."""
    if program.random is None:
        return
    box = [draw_seed()]
    dist.broadcast_object_list(box, src=0)
    program.random.seed = int(box[0])


def random_entry(program: Program, device_mesh, device: Optional[torch.device]):
    """``[seed, step]`` as a DTensor replicated on ``device_mesh`` (``full_tensor()`` and DCP work on
    it as on the parameters); None without random ops."""
    from torch.distributed.tensor import DTensor, Replicate

    rs = program.random
    if rs is None:
        return None
    value = torch.tensor([rs.seed, rs.step], dtype=torch.int64, device=device)
    return DTensor.from_local(value, device_mesh, [Replicate()] * device_mesh.ndim, run_check=False)


def load_random_entry(program: Program, value: torch.Tensor) -> None:
    """Set the program's seed and step from a ``RANDOM_KEY`` entry (a DTensor or a plain tensor)."""
    from torch.distributed.tensor import DTensor

    if program.random is None:
        return
    whole = value.full_tensor() if isinstance(value, DTensor) else value
    seed, step = (int(v) for v in whole.tolist())
    program.random.seed, program.random.step = seed, step


@contextlib.contextmanager
def at_step(program: Program, step: Optional[int]) -> Iterator[None]:
    """Run at ``step`` (a backward at its forward's: it redraws that forward's attention masks),
    then restore the current step."""
    rs = program.random
    if rs is None or step is None:
        yield
        return
    later, rs.step = rs.step, step
    try:
        yield
    finally:
        rs.step = later


__all__ = ["RANDOM_KEY", "at_step", "load_random_entry", "random_entry", "share_seed"]
