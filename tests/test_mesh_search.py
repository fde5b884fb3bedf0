"""The mesh factorization search (``Mesh.devices``, ``planner/factorize.py``): the planner chooses
pp x dp x tp for a device count, plans each sensible shape and says which it compared."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar import models
from autopar.errors import MeshError
from autopar.planner.factorize import shape_candidates


def test_candidates_keep_tp_in_a_node_and_pp_within_the_layers():
    got = shape_candidates(64, 8, batch=64, n_layers=4)
    assert all(s["pp"] * s["dp"] * s["tp"] == 64 for s in got)
    assert {s["tp"] for s in got} == {1, 2, 4, 8}  # divisors of the node size
    assert {s["pp"] for s in got} == {1, 2, 4}  # 1 and powers of two up to the 4 layers
    assert got[0] == {"pp": 1, "dp": 8, "tp": 8}  # fewer stages first, then larger tp groups
    # dp is at most the batch, and a pipeline cuts the batch into whole micro-batches
    assert all(s["dp"] <= 4 for s in shape_candidates(16, 8, batch=4, n_layers=8))
    assert all(s["pp"] in (1, 2) for s in shape_candidates(16, 8, batch=6, n_layers=8))
    only = shape_candidates(64, 8, batch=64, n_layers=80, pp=[1, 4], tp=[8])
    assert only == [{"pp": 1, "dp": 8, "tp": 8}, {"pp": 4, "dp": 2, "tp": 8}]


def test_mesh_devices_is_checked():
    m = autopar.Mesh.devices(64, device="h100")
    assert m.factorize == {"devices": 64, "node_size": 8, "pp": None, "tp": None}
    assert autopar.Mesh.devices(16, device="cpu", node_size=4).factorize["node_size"] == 4
    with pytest.raises(MeshError, match="count must be a positive integer"):
        autopar.Mesh.devices(0)
    with pytest.raises(MeshError, match="tp stays within a node"):
        autopar.Mesh.devices(64, tp=[16])
    with pytest.raises(MeshError, match="pp must be a list"):
        autopar.Mesh.devices(64, pp=[3])


def test_the_search_picks_the_fastest_fitting_shape_and_says_what_it_compared(tmp_path):
    """A tiny GPT on 4 CPU devices in nodes of 2: every shape is planned; the plan is the fastest that
    fits, its mesh is that shape's, and it equals planning that shape directly."""
    model, inputs = models.make("gpt", "tiny", batch=8, n_layer=4)
    mesh = autopar.Mesh.devices(4, device="cpu", node_size=2)
    plan = autopar.plan(model, mesh, inputs, progress=False)
    ms = plan.mesh_search
    assert ms["devices"] == 4 and ms["node_size"] == 2
    shapes = [(r["shape"]["pp"], r["shape"]["dp"], r["shape"]["tp"]) for r in ms["compared"]]
    assert sorted(shapes) == sorted([(1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1)])
    priced = [r for r in ms["compared"] if "error" not in r]
    fitting = [r for r in priced if r["fits"]]
    assert fitting and min(r["step_time"] for r in fitting) == plan.step_time
    chosen = ms["chosen"]
    assert chosen in [r["shape"] for r in fitting]
    assert plan.fits and "mesh_search" in plan.phases
    # the chosen shape planned directly gives the same plan
    axes = {k: v for k, v in chosen.items() if v > 1}
    direct = autopar.plan(model, autopar.Mesh(axes, device="cpu", devices_per_node=2), inputs, progress=False)
    assert direct.step_time == plan.step_time and direct.placements == plan.placements
    # the search is in the plan file and round-trips
    plan.save(tmp_path / "p.json")
    again = autopar.load_plan(tmp_path / "p.json")
    assert again.mesh_search == json.loads(plan.to_json())["mesh_search"]
    assert "mesh search" in plan.summary()


def test_a_slow_link_between_nodes_makes_the_search_pipeline():
    """GPT-1.3B-wide (8 layers) on 8 H100 in nodes of 4 whose inter-node link is slow (5 GB/s): the
    fastest shape keeps the slow link for a pipeline (pp=2 across the two nodes)."""
    import dataclasses
    from autopar.cost_model.hardware import Link, get_hardware

    model, inputs = models.make("gpt", "1.3B", batch=16, seq=1024, device="meta", n_layer=8)
    hw = dataclasses.replace(get_hardware("h100"), inter_node=Link(2e-5, 5e9))
    mesh = autopar.Mesh.devices(8, device=hw, node_size=4, pp=[1, 2], tp=[4])
    plan = autopar.plan(model, mesh, inputs, progress=False)
    assert plan.mesh_search["chosen"] == {"pp": 2, "dp": 1, "tp": 4}
    assert plan.pipeline is not None and plan.pipeline.mesh_shape == [2, 4]
    plain = next(r for r in plan.mesh_search["compared"] if r["shape"]["pp"] == 1)
    assert plain["step_time"] > plan.step_time
