"""``passes.lower.plain_local``: a rank-aware local op becomes its plain op exactly where its rule's local
implementation runs that op alone on this device, and stays a ``LocalOp`` wherever it needs the
device's offsets (a vocabulary split embedding, attention split on the causal query sequence)."""

from __future__ import annotations

import torch

import autopar
from autopar.ir.capture import capture
from autopar.ir.placement import Split, local_shape
from autopar.ir.rules import op_call
from autopar.ir.rules.base import LocalCtx, run_local
from autopar.models import make
from autopar.passes.lower.plain_local import Input, plain_call
from autopar.passes.search.strategies import input_placement, node_strategies


def _cases(op: str):
    """``(ctx, shapes)`` of every strategy of the first ``op`` node of a tiny GPT on mesh (2,),
    for each device of the mesh."""
    model, args = make("gpt", "tiny", batch=2, seq=8)
    graph = capture(model, args)
    mesh = autopar.Mesh({"a": 2}, device="cpu")
    node = next(n for n in graph.nodes if n.op == op)
    call = op_call(graph, node)
    for strat in node_strategies(graph, node, mesh):
        for coords in ((0,), (1,)):
            shapes = [local_shape(graph.spec(r).shape, input_placement(strat, k), mesh.shape, coords)
                      for k, r in enumerate(node.inputs)]
            yield strat, coords, LocalCtx(call, strat, mesh.shape, coords), shapes


def _tags(strat) -> str:
    return "|".join(sig.tag for sig in strat)


def test_embedding_is_plain_unless_its_vocabulary_is_split():
    seen = set()
    for strat, coords, ctx, shapes in _cases("aten.embedding.default"):
        got = plain_call(ctx, shapes)
        vocab = _tags(strat) == "vocab"
        seen.add(vocab)
        if vocab:
            assert got is None, (coords, strat)  # masks and shifts the ids by this device's offset
        else:
            assert got is not None and got.target is torch.ops.aten.embedding.default, strat
            assert got.args[:2] == (Input(0), Input(1))
    assert seen == {True, False}


def test_causal_attention_split_on_queries_keeps_its_mask():
    seen = set()
    for strat, coords, ctx, shapes in _cases("autopar.attention.default"):
        q_seq_split = isinstance(input_placement(strat, 0)[0], Split) and input_placement(strat, 0)[0].dim == 2  # S or Z
        got = plain_call(ctx, shapes)
        seen.add(q_seq_split)
        if q_seq_split:
            assert got is None, (coords, strat)  # an explicit mask with the block's row offset
        else:
            assert got is not None and got.target is ctx.call.target, strat


def test_plain_call_computes_what_the_local_implementation_computes():
    for op in ("aten.embedding.default", "autopar.attention.default"):
        for strat, coords, ctx, shapes in _cases(op):
            got = plain_call(ctx, shapes)
            if got is None:
                continue
            torch.manual_seed(0)
            xs = [torch.randint(0, shapes[0][0], tuple(shape))
                  if not spec.dtype.is_floating_point else torch.randn(tuple(shape), dtype=spec.dtype)
                  for shape, spec in zip(shapes, ctx.call.in_specs)]
            want = run_local(ctx, xs)
            fill = (lambda a: xs[a.k] if isinstance(a, Input) else a)
            out = got.target(*[fill(a) for a in got.args], **{k: fill(v) for k, v in got.kwargs.items()})
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            assert len(out) == len(want)
            for a, b in zip(out, want):
                assert torch.equal(a, b), (op, strat, coords)
