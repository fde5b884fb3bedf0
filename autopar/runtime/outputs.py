"""What a compiled step hands back: the model's own output structure (``ir.outputs``), the loss in
its place and the program's other outputs placed as the user asked."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from autopar.ir.outputs import OutputTree, rebuild_outputs
from autopar.program.program import Slot
from autopar.runtime.state import dtensor_block

#: How a compiled module returns the model's tensor outputs other than the loss: DTensors with the
#: plan's placements, whole plain tensors on every rank, or this rank's blocks as plain tensors.
OUTPUT_MODES = ("dtensor", "full", "local")


def placed_output(block: torch.Tensor, slot: Slot, dmesh, mode: str) -> torch.Tensor:
    """This rank's ``block`` of output ``slot`` as ``mode`` asks (``OUTPUT_MODES``); ``"full"``
    gathers it from every rank (a collective: every rank must ask alike)."""
    if mode == "local":
        return block
    placed = dtensor_block(block, dmesh, slot)
    return placed.full_tensor() if mode == "full" else placed


def step_result(tree: Optional[OutputTree], loss: Optional[torch.Tensor], outputs: Sequence[Any]) -> Any:
    """What the model returned, rebuilt around ``loss`` and ``outputs`` (in the order of the tree's
    tensor leaves); without a recorded tree, the loss alone (training) or the outputs (one: itself)."""
    if tree is None:
        if loss is not None:
            return loss
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return rebuild_outputs(tree, loss, iter(outputs))


__all__ = ["OUTPUT_MODES", "placed_output", "step_result"]
