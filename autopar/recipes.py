"""Hand-written parallelism recipes as fixed placements, priced by the same evaluator as a search.

Each recipe fixes what users fix when they write it by hand — where parameters and inputs live —
and lets every op follow the cheapest way consistent with that:

- ``ddp``: parameters replicated; the batch split over every (data) axis.
- ``fsdp`` (ZeRO-3): parameters split along a dim on every data axis, gathered before use.
- ``megatron_tp``: on the tensor axis every weight matrix is split (column or row, whichever its
  neighbours make cheaper), biases and norms replicated; data axes as DDP.
- ``megatron_sp``: tensor parallel plus the sequence split on the tensor axis between blocks.
- ``fsdp_tp``: FSDP on the data axes, tensor parallel on the tensor axis (needs two axes or more).

``tensor_axis`` (default the last) names the tensor-parallel axis; the other axes are data axes.
"""

from __future__ import annotations

from typing import Callable

from autopar.api import check_plan_args, plan_with
from autopar.cost_model.mesh import Mesh
from autopar.errors import ArgumentError
from autopar.passes.search.recipes import NAMES


def _recipe(name: str) -> Callable:
    """The public function for recipe ``name``: ``autopar.plan`` with that recipe's placements."""

    def build(model, mesh: Mesh, example_inputs=(), example_kwargs=None, *, tensor_axis=-1, **kw):
        where = f"autopar.recipes.{name}"
        if "recipe" in kw:
            raise ArgumentError(f"{where} takes no recipe= (it is the {name} recipe); call autopar.plan(..., "
                                "recipe=...) for another")
        options = check_plan_args(model, mesh, example_kwargs, dict(kw, recipe=name, tensor_axis=tensor_axis), where)
        return plan_with(model, mesh, example_inputs, example_kwargs, options)

    build.__name__ = name
    build.__doc__ = f"The {name} recipe as a Plan (see ``autopar.recipes``)."
    return build


ddp = _recipe("ddp")
fsdp = _recipe("fsdp")
megatron_tp = _recipe("megatron_tp")
megatron_sp = _recipe("megatron_sp")
fsdp_tp = _recipe("fsdp_tp")


__all__ = ["NAMES", "ddp", "fsdp", "fsdp_tp", "megatron_sp", "megatron_tp"]
