"""What keeps the factorization search (``planner/factorize.py``) from planning shapes that cannot
change its answer: a mesh that is an earlier shape's renamed, and a pipelined shape whose first solve
shows it cannot beat a fitting shape found already (``planner.pipelined.NotFaster``)."""

from __future__ import annotations

import warnings

import pytest

import autopar
from autopar.models import make
from autopar.planner.factorize import renamed_key
from autopar.planner.options import PlanOptions
from autopar.planner.pipelined import NotFaster, plan_pipelined


def test_a_renamed_mesh_has_the_same_key():
    # inside a node of 8, pp=2 x dp=4 is pp=2 x tp=4 with the other name; dp8 alone is tp8 alone
    assert renamed_key({"pp": 2, "dp": 4, "tp": 1}) == renamed_key({"pp": 2, "dp": 1, "tp": 4})
    assert renamed_key({"pp": 1, "dp": 8, "tp": 1}) == renamed_key({"pp": 1, "dp": 1, "tp": 8})
    # the order of the sizes is the mesh's (the inner axis's link differs): not a renaming
    assert renamed_key({"pp": 1, "dp": 2, "tp": 4}) != renamed_key({"pp": 1, "dp": 4, "tp": 2})
    assert renamed_key({"pp": 1, "dp": 8, "tp": 8}) != renamed_key({"pp": 1, "dp": 64, "tp": 1})
    assert renamed_key({"pp": 2, "dp": 4, "tp": 1}) != renamed_key({"pp": 1, "dp": 4, "tp": 2})
    # a cp or ep axis keeps its name
    assert renamed_key({"pp": 1, "dp": 2, "ep": 2, "tp": 2}) != renamed_key({"pp": 1, "dp": 2, "cp": 2, "tp": 2})


def test_the_search_lists_a_renamed_shape_without_planning_it():
    """4 CPU devices in nodes of 2: pp=2 x dp=2 is pp=2 x tp=2 renamed; it is listed, not planned."""
    model, inputs = make("gpt", "tiny", batch=8, n_layer=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, autopar.Mesh.devices(4, device="cpu", node_size=2), inputs, progress=False)
    rows = {(r["shape"]["pp"], r["shape"]["dp"], r["shape"]["tp"]): r for r in plan.mesh_search["compared"]}
    assert "error" not in rows[(2, 1, 2)]
    assert rows[(2, 2, 1)]["error"].startswith("not planned: the mesh of pp=2 dp=1 tp=2 renamed")


def test_a_pipelined_shape_that_cannot_win_stops_after_its_first_solve():
    """Given the step of a plan found already, the pipeline driver stops (``NotFaster``) when its first
    layer plan, priced without a budget, cannot beat it, and plans as without it when it might."""
    model, inputs = make("gpt", "tiny", batch=8, n_layer=4)
    mesh = autopar.Mesh({"pp": 2, "dp": 2}, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = plan_pipelined(model, mesh, inputs, None, PlanOptions(), mesh_search=True)
        with pytest.raises(NotFaster, match="already slower than a fitting shape"):
            plan_pipelined(model, mesh, inputs, None, PlanOptions(), mesh_search=True, beat=plain.step_time * 0.5)
        again = plan_pipelined(model, mesh, inputs, None, PlanOptions(), mesh_search=True,
                               beat=plain.step_time * 1.01)
    assert again.step_time == plain.step_time and again.placements == plain.placements
