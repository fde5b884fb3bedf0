"""A team's own layout priced as a baseline (``autopar.recipes.from_dtensor``, ``from_torchtitan``):
a torchtitan-style ``parallelize`` function (written here the way torchtitan's Llama 3 parallelizes:
a tensor-parallel plan of column-parallel wq/wk/wv/w1/w3, row-parallel wo/w2 and sequence-parallel
norms, then ``fully_shard`` per block) runs on a meta copy under a fake process group, its
placements are read off the DTensors, and the layout is priced by the same evaluator as the
built-in recipes: within 5% of ``fsdp_tp``, the recipe that matches it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from _corpus import titan_llama
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import autopar
from autopar.errors import ArgumentError, RecipeError
from autopar.ir.placement import B, Split
from autopar.recipes import dtensor_layout, torchtitan_layout


def parallelize_llama(model, world_mesh):
    """Tensor parallel on ``tp`` and FSDP on ``dp``, as torchtitan's Llama 3 ``parallelize`` lays
    them out (the model under the loss wrapper is torchtitan's ``Transformer``)."""
    inner = model.model
    tp_mesh, dp_mesh = world_mesh["tp"], world_mesh["dp"]
    parallelize_module(inner, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in inner.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    for block in inner.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def test_torchtitan_style_parallelize_is_read_off_its_dtensors():
    model, args, _ = titan_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    layout = dtensor_layout(model, mesh, parallelize_llama)
    assert not dist.is_initialized(), "the fake process group is gone"
    assert all(torch.equal(p, before[n]) and not p.is_meta for n, p in model.named_parameters()), "model untouched"
    assert layout.roles == ("shard", "tensor") and layout.sequence_parallel
    pl = layout.params
    assert len(pl) == len(before)
    for name in ("wq", "wk", "wv"):
        assert pl[f"model.layers.0.attention.{name}.weight"] == (Split(0), Split(0))  # column: FSDP strided
    assert pl["model.layers.1.feed_forward.w1.weight"] == (Split(0), Split(0))
    assert pl["model.layers.0.attention.wo.weight"] == (Split(0), Split(1))  # row
    assert pl["model.layers.0.feed_forward.w2.weight"] == (Split(0), Split(1))
    assert pl["model.layers.0.attention_norm.weight"] == (Split(0), B)  # sequence parallel: whole on tp
    assert pl["model.tok_embeddings.weight"] == (Split(0), Split(0))  # vocabulary-parallel embedding
    assert pl["model.output.weight"] == (Split(0), Split(0))


def test_imported_layout_prices_within_5_percent_of_fsdp_tp():
    model, args, _ = titan_llama()
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    mine = autopar.recipes.from_dtensor(model, mesh, parallelize_llama, args, progress=False)
    recipe = autopar.recipes.fsdp_tp(model, mesh, args, progress=False)
    assert mine.source == "recipe:dtensor:parallelize_llama"
    assert set(mine.baselines) == {"dtensor:parallelize_llama"}
    assert mine.step_time == pytest.approx(recipe.step_time, rel=0.05), (mine.step_time, recipe.step_time)
    # the imported placements are the plan's (FSDP on dp, Megatron on tp)
    assert mine.placements["model.layers.0.attention.wo.weight"] == "S(0), S(1)"
    assert mine.placements["model.layers.0.attention.wq.weight"] == "S(0), S(0)"
    # plan.diff compares it with the recipe's plan (fsdp_tp shards a column weight's other dim on dp)
    text = recipe.diff(mine)
    assert "model.layers.0.attention.wq.weight" in text and "recipe:fsdp_tp" in text
    # the Layout alone is a recipe= of autopar.plan, and its plan is a plan file like any other
    again = autopar.plan(model, mesh, args, recipe=dtensor_layout(model, mesh, parallelize_llama), progress=False)
    assert again.to_json() == mine.to_json()
    assert autopar.Plan.from_dict(json.loads(mine.to_json())).source == mine.source


def test_hugging_face_llama_without_sequence_parallel():
    """Model code this project did not write (transformers' LLaMA), tensor parallel without sequence
    parallelism (activations then follow Megatron's regions on tp), FSDP per decoder layer."""
    from _corpus import hf_llama

    model, args, kwargs = hf_llama()

    def parallelize(m, device_mesh):
        for layer in m.model.layers:
            parallelize_module(layer, device_mesh["tp"], {
                **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"}, "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
            fully_shard(layer, mesh=device_mesh["dp"])
        fully_shard(m, mesh=device_mesh["dp"])

    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    layout = dtensor_layout(model, mesh, parallelize)
    assert layout.roles == ("shard", "tensor") and not layout.sequence_parallel
    assert layout.params["model.embed_tokens.weight"] == (Split(0), B)  # FSDP alone: not tensor parallel
    mine = autopar.recipes.from_dtensor(model, mesh, parallelize, args, kwargs, progress=False)
    assert mine.placements["model.layers.1.mlp.down_proj.weight"] == "S(0), S(1)"
    recipe = autopar.recipes.fsdp_tp(model, mesh, args, kwargs, progress=False)
    assert mine.step_time == pytest.approx(recipe.step_time, rel=0.05), (mine.step_time, recipe.step_time)


def test_fsdp_alone_and_a_plain_model():
    model, args, _ = titan_llama()
    mesh = autopar.Mesh({"dp": 4}, device="h100")

    def fsdp(m, device_mesh):
        for block in m.model.layers.values():
            fully_shard(block, mesh=device_mesh)
        fully_shard(m, mesh=device_mesh)

    layout = dtensor_layout(model, mesh, fsdp)
    assert layout.roles == ("shard",) and set(layout.params.values()) == {(Split(0),)}
    mine = autopar.recipes.from_dtensor(model, mesh, fsdp, args, progress=False)
    assert mine.step_time == pytest.approx(autopar.recipes.fsdp(model, mesh, args, progress=False).step_time, rel=0.05)

    def nothing(m, device_mesh):  # a plain model on a data axis: DDP
        return m

    assert dtensor_layout(model, mesh, nothing).roles == ("replicate",)


def test_errors_name_the_function_and_the_parameter():
    model, args, _ = titan_llama()
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")

    def broken(m, device_mesh):
        raise KeyError("no such block")

    with pytest.raises(RecipeError, match="broken.*KeyError"):
        dtensor_layout(model, mesh, broken)
    assert not dist.is_initialized()
    with pytest.raises(ArgumentError, match="parallelize_fn"):
        dtensor_layout(model, mesh, "parallelize")
    with pytest.raises(ArgumentError, match="named axes"):
        dtensor_layout(model, autopar.Mesh.devices(4), parallelize_llama)


def test_torchtitan_job_config_as_a_baseline(tmp_path):
    config = tmp_path / "llama3.toml"
    config.write_text("[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 2\n"
                      "[activation_checkpoint]\nmode = \"none\"\n")
    axes, layout, plan_kw = torchtitan_layout(str(config), devices=4)
    assert axes == {"dp_shard": 2, "tp": 2} and layout.roles == ("shard", "tensor")
    assert plan_kw == {"checkpointing": "none", "kept_gathers": "none"}
    model, args, _ = titan_llama()
    mine = autopar.recipes.from_torchtitan(model, str(config), args, devices=4, progress=False)
    recipe = autopar.recipes.fsdp_tp(model, autopar.Mesh(axes, device="h100"), args, progress=False)
    assert mine.source == "recipe:torchtitan" and tuple(mine.axis_names) == ("dp_shard", "tp")
    assert mine.step_time == pytest.approx(recipe.step_time, rel=0.05)
    hsdp = torchtitan_layout({"parallelism": {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": 2,
                                              "fsdp_reshard_after_forward": "never"},
                              "activation_checkpoint": {"mode": "full"}})
    assert hsdp[1].roles == ("replicate", "shard") and hsdp[2] == {"checkpointing": "full", "kept_gathers": "all"}
    with pytest.raises(ArgumentError, match="devices="):
        torchtitan_layout({"parallelism": {"tensor_parallel_degree": 2}})
    with pytest.raises(RecipeError, match="pipeline"):
        torchtitan_layout({"parallelism": {"pipeline_parallel_degree": 2, "data_parallel_shard_degree": 2}})
