"""State of a ParallelModule on real gloo groups: torch.distributed.checkpoint across two different
plans (resharding on load), models built on ``meta``, and optimizer state; and DCP between pipelined
and unpipelined layouts (parameters and AdamW state, exactly).

What the ranks run is in ``tests/_ckpt_helpers.py`` and ``tests/_dcp_pipeline_helpers.py``
(importable by the spawned workers, see tests/test_launch.py); one 4-rank ``WorkerPool`` serves the
whole module (and the other modules of this pytest process, ``tests/conftest.py``), so process
start-up and ``import torch`` are paid once. Unpipelined plans are recipes
(no search), to keep planning short; pipelined ones pin their schedule and micro-batches.
"""

from __future__ import annotations

import importlib.util

import pytest
from _ckpt_helpers import hf_meta_models, materialize_meta, meta_digests, optimizer_state, reshard_through_dcp


@pytest.fixture(scope="module")
def pool(gloo_pool4):
    """Four gloo ranks: the pytest process's shared pool (tests/conftest.py)."""
    return gloo_pool4()


def test_dcp_save_under_fsdp_load_under_megatron_tp(pool, tmp_path):
    res = pool.run(reshard_through_dcp, str(tmp_path / "ckpt"))
    r = res[0]
    assert all(x == r for x in res[1:]), "every rank sees the same whole tensors and losses"
    assert (tmp_path / "ckpt" / ".metadata").exists()
    assert r["a_all_dtensors"]
    # the two plans really place the parameters differently (else nothing was resharded)
    # the fused qkv weight and bias are split block by block (q, k and v alike): DTensor's
    # _StridedShard, which torch's DCP alone cannot save (autopar teaches it the pieces)
    assert set(r["a_placements"].values()) == {"(Shard(dim=0),)", "(_StridedShard(dim=0, sf=3),)"}
    # keyed by the single-device model's names (no "module." prefix)
    assert r["a_placements"]["blocks.0.attn.qkv.weight"] == "(_StridedShard(dim=0, sf=3),)"
    assert "(Replicate(), Shard(dim=0))" in r["b_placements"].values()
    assert r["b_differs_before"] > 1e-3
    # after dcp.load every parameter of plan B equals plan A's, exactly
    assert max(r["param_err"].values()) == 0.0, {k: v for k, v in r["param_err"].items() if v}
    assert set(r["param_err"]) >= {"wte.weight", "blocks.1.mlp.proj.weight", "ln_f.bias", "blocks.0.attn.qkv.weight"}
    assert r["tied"], "loading must not untie lm_head.weight from wte.weight"
    # the same batch gives the same loss, and the loaded AdamW state gives the same next step
    assert r["b_loss1"] == pytest.approx(r["a_loss1"], rel=1e-6, abs=1e-6)
    assert r["a_loss1"] < r["a_loss0"]
    assert r["param_err_after_step"] < 1e-6


def test_meta_model_materializes_and_unrebuildable_buffer_is_named(pool):
    res = pool.run(materialize_meta)
    r = res[0]
    assert r["meta_left"] == []
    assert r["finite"] and r["nonzero"]
    assert all(x["digest"] == r["digest"] for x in res[1:]), "every rank must rebuild the same values"
    # ... the values that one process computes alone: they depend on the module's path, not the plan
    assert r["digest"] == pytest.approx(meta_digests(), rel=1e-12)
    assert all(x["losses"] == r["losses"] for x in res)
    assert r["losses"][1] < r["losses"][0]
    # a buffer rebuilt by its module's reset_parameters, after the module's parameters became DTensors
    assert r["rebuilt_scale"] == [2.0] * 8 and r["rebuilt_loss"] == r["rebuilt_loss"]  # not NaN
    msg = r["error"]
    assert msg is not None, "a meta buffer with no way to rebuild it must fail compile"
    assert "'scale'" in msg and "meta" in msg and "reset_parameters" in msg and "_MetaBuffer" in msg


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hugging_face_models_built_on_meta_with_dropout_compile_and_train(pool):
    res = pool.run(hf_meta_models)
    for name in ("gpt2", "llama"):
        r = res[0][name]
        assert r["meta_left"] == [] and r["random"], name
        assert r["finite"], name
        assert all(x[name]["digest"] == r["digest"] for x in res[1:]), f"{name}: ranks rebuilt different values"
        assert all(x[name]["losses"] == r["losses"] for x in res), name
        assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0], (name, r["losses"])


def test_adamw_state_is_placed_like_params_and_round_trips(pool):
    res = pool.run(optimizer_state)
    for r in res:
        assert r["n_state"] == r["n_params"] > 0
        assert all(r["state_ok"]), "exp_avg / exp_avg_sq must be DTensors placed like their parameter"
        assert r["steps_after"] == [3]  # the reloaded optimizer went on from step 2
        assert r["losses"] == res[0]["losses"]
    losses = res[0]["losses"]
    assert losses[2] < losses[1] < losses[0]


def test_full_value_rebuilds_a_buffer_with_init_weights():
    """No group needed: the zoo's Llama keeps its RoPE tables in root buffers, rebuilt by the root's
    init_weights() (it has no reset_parameters()); they must equal a CPU-built model's."""
    import torch

    from autopar.models import make
    from autopar.runtime.materialize import full_value

    meta, _ = make("llama", "tiny", batch=2, device="meta")
    real, _ = make("llama", "tiny", batch=2)
    for name in ("rope_cos", "rope_sin"):
        got = full_value(meta, name, getattr(meta, name))
        assert not got.is_meta and torch.equal(got, getattr(real, name)), name
    assert all(p.is_meta for p in meta.parameters()), "rebuilding one buffer must leave the model alone"


def test_dcp_across_pipelined_and_unpipelined_layouts(pool, tmp_path):
    """Parameters and AdamW state saved at pp=2 x dp=2 (GPT, tied embedding and head on the first and
    last stage) load exactly at dp=4 and at tp=4, and back: saved at dp=4, loaded at pp=2 x dp=2; the
    step after each load equals the single-device model's. A pipeline rank holds, and saves, only the
    parameters its stages read (another stage's copy would be stale)."""
    import autopar
    from _dcp_pipeline_helpers import across_layouts, gpt

    model, args = gpt(0)
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), args,
                        pipeline={"schedule": "1F1B", "microbatches": 4}, progress=False)
    alone = autopar.plan(model, autopar.Mesh({"pp": 2}, device="cpu"), args,
                         pipeline={"schedule": "GPipe", "microbatches": 2}, progress=False)
    others = [("dp4", {"dp": 4}, "fsdp"), ("tp4", {"tp": 4}, "megatron_tp")]
    res = pool.run(across_layouts, gpt, {"pp": 2, "dp": 2}, plan.to_json(), others, alone.to_json(), str(tmp_path))
    for r in res:
        rank = r["rank"]
        assert r["pp_vs_ref"] <= 1e-4, (rank, r["pp_vs_ref"])  # the pipelined run trains like the model
        for what in ("dp4_loaded", "tp4_loaded", "single_device_load", "back_loaded", "alone_loaded",
                     "alone_to_unpipelined"):
            assert r[what] == 0.0, (rank, what, r[what])  # parameters and AdamW state, exactly
        for what in ("dp4_step_vs_ref", "tp4_step_vs_ref", "back_step_vs_ref", "alone_step_vs_ref"):
            assert r[what] <= 1e-4, (rank, what, r[what])  # and the next step is the model's
        # each held parameter's AdamW state was compared, not only the parameters
        names = set(r["pp_names"])
        kinds = ("exp_avg", "exp_avg_sq", "step")
        assert set(r["pp_state_names"]) == names | {f"{n}:{k}" for n in names for k in kinds}
    assert "(Shard(dim=1),)" in res[0]["tp4_placements"] and "(Shard(dim=1),)" not in res[0]["dp4_placements"]
    everything = {n for n, _ in gpt(0)[0].named_parameters()}
    first, last = (set(res[k]["pp_names"]) for k in (0, 2))
    # a pipeline rank holds (and saves) only its stages' parameters: the tied embedding and head on both
    assert first | last == everything and first & last == {"wte.weight"}
    assert res[1]["pp_names"] == res[0]["pp_names"] and res[3]["pp_names"] == res[2]["pp_names"]
    for r, mine in zip(res, (first, first, last, last)):
        assert r["model_keys"] == r["pp_keys"], "the model object holds no stale copy either"
        assert {k for k in r["pp_keys"] if k in everything} == mine
        assert "lm_head.weight" in r["pp_keys"] and "wte.weight" in r["pp_keys"]
    # the pipeline axis alone (ranks 0, 1 and 2, 3: two pipelines): whole tensors, its stage's each
    assert res[0]["alone_keys"] == res[2]["alone_keys"] != res[1]["alone_keys"] == res[3]["alone_keys"]
    assert "blocks.1.mlp.fc.weight" in res[1]["alone_keys"] and "blocks.1.mlp.fc.weight" not in res[0]["alone_keys"]


def test_dcp_across_layouts_corpus_llama_flattened_optimizer_state(pool, tmp_path):
    """The torchtitan-style Llama of tests/_corpus.py (untied: no name shared by the two stages), its
    optimizer state in torch's flattened form: saved at pp=2 x dp=2, loaded exactly at dp=4, and back."""
    import autopar
    from _dcp_pipeline_helpers import across_layouts, titan

    model, args = titan(0)
    plan = autopar.plan(model, autopar.Mesh({"pp": 2, "dp": 2}, device="cpu"), args,
                        pipeline={"schedule": "1F1B", "microbatches": 2}, progress=False)
    res = pool.run(across_layouts, titan, {"pp": 2, "dp": 2}, plan.to_json(), [("dp4", {"dp": 4}, "fsdp")], None,
                   str(tmp_path), flat=True)
    for r in res:
        assert r["pp_vs_ref"] <= 1e-4, (r["rank"], r["pp_vs_ref"])
        for what in ("dp4_loaded", "single_device_load", "back_loaded"):
            assert r[what] == 0.0, (r["rank"], what, r[what])
        for what in ("dp4_step_vs_ref", "back_step_vs_ref"):
            assert r[what] <= 1e-4, (r["rank"], what, r[what])
        assert r["model_keys"] == r["pp_keys"]
    first, last = (set(res[k]["pp_names"]) for k in (0, 2))
    assert first | last == {n for n, _ in model.named_parameters()} and not first & last
