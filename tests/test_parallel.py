"""``autopar.compile`` on real gloo process groups (4 local processes shared by every test): for
each model family on meshes (4,) and (2, 2) with the searched plan, and for the GPT-2-style model
with every recipe forced on (2, 2), the loss, every gradient and the parameters after 3 AdamW
steps equal the single-device model's, and the collectives each rank ran are the predicted ones."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from _parity import inference_on_rank, mismatched_shapes_on_rank, mixed_step_on_rank, plan_json, train_on_rank

FAMILIES = ("mlp", "gpt", "llama", "cnn", "moe")
MESHES = ((("a", 4),), (("a", 2), ("b", 2)))
RECIPES = ("ddp", "fsdp", "megatron_tp", "megatron_sp", "fsdp_tp")


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


def _check(pool, family, axes, recipe=None):
    text = plan_json(family, axes, recipe)
    results = pool.run(train_on_rank, family, axes, text)
    tol = 1e-9 if family == "moe" else 1e-4
    for rank, r in enumerate(results):
        assert r["loss"] <= tol and r["grad"] <= tol and r["param"] <= tol, (rank, r)
    # rank 0 holds the largest pieces, which is how the plan prices each collective's bytes
    assert results[0]["differences"] == [], results[0]["differences"]


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(str(n) for _, n in a))
@pytest.mark.parametrize("family", FAMILIES)
def test_searched_plan_trains_like_one_device(pool, family, axes):
    _check(pool, family, axes)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_train_like_one_device(pool, recipe):
    _check(pool, "gpt", (("a", 2), ("b", 2)), recipe)


def test_layer_grouped_fsdp_trains_like_one_device(pool):
    """FSDP gathers each layer's parameters with one all-gather per phase (``cost_model.gathers``)
    on gloo: the same training as one device, and the collectives each rank ran are the predicted
    ones, one per group. (GPT's FSDP on (2, 2) runs grouped too, in ``test_recipes_...``.)"""

    import autopar

    axes = (("a", 4),)
    text = plan_json("llama", axes, "fsdp")
    plan = autopar.Plan.from_dict(json.loads(text))
    sizes = Counter(r["bucket"] for r in plan.reshardings if r["kind"] == "param" and r.get("bucket") is not None)
    assert sizes and max(sizes.values()) >= 4, sizes  # a layer's attention and MLP weights together
    _check(pool, "llama", axes, "fsdp")


def test_bf16_mixed_plan_computes_in_bf16_with_fp32_master_weights(pool):
    """``compile`` runs the plan's precision ("bf16-mixed"): close to the bf16 single-device model,
    further from fp32 than fp32 rounding, fp32 parameters, gradients and loss, predicted collectives."""
    axes = (("a", 2), ("b", 2))
    results = pool.run(mixed_step_on_rank, "gpt", axes, plan_json("gpt", axes, precision="bf16-mixed"))
    for rank, r in enumerate(results):
        assert r["precision"] == "bf16-mixed" and r["dtypes"] == r["dtypes_after_step"] == ["torch.float32"], r
        assert r["loss16"] <= 1e-3 and r["loss32"] <= 2e-2, (rank, r)
        assert r["grad16"] <= 1e-2 and 1e-3 <= r["grad32"] <= 2e-2, (rank, r)
    assert results[0]["differences"] == [], results[0]["differences"]


def test_inference_program_returns_dtensors_and_takes_placed_inputs(pool):
    import autopar
    from _parity import build

    model, args = build("mlp")
    mesh = autopar.Mesh({"a": 4}, device="cpu")
    plan = autopar.plan(model, mesh, args, training=False, hints={"input:0": "S(0)"}, progress=False)
    for r in pool.run(inference_on_rank, plan.to_json()):
        assert r["is_dtensor"] and r["same"] and r["err"] <= 1e-5 and r["input"] == "S(0)", r


def test_ranks_with_different_programs_fail_together(pool):
    errors = pool.run(mismatched_shapes_on_rank)
    assert all("ranks captured different programs" in e for e in errors), errors


def test_gradients_arrive_where_autograd_would_put_them(pool):
    """``runtime.step.Step`` stores gradients in ``.grad`` itself under a plain ``backward()``; accumulation,
    ``autograd.grad``, ``backward(inputs=...)`` and parameter hooks behave as with autograd's own."""
    from _parity import grad_paths_on_rank

    for r in pool.run(grad_paths_on_rank, plan_json("mlp", (("a", 4),), "ddp")):
        assert r["accumulated"] <= 1e-5 and r["autograd_grad"] <= 1e-5 and r["inputs_grad"] <= 1e-5, r
        assert not r["autograd_grad_left_grad"] and r["inputs_only"], r
        assert r["hooked"] <= 1e-5 and r["post_hook_saw_grad"] and r["others"] <= 1e-5, r
        assert r["held_kept"] and r["held_differs"], r


def test_state_dict_uses_the_single_device_models_names(pool):
    """A single-device state dict loads by name into the ParallelModule and back (fused qkv weights
    split block by block on the tensor axis included), and the loaded model computes its loss."""
    from _parity import state_dict_on_rank

    for r in pool.run(state_dict_on_rank, plan_json("gpt", (("a", 2), ("b", 2)), "megatron_tp")):
        assert r["keys"] == r["ref_keys"] and "blocks.0.attn.qkv.weight" in r["keys"], r["keys"]
        assert r["hook_ran"] == ["GPT"], r["hook_ran"]  # the model's own state_dict ran
        assert r["steps_child"] == (2, "Linear")  # a child named like the step counter clashes with nothing
        assert r["param_names"] == r["ref_param_names"]
        assert r["missing"] == [] and r["unexpected"] == []
        assert r["loaded_err"] == 0.0 and r["back_err"] == 0.0 and r["tied"]
        assert r["loss_err"] <= 1e-5, r["loss_err"]
        assert r["eval"] == (False, False, False) and r["train"] == (True, True, True)
        assert re.fullmatch(r"state_dict\['ln_f.weight'\] has shape \(3,\), but the model's ln_f.weight has "
                            r"\(\d+,\)", r["shape_error"]), r["shape_error"]


def test_a_mesh_of_devices_compiles_on_the_plans_factorization(pool):
    """``Mesh.devices(4)`` leaves the axes to the planner: ``compile`` with it, planning there or given the plan
    ``autopar.plan`` made for it, runs on the mesh that plan chose and trains like one device."""
    import autopar
    from _parity import build, devices_mesh_on_rank

    model, args = build("mlp")
    plan = autopar.plan(model, autopar.Mesh.devices(4, device="cpu"), args, deterministic_time=0.5, progress=False)
    chosen = {k: v for k, v in plan.mesh_search["chosen"].items() if v > 1} or {"dp": 1}
    assert dict(zip(plan.axis_names, plan.mesh_shape)) == chosen
    for r in pool.run(devices_mesh_on_rank, plan.to_json()):
        for way in ("planned", "given"):
            assert r[way]["mesh"] == chosen, (way, r)
            assert r[way]["loss"] <= 1e-5 and r[way]["grad"] <= 1e-4, (way, r)


def test_a_mesh_of_devices_refuses_a_plan_for_another_count():
    """A plan given with ``Mesh.devices(n)`` must be for n devices: the error says both counts, before any
    process-group work (no group exists here)."""
    import autopar
    from _parity import build, plan_json
    from autopar.errors import CompileError

    model, args = build("mlp")
    plan = autopar.Plan.from_dict(json.loads(plan_json("mlp", (("a", 4),), "ddp")))
    with pytest.raises(CompileError, match=r"^this plan was made for 4 devices \(mesh a=4\), not the 8 of "
                                           r"Mesh.devices\(8\)"):
        autopar.compile(model, autopar.Mesh.devices(8, device="cpu"), args, plan=plan)
