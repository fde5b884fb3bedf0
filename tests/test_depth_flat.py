"""The analyses a deep stack makes cheap give what the plain per-node computation gives:
``dimflow.linked_dims`` (each op's dim links worked out once per op signature) against a union
of every node's own ``DimMap``, ``TensorRegions.pairs`` (one look per component) against the
pairwise definition, and the per-graph caches (parameter views, cast policy) against a fresh
computation, on models whose layers read across one another (a residual stream, T5's shared
position bias, RoPE tables every layer reads) at a depth the stacked capture replicates."""

from __future__ import annotations

import functools
import warnings

import pytest
from _corpus import build as corpus_build

from autopar.cost_model.casting import _policy, cast_policy
from autopar.ir.capture import capture
from autopar.ir.dimflow import _factors, _tensor_dims, linked_dims
from autopar.ir.graph import Ref
from autopar.ir.rules.base import dimmap, op_call
from autopar.ir.views import FOLLOWERS, param_views
from autopar.passes.search.recipes import TensorRegions, _embedding_tables

MODELS = ["titan_llama", "hf_t5"]


@functools.lru_cache(maxsize=None)
def _graph(name: str, layers: int = 6):
    model, args, kwargs = corpus_build(name, layers=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, args, kwargs)


def _plain_links(graph) -> dict:
    """Every (tensor, dim)'s component, each node's DimMap taken on its own (no sharing)."""
    parent: dict = {}

    def find(k):
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    for node in graph.nodes:
        dm = None if node.is_placeholder else dimmap(op_call(graph, node))
        if dm is None:
            continue
        holders: dict = {}
        for r, dims in _tensor_dims(node, dm):
            for d in range(len(dims)):
                for f in _factors(dims, d, dm.sizes, False):
                    first = holders.setdefault(f, (r, d))
                    if first != (r, d):
                        a, b = find(first), find((r, d))
                        if a != b:
                            parent[b] = a
    members: dict = {}
    for k in parent:
        members.setdefault(find(k), set()).add(k)
    out: dict = {}
    for m in members.values():
        component = frozenset(m)  # one object per component, shared by its keys
        for k in m:
            out[k] = component
    return out


@pytest.mark.parametrize("name", MODELS)
def test_linked_dims_equal_each_nodes_own_links(name):
    graph = _graph(name)
    got = linked_dims(graph)
    want = _plain_links(graph)
    assert set(got) == set(want)
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    checked: set = set()  # (component, its want) pairs already compared: a residual stream's is shared by thousands
    for key, comp in got.items():
        if (id(comp), id(want[key])) in checked:
            continue
        checked.add((id(comp), id(want[key])))
        assert frozenset(comp) == want[key]
        assert list(comp) == sorted(comp, key=lambda k: (order[k[0].node], k[0].index, k[1]))


def _plain_pairs(graph, regions: TensorRegions) -> dict[str, int]:
    """``pairs`` by its definition: every two weight matrices' dims in one component that touches
    no input or embedding table pair up."""
    tables = _embedding_tables(graph)
    mats = sorted(v for v in graph.params.values() if graph.node(v).out.ndim == 2 and v not in tables)
    outside = tables | set(graph.inputs.values())
    found: dict[str, set[int]] = {}
    for p in mats:
        for d in range(2):
            comp = regions.component(p, d)
            if any(ref.node in outside for ref, _ in comp):
                continue
            for ref, e in comp:
                if ref.node in mats and ref.node != p and not ref.index:
                    found.setdefault(p, set()).add(d)
                    found.setdefault(ref.node, set()).add(e)
    return {p: ds.pop() for p, ds in sorted(found.items()) if len(ds) == 1}


@pytest.mark.parametrize("name", MODELS)
def test_pairs_are_the_pairwise_definition(name):
    graph = _graph(name)
    regions = TensorRegions(graph)
    got = regions.pairs()
    assert got == _plain_pairs(graph, regions)
    if name == "titan_llama":  # every attention and MLP weight pairs (column then row parallel)
        assert len(got) == 7 * 6


def test_per_graph_caches_answer_as_a_fresh_computation():
    graph = _graph("titan_llama")
    views = param_views(graph)
    fresh = set(graph.params.values())
    for n in graph.nodes:
        if n.op in FOLLOWERS and len(n.inputs) == 1 and n.inputs[0].node in fresh:
            fresh.add(n.name)
    assert views == fresh and len(views) > len(graph.params)
    views.add("not a node")  # each caller's own set: the cache is not changed
    assert param_views(graph) == fresh
    policy = cast_policy(graph, "bf16-mixed")
    assert cast_policy(graph, "bf16-mixed") is policy
    assert cast_policy(graph, "fp16-mixed").compute != policy.compute
    assert policy == _policy(graph, "bf16-mixed")  # what a fresh computation gives
    assert any(Ref(n, 0) in policy.dtypes for n in graph.params.values())
