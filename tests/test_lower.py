"""Lowered programs computed on every device of a mesh by ``autopar.simulate`` equal the
single-device model: the loss and every gradient, for every model family on meshes (8,), (2, 4)
and (2, 3) (uneven pieces), with the searched plan and with every recipe forced; and the
collectives each program ran are the ones its plan predicted."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter

import pytest
import torch

import autopar
from autopar.passes.lower import lower, resolve
from autopar.program.collectives import COLLECTIVES
from autopar.runtime.accounting import differences, predicted

from _parity import build, plan_json, rel

FAMILIES = ("mlp", "gpt", "llama", "cnn", "moe")
MESHES = ((("a", 8),), (("a", 2), ("b", 4)), (("a", 2), ("b", 3)))
RECIPES = ("ddp", "fsdp", "megatron_tp", "megatron_sp", "fsdp_tp")


def _check(family: str, axes: tuple, recipe=None) -> None:
    plan = autopar.Plan.from_dict(json.loads(plan_json(family, axes, recipe)))
    model, args = build(family)
    trace: dict = {}
    loss, grads = autopar.simulate(model, plan, args, trace=trace)
    ref = model(*args)
    ref.backward()
    tol = 1e-10 if family == "moe" else 1e-4
    assert rel(loss, ref) <= tol
    for name, p in model.named_parameters():
        assert rel(grads[name], p.grad) <= tol, name
    # every device runs the collectives the plan predicted (bytes as each device's axis group sees them:
    # the first device holds the largest pieces, as the cost model prices them)
    assert differences(plan, trace[(0,) * len(axes)]) == []
    # every device ran, and ran the same collectives (kind and axis; bytes differ on uneven meshes)
    want = Counter()
    for (kind, axis, _), n in predicted(plan).items():
        want[(kind, axis)] += n
    assert set(trace) == set(itertools.product(*(range(n) for _, n in axes)))
    for coords, ran in trace.items():
        assert Counter((e.kind, e.axis) for e in ran) == want, coords
    # communication the plan prices (exposed or not) runs, and everything that runs was priced
    # (``comm_time`` counts only what compute does not hide, so it may be 0 while collectives run)
    kinds = {f.__name__ for f in COLLECTIVES}
    priced = [st["time"] for r in plan.reshardings for st in r["steps"] if st["kind"] in kinds]
    assert all(t > 0 for t in priced) and (len(priced) > 0) == (sum(want.values()) > 0)
    assert plan.comm_time == 0 or sum(want.values()) > 0


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(str(n) for _, n in a))
@pytest.mark.parametrize("family", FAMILIES)
def test_searched_plan_matches_one_device(family, axes):
    _check(family, axes)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("axes", MESHES[1:], ids=lambda a: "x".join(str(n) for _, n in a))
def test_recipes_match_one_device(recipe, axes):
    if recipe == "fsdp_tp" and len(axes) < 2:
        pytest.skip("FSDP x TP needs a 2-D mesh")
    _check("gpt", axes, recipe)


def test_program_code_is_readable_python():
    plan = autopar.Plan.from_dict(json.loads(plan_json("gpt", (("a", 2), ("b", 4)), "megatron_tp")))
    model, args = build("gpt")
    from autopar.ir.capture import capture

    prog = lower(resolve(capture(model, args), plan), (1, 2))
    code = prog.code
    assert "def forward(self, wte_weight" in code and "def backward(self" in code
    # one call per collective the plan predicts for a device, by its qualified name, each waited
    calls = Counter(re.findall(r"= autopar_program_collectives_(\w+)\(", code))
    want = Counter()
    for (kind, _, _), n in predicted(plan).items():
        want[kind] += n
    assert want["all_reduce"] > 0 and want["all_gather"] > 0  # Megatron TP: both, on this mesh
    assert {k: calls[k] for k in (f.__name__ for f in COLLECTIVES)} == {
        k: want[k] for k in (f.__name__ for f in COLLECTIVES)}
    assert calls["wait"] == sum(want.values())
    bare = re.findall(r"\b(\w*(?:all_reduce|all_gather|reduce_scatter|all_to_all))\(", code)
    assert set(bare) <= {f"autopar_program_collectives_{f.__name__}" for f in COLLECTIVES}, set(bare)
    compile(code.replace("# forward", "").split("# backward")[0], "<forward>", "exec")  # valid Python


def test_plan_for_another_graph_is_refused():
    plan = autopar.Plan.from_dict(json.loads(plan_json("mlp", (("a", 8),))))
    model, args = build("mlp")
    from autopar.ir.capture import capture

    other = capture(model, (args[0][:4], args[1][:4]))
    with pytest.raises(autopar.PlanError, match="another graph"):
        resolve(other, plan)


def test_random_ops_are_drawn_or_refused_by_name():
    """Dropout lowers (to the counter-based draw, tests/test_dropout.py); a random op autopar cannot
    draw alike on every placement is refused by name at capture, before planning."""
    torch.manual_seed(0)

    class Drop(torch.nn.Module):
        def __init__(self, noise=False):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.drop = torch.nn.Dropout(0.5)
            self.noise = noise

        def forward(self, x):
            y = self.drop(self.lin(x))
            return (y * torch.randint_like(y, 3)).sum() if self.noise else y.sum()

    model, x = Drop(), torch.randn(16, 8)
    mesh = autopar.Mesh({"a": 2}, device="cpu")
    plan = autopar.plan(model, mesh, (x,), progress=False)
    loss, grads = autopar.simulate(model, plan, (x,))
    assert torch.isfinite(loss) and set(grads) == {"lin.weight", "lin.bias"}
    with pytest.raises(autopar.CaptureError, match=r"(?s)randint_like.*'<root>'.*native_dropout"):
        autopar.plan(Drop(noise=True), mesh, (x,), progress=False)


def test_a_precision_no_program_runs_at_is_refused():
    """Mixed precisions run (tests/test_mixed_precision.py); an unknown one is an error, not fp32."""
    plan = autopar.Plan.from_dict(json.loads(plan_json("mlp", (("a", 8),))))
    plan.precision = dict(plan.precision, name="int8")
    model, args = build("mlp")
    with pytest.raises(autopar.AutoparError, match="cannot run a program at precision 'int8'"):
        autopar.simulate(model, plan, args, precision="plan")


def test_views_after_head_split_attention_run_on_dense_blocks():
    """The capture's view after attention relies on the fake output's strides; the local blocks
    are dense, so the lowering reshapes instead (Megatron TP splits the heads here)."""
    from autopar.models import make

    torch.manual_seed(0)
    model, args = make("gpt", "tiny", batch=2, seq=16)
    plan = autopar.recipes.megatron_tp(model, autopar.Mesh({"dp": 2, "tp": 2}, device="cpu"), args)
    loss, grads = autopar.simulate(model, plan, args)
    ref = model(*args)
    ref.backward()
    assert rel(loss, ref) <= 1e-5
    assert max(rel(grads[n], p.grad) for n, p in model.named_parameters()) <= 1e-4
