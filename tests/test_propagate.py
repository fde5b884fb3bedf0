"""Propagation-only planning (``search="propagate"``) and DTensor annotations.

Propagation spreads the user's annotations through the graph GSPMD-style; a Megatron MLP
annotated on its two weights alone comes out column-then-row with the hidden activation split,
and the ILP's plan is never slower than it. A parameter or input that already is a DTensor keeps its
placements in both modes (planned on the fake process group: shapes only, no values)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256, bias=False)
        self.down = torch.nn.Linear(256, 64, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).pow(2).mean()


def _plan(search, hints):
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64)
    return autopar.plan(model, autopar.Mesh({"tp": 4}, device="h100"), (x,), hints=hints, search=search,
                        progress=False)


def _node_outputs(plan, op):
    return [n["outputs"][0] for n in plan.nodes if n["op"] == op and n["phase"] == "forward"]


def test_megatron_annotations_propagate_to_the_hidden_activation():
    hints = {"up.weight": "S(0)", "down.weight": "S(1)"}  # column- then row-parallel
    plan = _plan("propagate", hints)
    assert plan.source == "propagate"
    assert plan.placements["up.weight"] == "S(0)" and plan.placements["down.weight"] == "S(1)"
    # the hidden activation follows the column split through relu, and nothing else moves it
    assert _node_outputs(plan, "aten.relu.default") == ["S(1)"]
    searched = _plan("ilp", hints)  # free to gather the hidden activation if that is cheaper
    assert plan.step_time >= searched.step_time * (1 - 1e-9)  # the ILP is never worse
    assert isinstance(plan.diff(searched), str)


def test_propagation_is_deterministic_and_refuses_unknown_modes():
    hints = {"up.weight": "S(0)"}
    assert _plan("propagate", hints).to_json() == _plan("propagate", hints).to_json()
    with pytest.raises(ValueError, match="propagate"):
        _plan("greedy", hints)


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("search", ["ilp", "propagate"])
def test_dtensor_parameters_and_inputs_keep_their_placements(fake_group, search):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    torch.manual_seed(0)
    model = MLP()
    w = model.up.weight.detach()
    local = w.chunk(4, dim=0)[0].clone()  # rank 0's rows: planning needs shapes, not values
    model.up.weight = torch.nn.Parameter(DTensor.from_local(local, fake_group, [Shard(0)], run_check=False,
                                                            shape=w.shape, stride=w.stride()))
    x = DTensor.from_local(torch.randn(32, 64), fake_group, [Replicate()], run_check=False)
    plan = autopar.plan(model, autopar.Mesh({"tp": 4}, device="h100"), (x,), search=search, progress=False)
    assert plan.placements["up.weight"] == "S(0)" and plan.placements["input:0"] == "B"
    # a recipe that would place a DTensor otherwise (ddp splits the batch) says so in its baseline
    assert plan.baselines["ddp"] == {"error": "conflicts with its DTensor placement on input:0: ddp places it S(0), "
                                              "the DTensor B"}
    with pytest.raises(autopar.AutoparError, match="DTensor placed"):
        autopar.plan(model, autopar.Mesh({"tp": 4}, device="h100"), (x,), hints={"up.weight": "B"},
                     progress=False)
