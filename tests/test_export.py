"""``plan.export``: a plan as a DTensor + FSDP2 module and as torchtitan settings, its projection onto
module styles priced by the planner's evaluator; the exported module trained on 4 gloo ranks with
plain DTensor and FSDP2 equals one device, and runs the collectives the projection predicts."""

from __future__ import annotations

import ast
import functools
import json

import pytest

import autopar
from autopar.errors import ArgumentError
from autopar.export import export
from autopar.export.project import changed_ops, project

from _export_helpers import build, cases_on_rank
from _parity import plan_json

AXES = (("dp", 2), ("tp", 2))


@functools.lru_cache(maxsize=None)
def _plan(case: str, recipe: str | None = None) -> autopar.Plan:
    """The plan of a case on AXES (searched, or a recipe; ``"checkpointing"``: searched with layers
    recomputed), made once per session."""
    if case != "titan" and recipe != "checkpointing":  # ("megatron_sp+loss": the recipe, exported otherwise)
        return autopar.Plan.from_dict(json.loads(plan_json(case, AXES, recipe and recipe.split("+")[0])))
    model, args = build(case)
    # (every GPT block recomputed in full; LLaMA's first layer selectively)
    kw = {"checkpointing": "full" if case == "gpt" else {"layers.0": "selective"}} if recipe == "checkpointing" else {}
    return autopar.plan(model, autopar.Mesh(dict(AXES), device="cpu"), args, deterministic_time=0.5, progress=False,
                        **kw)


#: the cases whose tensor parallelism the export keeps (default: the faster projection), with or
#: without sequence parallelism (default: where the plan splits the residual stream's tokens)
OPTIONS = {("llama", "fsdp_tp"): {"tensor_parallel": True, "sequence_parallel": False},
           ("llama", "megatron_sp"): {"tensor_parallel": True, "loss_parallel": False},
           ("llama", "megatron_sp+loss"): {"tensor_parallel": True, "loss_parallel": True}}


@functools.lru_cache(maxsize=None)
def _exported(case: str, recipe: str | None = None):
    model, args = build(case)
    return _plan(case, recipe).export("dtensor", model, args, **OPTIONS.get((case, recipe), {}))


def test_dtensor_module_uses_torch_alone_and_reports_both_prices():
    """The module imports torch only, defines ``parallelize``; the report prices the plan and its
    projection and lists changes that are real changes."""
    e = _exported("gpt")
    tree = ast.parse(e.text)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"torch"}
    assert {"parallelize", "local_batch"} <= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    r = e.report
    assert r["original"]["step_time"] == pytest.approx(_plan("gpt").step_time)
    assert r["projected"]["step_time"] > 0 and r["changed"]
    assert all(c["planned"] != c["projected"] for c in r["changed"])
    assert "projected" in e.summary()


def test_projection_of_a_layout_the_styles_say_changes_nothing():
    """The fsdp recipe's plan is what ``fully_shard`` does: it projects onto itself at its own price."""
    model, args = build("llama")
    plan = autopar.recipes.fsdp(model, autopar.Mesh({"dp": 4}, device="cpu"), args)
    proj = project(plan, model, args)
    assert proj.changed == [] and changed_ops(plan, proj.plan) == []
    assert proj.plan.step_time == pytest.approx(plan.step_time, rel=1e-9)
    assert proj.styles.data_axes == ("dp",) and proj.styles.tensor_axis is None


def test_tensor_parallel_plan_projects_onto_colwise_rowwise_and_local_heads():
    """LLaMA's fsdp_tp plan: every projection column-parallel, every output projection row-parallel,
    the attention modules told their local head counts."""
    e = _exported("llama", "fsdp_tp")
    ns: dict = {}
    exec(compile(e.text, "<export>", "exec"), ns)
    plan = ns["TP_PLAN"]
    for i in range(2):
        assert plan[f"layers.{i}.attention.wq"] == "colwise" and plan[f"layers.{i}.attention.wo"] == "rowwise"
        assert plan[f"layers.{i}.feed_forward.w1"] == "colwise" and plan[f"layers.{i}.feed_forward.w2"] == "rowwise"
        assert ns["LOCAL_HEADS"][f"layers.{i}.attention"] == {"n_heads": 2, "n_kv_heads": 1}
    assert ns["TENSOR_AXIS"] == "tp" and ns["DATA_AXES"] == ("dp",)


def test_default_projection_is_the_faster_of_with_and_without_tensor_parallelism():
    model, args = build("llama")
    both = project(_plan("llama", "fsdp_tp"), model, args)
    assert set(both.tried) == {"tp", None}
    assert both.plan.step_time == min(both.tried.values())
    assert any("price at" in n for n in both.styles.notes)
    forced = _plan("llama", "fsdp_tp").export("dtensor", model, args, tensor_parallel=True)
    assert forced.report["projected"]["step_time"] == pytest.approx(both.tried["tp"], rel=1e-9)
    assert both.styles.sequence == {} or forced.text.count("SequenceParallel()") == 1


def test_sequence_parallel_projection_says_it_op_by_op():
    """LLaMA's megatron_sp plan splits the residual stream's tokens on ``tp``: the export puts its
    norms under SequenceParallel, cuts the embedding's output to the positions, and the projected
    plan runs the norms and residual adds on ``S(1)``, all-gathers before the column-parallel
    Linears and reduce-scatters after the row-parallel ones."""
    e = _exported("llama", "megatron_sp")
    ns: dict = {}
    exec(compile(e.text, "<export>", "exec"), ns)
    assert ns["SEQUENCE"] == {"layers.0.attention_norm": "norm", "layers.0.ffn_norm": "norm",
                              "layers.1.attention_norm": "norm", "layers.1.ffn_norm": "norm", "norm": "final",
                              "output": "exit", "tok_embeddings": "entry"}
    model, args = build("llama")
    proj = project(_plan("llama", "megatron_sp"), model, args, tensor_parallel=True)
    tp = proj.plan.axis_names.index("tp")
    for n in proj.plan.nodes:
        if n["phase"] == "forward" and n.get("module") in ("layers.0", "layers.0.ffn_norm"):
            assert [o.split(", ")[tp] for o in n["outputs"]] == ["S(1)"], n
    kinds = {(r["module"], s["kind"]) for r in proj.plan.reshardings for s in r.get("steps", []) if s["axis"] == "tp"}
    assert ("layers.0.feed_forward.w1", "all_gather") in kinds and ("layers.0", "reduce_scatter") in kinds
    assert ("layers.0.ffn_norm", "all_reduce") in kinds  # the norm's scale: its gradient's partial sums
    e = _exported("llama", "megatron_sp+loss")
    ns = {}
    exec(compile(e.text, "<export>", "exec"), ns)
    assert ns["SEQUENCE"]["output"] == "vocab" and ns["TP_PLAN"]["output"] == "colwise"
    assert any(n.startswith("tok_embeddings: replicated") for n in e.report["notes"])
    without = project(_plan("llama", "megatron_sp"), model, args, tensor_parallel=True, sequence_parallel=False)
    assert without.styles.sequence == {} and without.plan.peak_memory > proj.plan.peak_memory


def test_a_model_other_than_the_plans_is_refused():
    model, args = build("llama")
    with pytest.raises(autopar.PlanError, match="not the one the plan was made for.*parameters"):
        _plan("gpt").export("dtensor", model, args)


def test_torchtitan_settings():
    """The degrees, checkpointing and whether the model is torchtitan-shaped; no model needed."""
    e = _plan("llama", "fsdp_tp").export("torchtitan")
    par = e.report["config"]["parallelism"]
    degrees = ("data_parallel_shard_degree", "tensor_parallel_degree", "pipeline_parallel_degree")
    assert tuple(par[k] for k in degrees) == (2, 2, 1)
    assert e.report["config"]["activation_checkpoint"] == {"mode": "none"}
    assert "[parallelism]\n" in e.text and "tensor_parallel_degree = 2\n" in e.text
    assert e.report["projected"] is None
    gpt = _plan("gpt").export("torchtitan")
    assert any("not torchtitan's Llama" in n for n in gpt.report["notes"])
    assert not any("not torchtitan's Llama" in n for n in e.report["notes"])


def test_torchtitan_settings_of_a_pipelined_plan():
    model, args = build("llama")
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), args, deterministic_time=0.5,
                        progress=False, pipeline={"schedule": "1F1B", "microbatches": 2})
    par = plan.export("torchtitan").report["config"]["parallelism"]
    assert par["pipeline_parallel_degree"] == 2 and par["pipeline_parallel_schedule"] == "1F1B"
    assert par["module_fqns_per_model_part"] == [list(s) for s in plan.pipeline.stages]
    assert par["pipeline_parallel_microbatch_size"] == 8 // 2 // 2  # batch 8, 2 micro-batches, 2 data ranks
    ns: dict = {}
    exec(compile(plan.export("dtensor").text, "<export>", "exec"), ns)
    assert ns["SPLIT_POINTS"] == [s[0] for s in plan.pipeline.stages[1:]] and ns["PIPELINE"]["microbatches"] == 2


def test_bad_format_and_dtensor_without_model_are_one_line_errors():
    with pytest.raises(ArgumentError, match="unknown format 'megatron'"):
        export(_plan("gpt"), "megatron")
    with pytest.raises(ArgumentError, match="needs the plan's model"):
        _plan("gpt").export("dtensor")


def test_cli_export(tmp_path, capsys):
    from autopar.cli import main

    path = tmp_path / "plan.json"
    _plan("llama", "fsdp_tp").save(str(path))
    assert main(["export", str(path), "--format", "torchtitan"]) == 0
    assert "tensor_parallel_degree = 2" in capsys.readouterr().out
    assert main(["export", str(path), "--format", "dtensor"]) == 2
    assert "--model MODULE:FACTORY" in capsys.readouterr().err
    out = tmp_path / "parallelize_llama.py"
    assert main(["export", str(path), "--format", "dtensor", "--model", "autopar.models:make", "--kw", "family=llama",
                 "--kw", "size=tiny", "--kw", "batch=8", "-o", str(out)]) == 0
    assert "projected" in capsys.readouterr().out
    assert "def parallelize(model" in out.read_text()


CASES = (("gpt", None), ("llama", None), ("llama", "fsdp_tp"), ("llama", "megatron_sp"), ("llama", "megatron_sp+loss"),
         ("gpt", "checkpointing"), ("llama", "checkpointing"), ("titan", None))


@pytest.mark.gloo
def test_exported_module_trains_as_one_device_with_predicted_collectives(gloo_pool4):
    """Searched plans of GPT, LLaMA and the torchtitan-style Llama 3, LLaMA's fsdp_tp, its megatron_sp
    (sequence parallelism; and with the head split on the vocabulary, the model's own loss under
    loss_parallel) and a plan that
    recomputes its layers (full, selective), exported and run on 4 gloo ranks in float64 with plain DTensor + FSDP2:
    loss and gradients equal one device's, the collectives of the step, by kind, are the
    projection's, and the recomputed layers run twice."""
    exported = {c: _exported(*c) for c in CASES}
    results = gloo_pool4().run(cases_on_rank, [(c[0], exported[c].text) for c in CASES])
    for rank in results:
        for c, r in zip(CASES, rank):
            tol = 1e-6 if c[0] == "titan" else 1e-10  # (its loss is computed in float32)
            assert r["loss"] == pytest.approx(r["want_loss"], rel=tol), c
            assert r["grad_error"] < tol, c
            assert r["collectives"] == exported[c].report["collectives"], c
            assert r["runs"] == {path: 2 for path in _plan(*c).checkpointing}, c
    assert exported[("llama", "fsdp_tp")].report["collectives"]["all_reduce"] > 0  # tensor parallelism ran
    assert exported[("llama", "megatron_sp")].report["collectives"]["reduce_scatter"] > 3  # and sequence parallelism
    sp, vocab = (exported[("llama", r)].report["collectives"]["all_reduce"]
                 for r in ("megatron_sp", "megatron_sp+loss"))
    assert vocab == sp + 3  # loss_parallel's maximum, sum and picked logits
    assert _plan("gpt", "checkpointing").checkpointing == {"blocks.0": "full", "blocks.1": "full"}
    assert _plan("llama", "checkpointing").checkpointing == {"layers.0": "selective"}
