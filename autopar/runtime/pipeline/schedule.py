"""What the pipeline runtimes share: slicing a batch into micro-batches, torch's schedule classes by
the plan's name, the whole schedule as one autograd op, and one step of a schedule."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from autopar import _torch_compat as tc
from autopar.errors import ArgumentError

#: torch's schedule class per plan schedule name (``plan.pipeline.schedule``)
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
             "ZBVZeroBubble": ScheduleZBVZeroBubble}


def batch_size(args: tuple, kwargs: dict, microbatches: int, where: str) -> int:
    """The batch's rows: the first dimension of the first input tensor with one. An ``ArgumentError``
    naming ``where`` when no input has a batch dimension or ``microbatches`` does not divide it."""
    batch = next((int(v.shape[0]) for v in list(args) + list(kwargs.values())
                  if isinstance(v, torch.Tensor) and v.dim() >= 1), None)
    if batch is None:
        raise ArgumentError(f"{where}: no input tensor has a batch dimension to cut into micro-batches; pass the "
                            "batch as a tensor input")
    if batch % microbatches:
        raise ArgumentError(f"{where}: {microbatches} micro-batches do not divide the batch of {batch}")
    return batch


def micro_slices(args: tuple, kwargs: dict, batch: int, m: int) -> list[dict[str, Any]]:
    """Per micro-batch: input key (``input:i`` / keyword) -> its slice (tensors with ``batch`` rows)."""
    named = {f"input:{i}": a for i, a in enumerate(args)}
    named.update(kwargs)
    out: list[dict[str, Any]] = [{} for _ in range(m)]
    for k, v in named.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch:
            for i, part in enumerate(torch.tensor_split(v, m)):
                out[i][k] = part
        else:
            for i in range(m):
                out[i][k] = v
    return out


class ScheduleStep(torch.autograd.Function):
    """The whole schedule as one autograd op: forward runs forward and backward of every
    micro-batch and returns the loss; backward hands out the stored gradients. ``runner.run(inputs,
    backward=True)`` -> (loss, per-parameter gradients); both pipeline runtimes' modules run through it."""

    @staticmethod
    def forward(ctx, runner, inputs, *params):  # noqa: ARG004 - params only route the gradients
        loss, grads = runner.run(inputs, backward=True)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, g):
        return (None, None, *[None if x is None else x * g for x in ctx.grads])


def run_schedule(schedule, backward: bool, *args, **kwargs) -> None:
    """One step of torch's ``schedule`` (forward and backward of every micro-batch), or without
    ``backward`` its forwards only (``eval``, under ``no_grad``). A schedule that runs a lowered
    action order runs only its forward actions then (``_torch_compat.forward_only``): torch 2.13's
    ``eval`` of ZBVZeroBubble would run the V's same-rank backward hand-over and fail."""
    if backward:
        with torch.enable_grad():
            schedule.step(*args, return_outputs=False, **kwargs)
        return
    only = tc.forward_only(schedule) if tc.runs_action_order(schedule) else contextlib.nullcontext()
    with torch.no_grad(), only:
        schedule.eval(*args, return_outputs=False, **kwargs)


def take_loss(output, target):  # noqa: ARG001 - the last stage's output is the micro-batch's loss already
    """torch's schedule ``loss_fn``: the last stage's output is the micro-batch's (weighted) loss already."""
    return output


__all__ = ["SCHEDULES", "ScheduleStep", "batch_size", "micro_slices", "run_schedule", "take_loss"]
