"""A mesh axis of size 1 carries no communication (``passes/search/strategies.search_strategies``):
the one-device ``dp`` axis under a pipeline alone, and a size-1 axis of an unpipelined mesh, get only
replicated placements, so plans list no collective there; hints and recipes there read as ``B``."""

from __future__ import annotations

import pytest

import autopar
from autopar import models


def _steps_on(plan, axis: str) -> list:
    return [s for r in plan.reshardings for s in r["steps"] if s["axis"] == axis]


def test_a_pipeline_alone_lists_no_collective_on_its_one_device_axis():
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=8)
    mesh = autopar.Mesh({"pp": 4}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, progress=False)
    assert plan.pipeline.degree == 4 and plan.axis_names == ("dp",)
    assert _steps_on(plan, "dp") == []  # 556 listed before this rule (this GPT, pp4)
    assert [c for c in plan.to_dict()["collectives"] if c["axis"] == "dp"] == []
    assert set(plan.placements.values()) == {"B"}
    again = autopar.plan(model, mesh, inputs, progress=False)
    assert again.to_json() == plan.to_json()  # deterministic


@pytest.mark.parametrize("recipe", [None, "fsdp_tp"])
def test_a_size_one_axis_of_a_plain_mesh_is_replicated_and_hints_there_read_as_b(recipe):
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=2)
    mesh = autopar.Mesh({"dp": 1, "tp": 2}, device="cpu")
    plan = autopar.plan(model, mesh, inputs, hints={"wte.weight": "S(1), S(0)"}, recipe=recipe, progress=False)
    assert _steps_on(plan, "dp") == [] and _steps_on(plan, "tp")  # the tensor axis still communicates
    assert [c for c in plan.to_dict()["collectives"] if c["axis"] == "dp"] == []
    assert plan.placements["wte.weight"] == "B, S(0)"
    assert all(p.split(",")[0].strip() == "B" for p in plan.placements.values())
