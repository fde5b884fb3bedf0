"""Dims of equal blocks (``ir.blocks``): a fused qkv projection is split block by block, so
Megatron tensor parallelism computes whole heads of q, k and v where each device holds them."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.ir.capture import capture
from autopar.ir.placement import B, S, blocks_fit, expand_blocks, local_block

from _parity import build, plan_json, simulated_errors


@pytest.fixture(scope="module")
def gpt_graph():
    model, args = build("gpt")
    return capture(model, args)


def test_fused_qkv_dims_are_marked_as_blocks(gpt_graph):
    g = gpt_graph
    w = g.node(g.params["blocks.0.attn.qkv.weight"]).out
    b = g.node(g.params["blocks.0.attn.qkv.bias"]).out
    assert w.blocks == ((0, 3),) and b.blocks == ((0, 3),)
    assert g.spec(g.grads["blocks.0.attn.qkv.weight"]).blocks == ((0, 3),)
    splits = [n for n in g.ops() if n.op == "aten.split.Tensor"]
    assert splits and all(g.spec(n.inputs[0]).blocks == ((2, 3),) for n in splits)
    assert all(not o.blocks for n in splits for o in n.outputs)  # q, k and v themselves are plain
    # nothing else of the model is made of blocks
    others = {fqn for fqn, name in g.params.items() if g.node(name).out.blocks}
    assert others == {f"blocks.{i}.attn.qkv.{k}" for i in range(2) for k in ("weight", "bias")}


def test_blocks_split_evenly_on_one_axis():
    assert blocks_fit((192, 64), (S(0),), (4,), ((0, 3),))
    assert not blocks_fit((192, 64), (S(0),), (3,), ((0, 3),))  # 64 rows per block over 3
    assert not blocks_fit((192, 64), (S(0), S(0)), (2, 2), ((0, 3),))  # two axes on one block dim
    assert blocks_fit((192, 64), (S(1), S(0)), (2, 2), ((0, 3),))


def test_local_block_takes_a_piece_of_every_block():
    t = torch.arange(12.0).reshape(12, 1)
    got = [local_block(t, (S(0),), (2,), (c,), ((0, 3),)).flatten().tolist() for c in range(2)]
    assert got == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    # DTensor's _StridedShard(0, split_factor=3) holds the same rows
    from torch.distributed.tensor.placement_types import _StridedShard

    for c in range(2):
        _, rows = _StridedShard(0, split_factor=3)._local_shard_size_and_offset(
            curr_local_size=12, num_chunks=2, rank=c, offset_mode=1)
        assert rows == got[c]
    assert expand_blocks((8, 12), (B, S(1)), ((1, 3),)) == ((8, 3, 4), (B, S(2)))


def test_strided_pieces_for_checkpoints_match_dtensor():
    from autopar._torch_compat import held_indices
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    pl = (Shard(1), _StridedShard(0, split_factor=3))
    for c0 in range(2):
        for c1 in range(2):
            assert held_indices(24, 0, pl, (2, 2), (c0, c1)) == [
                r for b in range(3) for r in range(b * 8 + c1 * 4, b * 8 + c1 * 4 + 4)]
            assert held_indices(6, 1, pl, (2, 2), (c0, c1)) == list(range(3 * c0, 3 * c0 + 3))


def test_megatron_tp_computes_whole_heads_with_megatron_collectives():
    axes = (("tp", 4),)
    plan = autopar.Plan.from_dict(json.loads(plan_json("gpt", axes, "megatron_tp")))
    splits = [n for n in plan.nodes if n["op"] == "aten.split.Tensor"]
    assert splits and all(n["tags"] == ["S:blk"] for n in splits), [n["tags"] for n in splits]
    # Megatron's layout: column-split qkv and fc (with their biases), row-split proj (its bias
    # replicated), the token embedding split by vocabulary, the position embedding replicated
    for i in range(2):
        for w, way in (("attn.qkv", "S(0)"), ("attn.proj", "S(1)"), ("mlp.fc", "S(0)"), ("mlp.proj", "S(1)")):
            assert plan.placements[f"blocks.{i}.{w}.weight"] == way, (w, plan.placements)
        for b, way in (("attn.qkv", "S(0)"), ("attn.proj", "B"), ("mlp.fc", "S(0)"), ("mlp.proj", "B")):
            assert plan.placements[f"blocks.{i}.{b}.bias"] == way, (b, plan.placements)
    assert (plan.placements["wte.weight"], plan.placements["wpe.weight"]) == ("S(0)", "B")
    assert "blocks.0.attn.qkv.weight dim 0 (3 blocks)" in plan.summary()  # the user sees the layout
    kinds = {c["kind"] for c in plan.collectives}
    assert "all_to_all" not in kinds, plan.collectives
    # per layer, Megatron's four all-reduces of activations (after attn.proj and mlp.proj, and
    # the input gradients of qkv and fc), and one for the embeddings' partial sums
    act_ar = sum(c["count"] for c in plan.collectives if c["kind"] == "all_reduce" and not c["bucketed"]
                 and c["bytes"] >= 8 * 64 * 4)
    assert act_ar == 4 * 2 + 1, plan.collectives
    # no weight is gathered on the tensor axis (the small all-gathers are bias gradients)
    assert all(c["bytes"] <= 2048 for c in plan.collectives if c["kind"] == "all_gather" and c["phase"] == "backward")
    model, args = build("gpt")
    loss_err, grad_errs = simulated_errors(model, plan, args)
    assert loss_err <= 1e-5
    for name, err in grad_errs.items():
        assert err <= 1e-4, name


def test_megatron_pairs_come_from_the_dataflow():
    """A column-split weight feeds a row-split one: found from which weight dims reach which,
    whatever the modules are called; the residual stream's model dim pairs nothing."""
    from autopar.passes.search.recipes import TensorRegions

    expect = {
        "gpt": {"attn.qkv": 0, "attn.proj": 1, "mlp.fc": 0, "mlp.proj": 1},
        "llama": {"attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
                  "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1},
    }
    for family, ways in expect.items():
        model, args = build(family)
        g = capture(model, args)
        fqn = {v: k for k, v in g.params.items()}
        got = {fqn[node]: d for node, d in TensorRegions(g).pairs().items()}
        prefix = "blocks.0." if family == "gpt" else "layers.0."
        assert {k[len(prefix):-len(".weight")]: d for k, d in got.items() if k.startswith(prefix)} == ways, got
        assert not any("wte" in k or "tok_embeddings" in k or "norm" in k for k in got)
