"""The precision a lowered program runs at, checked against what this machine can compute.

A program runs in its captured dtypes (the native precisions) or at a mixed or 16-bit precision the
lowering casts for (``cost_model.casting``); ``execution_precision`` picks and checks it before any
program is built, so a machine without bf16 kernels fails with a clear message, not mid-step.
"""

from __future__ import annotations

from typing import Optional

import torch

from autopar.cost_model.casting import CASTING
from autopar.cost_model.precision import AS_CAPTURED
from autopar.errors import AutoparError

#: Precisions a lowered program runs in as captured (every tensor in its own dtype; priced so too).
NATIVE_PRECISIONS = AS_CAPTURED
#: Every precision a program can run at: the native ones, and those the lowering casts for.
EXECUTABLE_PRECISIONS = NATIVE_PRECISIONS + tuple(CASTING)


def execution_precision(name: str, planned: str, device: Optional[torch.device] = None) -> str:
    """The precision a program runs at: ``name`` ("plan": the plan's). Mixed and 16-bit precisions
    are executed by the casts the lowering inserts (``cost_model.casting``); one this machine cannot
    compute in on ``device`` is a clear error."""
    chosen = planned if name == "plan" else name
    if chosen not in EXECUTABLE_PRECISIONS:
        raise AutoparError(f"cannot run a program at precision {chosen!r}: choose one of {list(EXECUTABLE_PRECISIONS)}")
    check_supported(chosen, device)
    return chosen


def check_supported(name: str, device: Optional[torch.device] = None) -> None:
    """Fail clearly when this machine cannot compute in ``name``'s dtype on ``device``: a tiny
    matmul, layer norm and softmax in that dtype must run."""
    if name not in CASTING:
        return
    dtype = CASTING[name][0]
    try:
        x = torch.ones(4, 4, dtype=dtype, device=device)
        torch.nn.functional.layer_norm(x @ x, (4,)).softmax(-1)
    except (RuntimeError, NotImplementedError, TypeError) as e:
        where = device if device is not None else "cpu"
        raise AutoparError(f"precision {name!r} computes in {dtype}, which this machine cannot run on {where} "
                           f"({type(e).__name__}: {str(e).splitlines()[0]}): run with precision='fp32'") from e


__all__ = ["EXECUTABLE_PRECISIONS", "NATIVE_PRECISIONS", "check_supported", "execution_precision"]
