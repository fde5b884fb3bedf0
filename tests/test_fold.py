"""Fold: repeated layers are found, their instances are alike, and the problem's size does not
grow with depth."""

import warnings

import pytest

import autopar.models as M
from autopar.ir.capture import capture
from autopar.passes.search.fold import fold

warnings.simplefilter("ignore")


@pytest.mark.parametrize("family, depth_kw", [("llama", "n_layers"), ("moe", "n_layers"), ("gpt", "n_layer")])
def test_problem_size_does_not_grow_with_depth(family, depth_kw):
    sizes = []
    for depth in (3, 6):
        model, inputs = M.make(family, device="meta", **{depth_kw: depth})
        graph = capture(model, inputs)
        folding = fold(graph)
        assert len(folding.groups) == 1
        group = folding.groups[0]
        assert group.count >= depth - 1  # the first or last layer may differ (embedding, head)
        representatives = {folding.representative(n.name) for n in graph.nodes}
        sizes.append(len(representatives))
    # LLaMA and MoE fold their gradient accumulation too; GPT's tied embedding leaves 2 per layer
    assert sizes[1] - sizes[0] <= (6 if family == "gpt" else 0)


def test_instances_are_alike_node_by_node():
    model, inputs = M.make("llama", device="meta", n_layers=4)
    graph = capture(model, inputs)
    folding = fold(graph)
    group = folding.groups[0]
    for names in group.instances[1:]:
        for a, b in zip(group.instances[0], names):
            na, nb = graph.node(a), graph.node(b)
            assert (na.op, na.outputs, na.phase) == (nb.op, nb.outputs, nb.phase)
            assert folding.representative(b) == a
            assert folding.multiplicity(b) == group.count


def test_distinct_layers_do_not_fold():
    model, inputs = M.make("cnn", device="meta")  # every stage has its own widths
    assert fold(capture(model, inputs)).groups == []
