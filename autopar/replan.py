"""Re-planning after a failure: the same model planned again for the devices left, with the
checkpoint written under the old plan checked against the new one.

``replan(model, plan, devices, example_inputs, checkpoint=DIR)`` plans ``model`` for ``devices``
(a count: the planner chooses the axes, ``Mesh.devices``; or an ``autopar.Mesh``) on the old plan's
hardware, at its precision, optimizer, training mode and memory budget, and returns a ``Replanned``:
the new plan, the old one, what moved (``old.diff(new)``) and, with ``checkpoint``, whether every
parameter (and persistent buffer) of the model is in that ``torch.distributed.checkpoint`` directory
at its whole shape. DCP stores each block with its global offsets, so a checkpoint saved under the
old plan loads into the new plan's ``ParallelModule`` with ``dcp.load`` whatever the two plans'
placements (``tests/test_replan.py`` saves on 8 ranks and loads on 6). ``autopar replan`` is the
command line's form.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from autopar.api import plan as plan_model
from autopar.cost_model.mesh import Mesh
from autopar.errors import ArgumentError, PlanError
from autopar.plans import Plan, load_plan
from autopar.plans.format import human_time
from autopar.validate import check_model, check_path


@dataclass
class CheckpointCheck:
    """How a DCP checkpoint directory's tensors meet the model's state: ``found`` maps each state
    name to the checkpoint key holding it (the name itself or a key ending in ``.`` + the name, as
    ``{"model": state_dict}`` saves it); ``missing`` names state the checkpoint lacks; ``mismatched``
    maps a name to ``(checkpoint shape, model shape)``."""

    path: str
    found: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    mismatched: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)

    @property
    def loadable(self) -> bool:
        """Whether every tensor of the model's state is in the checkpoint at its shape."""
        return not self.missing and not self.mismatched

    def lines(self) -> list[str]:
        """The check, for the report."""
        if self.loadable:
            return [f"checkpoint {self.path}: all {len(self.found)} tensors of the model's state are there at their "
                    f"shapes; dcp.load reshards them into the new plan's blocks"]
        out = [f"checkpoint {self.path}: NOT loadable under the new plan ({len(self.missing)} tensors of the model's "
               f"state missing, {len(self.mismatched)} of another shape)"]
        out += [f"  missing: {name}" for name in self.missing[:20]]
        out += [f"  {name}: checkpoint {ck} vs model {mine}" for name, (ck, mine) in list(self.mismatched.items())[:20]]
        return out


@dataclass
class Replanned:
    """The outcome of ``replan``: the new ``plan``, the ``old`` one, and the checkpoint's check."""

    plan: Plan
    old: Plan
    checkpoint: Optional[CheckpointCheck] = None

    @property
    def moved(self) -> str:
        """What differs from the old plan to the new one (``Plan.diff``)."""
        return self.old.diff(self.plan)

    def report(self) -> str:
        """Devices and step time before and after, the checkpoint's check, and what moved."""
        old_n, new_n = _devices(self.old), _devices(self.plan)
        lines = [f"replanned from {old_n} devices {self.old.run_axes} to {new_n} devices {self.plan.run_axes}",
                 f"step time: {human_time(self.old.step_time)} -> {human_time(self.plan.step_time)} "
                 f"({self.plan.step_time / self.old.step_time - 1:+.1%})"]
        if self.checkpoint is not None:
            lines += self.checkpoint.lines()
        return "\n".join(lines + ["", "what moved:", self.moved])


def _devices(plan: Plan) -> int:
    n = 1
    for size in plan.run_axes.values():
        n *= size
    return n


def replan(model: torch.nn.Module, plan: Union[Plan, str, os.PathLike], devices: Union[int, Mesh],
           example_inputs=(), example_kwargs=None, *, checkpoint: Optional[Union[str, os.PathLike]] = None,
           **kw) -> Replanned:
    """Plan ``model`` again for ``devices`` (a count, or an ``autopar.Mesh``) on ``plan``'s hardware,
    with its precision, optimizer, training mode and memory budget (``kw``: other ``autopar.plan``
    keywords, which take precedence); with ``checkpoint`` (a DCP directory saved under ``plan``),
    check that it holds the model's state. See the module docstring."""
    check_model(model, "autopar.replan: model")
    if not isinstance(plan, Plan):
        plan = load_plan(check_path(plan, "autopar.replan: plan (a Plan or a saved plan's path)"))
    _check_same_model(model, plan)
    hardware = Mesh.from_dict(plan.mesh).hardware
    if isinstance(devices, Mesh):
        mesh = devices
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
        mesh = Mesh.devices(devices, device=hardware)
    else:
        raise ArgumentError(f"autopar.replan: devices must be the number of devices left (a positive int) or an "
                            f"autopar.Mesh, got {devices!r}")
    options = dict(training=plan.training, precision=plan.precision.get("name"),
                   optimizer=plan.precision.get("optimizer", "adamw"))
    if plan.memory_budget <= mesh.hardware.memory:
        options["memory_budget"] = plan.memory_budget
    options.update(kw)
    new = plan_model(model, mesh, example_inputs, example_kwargs, **options)
    check = check_checkpoint(model, checkpoint) if checkpoint is not None else None
    return Replanned(new, plan, check)


_SHAPE = re.compile(r"\[([0-9, ]*)\]$")


def _check_same_model(model: torch.nn.Module, plan: Plan) -> None:
    """A PlanError when ``model``'s parameters are not those ``plan`` was made for (by name and shape)."""
    shapes = plan.graph.get("shapes") or {}
    mine = {n: list(p.shape) for n, p in model.named_parameters()}
    theirs = {}
    for name, text in shapes.items():
        m = _SHAPE.search(str(text))
        if m:
            theirs[name] = [int(x) for x in m.group(1).split(",") if x.strip()]
    differ = sorted(n for n in set(mine) | set(theirs) if n in theirs and mine.get(n) != theirs[n])
    if differ:
        n = differ[0]
        raise PlanError(f"autopar.replan: the model is not the one the plan was made for: parameter {n!r} is "
                        f"{mine.get(n, 'absent')} in the model, {theirs[n]} in the plan; give the plan's model")


def check_checkpoint(model: torch.nn.Module, path: Union[str, os.PathLike]) -> CheckpointCheck:
    """Whether the DCP checkpoint at ``path`` holds every parameter and persistent buffer of
    ``model`` at its whole shape (see ``CheckpointCheck``); an ArgumentError when ``path`` is no
    checkpoint directory."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    text = check_path(path, "autopar.replan: checkpoint (a torch.distributed.checkpoint directory)")
    if not os.path.isfile(os.path.join(text, ".metadata")):
        raise ArgumentError(f"autopar.replan: checkpoint {text!r} is not a torch.distributed.checkpoint directory (it "
                            f"has no .metadata); give the directory dcp.save wrote")
    meta = FileSystemReader(text).read_metadata()
    tensors = {k: list(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    check = CheckpointCheck(text)
    state = dict(model.named_parameters())
    state.update(model.state_dict(keep_vars=True))
    for name, t in sorted(state.items()):
        if not isinstance(t, torch.Tensor):
            continue
        keys = [k for k in tensors if k == name or k.endswith("." + name)]
        key = min(keys, key=len) if keys else None
        if key is None:
            check.missing.append(name)
        elif tensors[key] != list(t.shape):
            check.mismatched[name] = (tensors[key], list(t.shape))
        else:
            check.found[name] = key
    return check


__all__ = ["CheckpointCheck", "Replanned", "check_checkpoint", "replan"]
