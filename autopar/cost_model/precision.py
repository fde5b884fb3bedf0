"""Training precision: how many bytes each kind of tensor takes, and which peak FLOP/s applies.

The captured graph carries the model's own dtypes (usually float32); a GPU run trains it in mixed
precision. ``Precision`` says how to price it: activations and matmul inputs in ``compute_bytes``
(bf16: 2), fp32 master weights (4), fp32 gradients and gradient reduction (4), parameters gathered
for compute in bf16 (2), and the optimizer's state. Integer and bool tensors (token ids, masks,
indices) always keep their own size.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from autopar.cost_model.hardware import Hardware
from autopar.errors import ArgumentError

#: optimizer -> number of extra state tensors per parameter element (moments)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1, "none": 0}

ROLES = ("activation", "param", "grad", "gather")


@dataclass(frozen=True)
class Precision:
    """Bytes per element by role, and the dtype whose peak FLOP/s compute is priced at."""

    name: str  # "bf16-mixed", "fp16-mixed", "bf16", "fp16", "fp32", "fp64", "model"
    compute_bytes: Optional[int]  # activations and matmul inputs (None: the tensor's own dtype)
    compute_dtype: Optional[str]  # selects Hardware.peak_flops (None: the op's own dtype)
    param_bytes: int  # stored (master) weights
    grad_bytes: int  # gradients and their reduction
    gather_bytes: Optional[int]  # parameters gathered for compute (None: as compute_bytes)
    optimizer: str  # "adamw" | "adam" | "sgd" | "sgd-momentum" | "none"
    optimizer_bytes: int  # optimizer state per parameter element

    def to_dict(self) -> dict:
        """JSON-able form, as plans store it."""
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "Precision":
        """The precision a plan stores (``to_dict``'s inverse)."""
        return Precision(**d)


# name -> (compute_bytes, compute_dtype, param_bytes, grad_bytes, gather_bytes, state_bytes)
# state_bytes: bytes of one optimizer moment per element.
_TABLE: dict[str, tuple[Optional[int], Optional[str], int, int, Optional[int], int]] = {
    # bf16 compute, fp32 master weights, fp32 gradient reduction, bf16 gathers, fp32 moments
    "bf16-mixed": (2, "bfloat16", 4, 4, 2, 4),
    "fp16-mixed": (2, "float16", 4, 4, 2, 4),
    # pure low precision: everything, moments included, in 16 bits
    "bf16": (2, "bfloat16", 2, 2, 2, 2),
    "fp16": (2, "float16", 2, 2, 2, 2),
    "fp32": (4, "float32", 4, 4, 4, 4),
    "fp64": (8, "float64", 8, 8, 8, 8),
    # compute in each tensor's own dtype; optimizer moments priced as fp32 (the usual case)
    "model": (None, None, 4, 4, None, 4),
}

PRECISIONS = tuple(_TABLE)

#: Precisions a program runs in as captured (``runtime.precision``: no cast is lowered), so a float
#: tensor is held and moved at its own dtype's size: a float64 model planned at the CPU preset's
#: default "fp32" all-gathers 8 bytes per element, and so its plan prices them (its compute keeps the
#: precision's ``compute_dtype`` peak). The table's sizes are those of a model in the named dtype.
AS_CAPTURED = ("model", "fp32", "fp64")


def get_precision(name: Optional[str], hw: Hardware, optimizer: str = "adamw") -> Precision:
    """The named precision (``None``: ``hw.default_precision``) with ``optimizer``'s state size."""
    if isinstance(name, Precision):
        return name
    key = hw.default_precision if name is None else str(name).lower()
    if key not in _TABLE:
        raise ArgumentError(f"unknown precision {name!r}: choose one of {list(PRECISIONS)}")
    opt = str(optimizer).lower()
    if opt not in OPTIMIZER_STATES:
        raise ArgumentError(f"unknown optimizer {optimizer!r}: choose one of {list(OPTIMIZER_STATES)}")
    cb, cd, pb, gb, gab, sb = _TABLE[key]
    return Precision(
        name=key,
        compute_bytes=cb,
        compute_dtype=cd,
        param_bytes=pb,
        grad_bytes=gb,
        gather_bytes=gab,
        optimizer=opt,
        optimizer_bytes=OPTIMIZER_STATES[opt] * sb,
    )


def element_bytes(dtype: torch.dtype, role: str, precision: Precision) -> int:
    """Bytes per element of a tensor of ``dtype`` in ``role`` (activation, param, grad, gather).

    Float tensors take the precision's size for the role, or under a precision that runs as
    captured (``AS_CAPTURED``) their own; integer, bool and complex tensors keep their own itemsize
    (ids and masks are not cast; complex is left alone).
    """
    if role not in ROLES:
        raise ValueError(f"unknown tensor role {role!r}: expected one of {ROLES}")
    if not dtype.is_floating_point or precision.name in AS_CAPTURED:
        return dtype.itemsize
    if role == "activation":
        return precision.compute_bytes or dtype.itemsize
    if role == "param":
        return precision.param_bytes
    if role == "grad":
        return precision.grad_bytes
    return precision.gather_bytes or precision.compute_bytes or dtype.itemsize


__all__ = ["AS_CAPTURED", "PRECISIONS", "Precision", "element_bytes", "get_precision"]
