"""Sharding rules as data: the signatures they enumerate, their composition over a 2-D mesh,
and the fallback for ops without a rule."""

import warnings

import pytest
import torch

from autopar.ir.graph import Ref, TensorSpec
from autopar.ir.placement import B, P, S
from autopar.ir.rules import OpCall, signatures, strategies
from autopar.ir.rules.dimmap import from_spec

f32 = torch.float32


def call(op, target, args, in_shapes, out_shapes, kwargs=None):
    refs = iter(Ref(f"x{i}") for i in range(100))
    args = tuple(next(refs) if a is Ref else a for a in args)
    return OpCall(
        op, target, args, kwargs or {}, [TensorSpec(tuple(s), f32) for s in in_shapes],
        [TensorSpec(tuple(s), f32) for s in out_shapes], "layers.0.mlp",
    )


def sig_set(c):
    return {(s.inputs, s.outputs) for s in signatures(c)}


def test_mm_gives_row_column_contraction_and_partial_propagation():
    c = call("aten.mm.default", torch.ops.aten.mm.default, (Ref, Ref), [(8, 16), (16, 32)], [(8, 32)])
    assert sig_set(c) == {
        ((B, B), (B,)),
        ((S(0), B), (S(0),)),  # batch/rows: data parallel
        ((B, S(1)), (S(1),)),  # column parallel (Megatron's first linear)
        ((S(1), S(0)), (P,)),  # row parallel: contraction split leaves a partial sum
        ((P, B), (P,)),
        ((B, P), (P,)),
    }


def test_addmm_bias_is_partial_with_the_product():
    c = call("aten.addmm.default", torch.ops.aten.addmm.default, (Ref, Ref, Ref), [(32,), (8, 16), (16, 32)], [(8, 32)])
    sigs = sig_set(c)
    assert ((P, S(1), S(0)), (P,)) in sigs
    assert ((S(0), B, S(1)), (S(1),)) in sigs
    assert ((B, S(0), B), (S(0),)) in sigs
    assert not any(ins[0] == B and outs == (P,) for ins, outs in sigs)


def test_add_with_scalar_is_not_linear():
    tensor = call("aten.add.Tensor", torch.ops.aten.add.Tensor, (Ref, Ref), [(4, 6), (6,)], [(4, 6)])
    scalar = call("aten.add.Tensor", torch.ops.aten.add.Tensor, (Ref, 2.0), [(4, 6)], [(4, 6)])
    assert ((P, P), (P,)) in sig_set(tensor)
    assert ((S(0), B), (S(0),)) in sig_set(tensor)  # the bias has no dim 0: it stays whole
    assert ((S(1), S(0)), (S(1),)) in sig_set(tensor)
    assert not any(P in outs for _, outs in sig_set(scalar))


def test_softmax_dim_is_never_split():
    c = call("aten._softmax.default", torch.ops.aten._softmax.default, (Ref, -1, False), [(4, 6)], [(4, 6)])
    assert sig_set(c) == {((B,), (B,)), ((S(0),), (S(0),))}


def test_view_splits_merged_dim_only_on_its_leading_factor_and_evenly():
    # [b, s, h*d] -> [b, s, h, d]: splitting h is splitting the merged dim; d never.
    c = call("aten.view.default", torch.ops.aten.view.default, (Ref, [2, 5, 6, 4]), [(2, 5, 24)], [(2, 5, 6, 4)])
    sigs = sig_set(c)
    assert ((S(2),), (S(2),)) in sigs
    assert ((S(2),), (S(3),)) not in sigs
    strats = strategies(c, (2, 3))
    # h = 6 splits over both axes (2 x 3 pieces); batch 2 does not split over 3 (min size 2 < 3 ok).
    tags = {tuple(s.tag for s in st) for st in strats}
    assert ("S:g2_0", "S:g2_0") in tags
    c5 = call("aten.view.default", torch.ops.aten.view.default, (Ref, [2, 5, 5, 4]), [(2, 5, 20)], [(2, 5, 5, 4)])
    tags5 = {tuple(s.tag for s in st) for st in strategies(c5, (2, 3))}
    assert ("S:g2_0", "B") not in tags5  # 5 heads over 2: merged pieces would not line up


def test_composition_is_the_product_of_axis_signatures():
    c = call("aten.mm.default", torch.ops.aten.mm.default, (Ref, Ref), [(8, 16), (16, 32)], [(8, 32)])
    n = len(signatures(c))
    assert len(strategies(c, (2, 4))) == n * n
    # FSDP x TP style: rows over axis 0, columns over axis 1.
    assert any(st[0].tag == "S:m" and st[1].tag == "S:n" for st in strategies(c, (2, 4)))


def test_op_without_rule_runs_replicated_with_one_warning():
    c = call("aten.fancy_op.default", None, (Ref,), [(4, 4)], [(4, 4)])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first = signatures(c)
        signatures(c)
    assert [(s.inputs, s.outputs) for s in first] == [((B,), (B,))]
    msgs = [str(x.message) for x in w if "no sharding rule" in str(x.message)]
    assert len(msgs) == 1 and "aten.fancy_op.default" in msgs[0] and "layers.0.mlp" in msgs[0]


def test_the_no_rule_warning_speaks_to_the_user():
    """The warning says where the op is, what running it whole costs, and what to do."""
    from autopar.ir.rules.base import no_rule_message

    c = call("aten.fancy_op.default", None, (Ref,), [(256, 1024)], [(256, 1024)])
    msg = no_rule_message(c)
    assert "aten.fancy_op.default" in msg and "'layers.0.mlp'" in msg and "(256, 1024)" in msg
    assert "every device runs it whole" in msg and "1 MiB" in msg  # 256 * 1024 float32
    assert "To avoid it" in msg and "autopar/ir/rules" not in msg


def test_spec_notation_parses_merged_and_size_one_dims():
    dm = from_spec("b (h d), 1 n -> b h d n", [(2, 12), (1, 5)], [(2, 3, 4, 5)])
    assert dm.inputs[0] == [("b",), ("h", "d")]
    assert dm.inputs[1] == [(), ("n",)]
    assert dm.sizes == {"b": 2, "h": 3, "d": 4, "n": 5}
    assert dm.merged("h") and not dm.merged("b")


@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 3)])
def test_vocab_parallel_embedding_is_offered_and_correct(mesh):
    from autopar.ir.rules.proof.interp import check_strategy

    w = torch.randn(7, 5, dtype=torch.float64)
    ids = torch.tensor([[0, 6, 3], [2, 5, 1]])
    c = OpCall(
        "aten.embedding.default", torch.ops.aten.embedding.default, (Ref("w"), Ref("i")), {},
        [TensorSpec((7, 5), torch.float64), TensorSpec((2, 3), torch.int64)], [TensorSpec((2, 3, 5), torch.float64)],
    )
    vocab = [st for st in strategies(c, mesh) if all(s.tag == "vocab" for s in st)]
    assert vocab, "vocabulary split missing"
    for st in vocab:
        assert check_strategy(c, st, mesh, [w, ids]).ok
        # without the offsets every device but the first would gather the wrong rows
        assert not check_strategy(c, st, mesh, [w, ids], offset_scale=0).ok


def _nll_backward_call(weighted: bool, reduction: int = 1) -> tuple[OpCall, list[torch.Tensor]]:
    """``nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight)``
    on 5 rows of 6 classes, with the tensors to run it on (target 2 is ignored)."""
    f64 = torch.float64
    logp = torch.randn(5, 6, dtype=f64).log_softmax(1)
    target = torch.tensor([0, 5, -100, 3, 2])
    weight = torch.rand(6, dtype=f64) + 0.5
    grad = torch.randn(5, dtype=f64) if reduction == 0 else torch.tensor(1.3, dtype=f64)
    total = (weight[target.clamp(min=0)] * (target != -100)).sum() if weighted else torch.tensor(4.0, dtype=f64)
    tensors = [grad, logp, target] + ([weight] if weighted else []) + [total]
    names = iter(("g", "x", "t", "w", "tw"))
    args = (Ref(next(names)), Ref(next(names)), Ref(next(names)), Ref(next(names)) if weighted else None, reduction,
            -100, Ref("tw"))
    c = OpCall(
        "aten.nll_loss_backward.default", torch.ops.aten.nll_loss_backward.default, args, {},
        [TensorSpec(tuple(t.shape), t.dtype) for t in tensors], [TensorSpec((5, 6), f64)],
    )
    return c, tensors


@pytest.mark.parametrize("weighted", [False, True])
def test_nll_backward_reads_its_weight_argument(weighted):
    # the backward's weight is its 4th argument (the forward's 3rd is the backward's target): every
    # signature places exactly the op's tensor inputs, and the class split runs only unweighted
    c, tensors = _nll_backward_call(weighted)
    sigs = signatures(c)
    assert {len(s.inputs) for s in sigs} == {len(tensors)}
    classes = [s for s in sigs if s.tag == "classes"]
    assert bool(classes) is not weighted
    assert all(s.inputs[3] == B for s in sigs)  # total_weight (or the weight) never splits


@pytest.mark.parametrize("reduction", [0, 1, 2])
@pytest.mark.parametrize("mesh", [(2,), (3,), (2, 2)])
def test_nll_backward_class_split_is_correct(mesh, reduction):
    from autopar.ir.rules.proof.interp import check_strategy

    c, tensors = _nll_backward_call(False, reduction)
    split = [st for st in strategies(c, mesh) if any(s.tag == "classes" for s in st)]
    assert split, "the class split of the loss's backward is missing"
    for st in split:
        assert check_strategy(c, st, mesh, tensors).ok, st
        # without each block's class offset every device but the first would score the wrong classes
        assert not check_strategy(c, st, mesh, tensors, offset_scale=0).ok, st
