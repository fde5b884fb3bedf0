"""Layer-grouped parameter gathers (``cost_model.gathers``, ``passes/lower/gathers.py``): under FSDP
each layer's parameters are gathered by one all-gather per step and phase, as FSDP2 does; the plan
predicts one collective per group and the simulated programs run exactly those, computing what the
single-device model computes; their gradients' reduce-scatters likewise run one per layer. Also the
packing itself, and the price of a grouped gather."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
import torch

import autopar
from autopar.cost_model.buckets import collective_calls
from autopar.cost_model.comm import LOCAL_KINDS, reshard_steps, reshard_time
from autopar.cost_model.gathers import gather_shares, gather_time, param_of
from autopar.ir.capture import capture
from autopar.ir.layers import layer_of
from autopar.ir.placement import parse
from autopar.program.bucket import cut_gathered, pack_shards
from autopar.runtime.accounting import compare, differences

from _parity import build, plan_json, rel

MESHES = ((("a", 4),), (("a", 2), ("b", 2)))


def _groups(plan, graph) -> dict[int, list[dict]]:
    """The plan's parameter gather groups: index -> its reshardings."""
    out: dict[int, list[dict]] = defaultdict(list)
    for r in plan.reshardings:
        if r["kind"] == "param" and r.get("bucket") is not None:
            out[r["bucket"]].append(r)
    return out


@pytest.mark.parametrize("axes", MESHES, ids=lambda a: "x".join(str(n) for _, n in a))
@pytest.mark.parametrize("family", ("gpt", "llama"))
def test_layer_grouped_fsdp_matches_one_device_and_runs_the_predicted_collectives(family, axes):
    plan = autopar.Plan.from_dict(json.loads(plan_json(family, axes, "fsdp")))
    model, args = build(family)
    graph = capture(model, args)
    groups = _groups(plan, graph)
    # every layer instance's parameters are gathered together, per phase: a group never mixes
    # layers or phases, and each numbered layer has a group of several parameters in the forward
    fqn_of = {node: fqn for fqn, node in graph.params.items()}
    grouped_layers = set()
    for members in groups.values():
        layers = {layer_of(param_of(graph, r["tensor"].split("[")[0], fqn_of)) for r in members}
        phases = {graph.node(r["consumer"]).phase for r in members}
        assert len(layers) == 1 and len(phases) == 1, members
        assert len({tuple((s["kind"], s["axis"]) for s in r["steps"]) for r in members}) == 1, members
        if len(members) > 1 and None not in layers:
            grouped_layers |= layers
    assert grouped_layers == {layer_of(f) for f in graph.params if layer_of(f) is not None}
    # one collective per group and step: fewer calls than gathered parameters
    def moving(r):
        return [s for s in r["steps"] if s["kind"] not in LOCAL_KINDS]

    alone = [r for r in plan.reshardings if r["kind"] == "param" and r.get("bucket") is None]
    calls = [c for c in collective_calls(plan.reshardings) if c[0] == "param"]
    assert len(calls) == sum(len(moving(r)) for r in alone) + sum(len(m[0]["steps"]) for m in groups.values())
    assert len(calls) < sum(len(moving(r)) for r in plan.reshardings if r["kind"] == "param") / 2

    # gradients: each layer instance's reduce-scatters are one bucket (FSDP2's one per layer)
    rs_buckets: dict[int, set] = defaultdict(set)
    for r in plan.reshardings:
        if r["kind"] == "grad" and any(s["kind"] == "reduce_scatter" for s in r["steps"]):
            fqn = r["consumer"][len("param:"):]
            # a fused qkv (dims of equal blocks) reduce-scatters alone: cost_model/buckets.py
            assert r.get("bucket") is not None or layer_of(fqn) is None or graph.spec(graph.grads[fqn]).blocks, r
            if r.get("bucket") is not None:
                rs_buckets[r["bucket"]].add(layer_of(r["consumer"][len("param:"):]))
    per_layer = [layers for layers in rs_buckets.values() if None not in layers]
    assert per_layer and all(len(layers) == 1 for layers in per_layer), rs_buckets
    assert {next(iter(x)) for x in per_layer} == {layer_of(f) for f in graph.params if layer_of(f) is not None}

    trace: dict = {}
    predicted: dict = {}
    loss, grads = autopar.simulate(model, plan, args, trace=trace, predicted=predicted)
    ref = model(*args)
    ref.backward()
    assert rel(loss, ref) <= 1e-5
    for name, p in model.named_parameters():
        assert rel(grads[name], p.grad) <= 1e-4, name
    assert differences(plan, trace[(0,) * len(axes)]) == []
    assert all(compare(predicted[c], trace[c]) == [] for c in trace)  # simulate's own prediction, every device
    # every device runs the same number of all-gathers as the plan predicts for the first
    want = sum(1 for c in collective_calls(plan.reshardings) if c[1] == "all_gather")
    for coords, ran in trace.items():
        assert sum(1 for e in ran if e.kind == "all_gather") == want, coords


def test_ungrouped_prediction_would_differ():
    """The prediction is not blind to grouping: the same plan with its groups dropped predicts
    other collectives than the program runs."""
    axes = MESHES[1]
    plan = autopar.Plan.from_dict(json.loads(plan_json("llama", axes, "fsdp")))
    model, args = build("llama")
    trace: dict = {}
    autopar.simulate(model, plan, args, trace=trace)
    for r in plan.reshardings:
        if r["kind"] == "param":
            r.pop("bucket", None)
    assert differences(plan, trace[(0, 0)]) != []


@pytest.mark.parametrize("n", [2, 3])
def test_pack_and_cut_round_trip_with_uneven_pieces(n):
    """What ``n`` ranks pack and all-gather (their buffers one after another) cuts back into each
    tensor whole: uneven pieces padded and trimmed, any gathered dim."""
    torch.manual_seed(0)
    wholes = [torch.randn(7, 3), torch.randn(4, 5), torch.randn(2, 3, 5)]
    dims = [0, 1, 2]
    layouts_of, buffers = [], []
    for rank in range(n):
        shards, layouts = [], []
        for whole, d in zip(wholes, dims):
            size = whole.shape[d]
            piece = -(-size // n)
            shard = whole.narrow(d, min(rank * piece, size), max(0, min(piece, size - rank * piece)))
            shards.append(shard)
            layouts.append((d, piece, list(shard.shape), size, list(whole.shape)))
        buffers.append(pack_shards(shards, layouts))
        layouts_of.append(layouts)
    assert len({b.numel() for b in buffers}) == 1  # equal on every rank
    # every rank cuts with its own layouts (only the shapes before differ)
    for layouts in layouts_of:
        for got, whole in zip(cut_gathered(torch.cat(buffers), n, layouts), wholes):
            assert got.is_contiguous() and torch.equal(got, whole)


def test_grouped_gather_pays_its_share_of_one_latency():
    mesh = autopar.Mesh({"a": 8}, device="h100")
    src, dst = parse("S(0)"), parse("B")
    shape, eb = (4096, 4096), 2
    alone = reshard_time(shape, src, dst, mesh, eb)
    (step,) = reshard_steps(shape, src, dst, mesh, eb)
    assert step.kind == "all_gather"
    latency = 8 * mesh.links[0].latency
    assert gather_time(shape, src, dst, mesh, eb, 1.0) == pytest.approx(alone)
    assert gather_time(shape, src, dst, mesh, eb, 0.25) == pytest.approx(alone - 0.75 * latency)
    # anything but all-gathers is priced on its own
    other = parse("S(1)")
    assert gather_time(shape, src, other, mesh, eb, 0.1) == reshard_time(shape, src, other, mesh, eb)


def test_shares_sum_to_one_per_layer_and_are_whole_outside():
    model, args = build("llama")
    graph = capture(model, args)
    shares = gather_shares(graph)
    per_layer = Counter()
    for fqn, node in graph.params.items():
        if layer_of(fqn) is None:  # outside the numbered layers: the whole latency each
            assert shares[node] == 1.0, fqn
        else:
            per_layer[layer_of(fqn)] += shares[node]
    assert len(per_layer) >= 2 and all(v == pytest.approx(1.0) for v in per_layer.values()), per_layer


def test_two_step_groups_are_issued_a_layer_ahead_with_their_chain():
    """On (2, 2) each layer's group gathers on one axis, then the other: both steps are issued
    before the layer ahead of the group's first use starts (the cut between them moves up with
    them), and the last step is waited for only just before its members are cut out."""
    from autopar.passes.lower import lower, resolve
    from autopar.program import collectives as C
    from test_schedule import _is_compute, _layer_spans

    axes = MESHES[1]
    plan = autopar.Plan.from_dict(json.loads(plan_json("llama", axes, "fsdp")))
    model, args = build("llama")
    forward = lower(resolve(capture(model, args), plan), (0, 0)).forward
    order = list(forward.graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    spans = _layer_spans(forward)
    layers = []
    for n in order:
        key = layer_of(n.meta.get("autopar_module") or "") if _is_compute(n) else None
        if key is not None and key not in layers:
            layers.append(key)
    checked = set()
    for first in order:
        if not (first.target is C.all_gather and first.args[0].target is pack_shards
                and all(x.op == "placeholder" or x.all_input_nodes[0].op == "placeholder"
                        for x in first.args[0].args[0])):
            continue
        (w1,) = first.users
        assert w1.prev is first  # the first step is waited at once: the next step needs it
        (cut1,) = w1.users
        pack2 = next(iter(next(iter(cut1.users)).users))
        (last,) = pack2.users
        assert last.target is C.all_gather and last.args[1] != first.args[1]
        (w2,) = last.users
        (cut2,) = w2.users
        assert w2.next is cut2
        reader = min((u for item in cut2.users for u in item.users), key=pos.get)
        key = layer_of(reader.meta.get("autopar_module") or "")
        if key is None:  # the parameters outside the layers: gathered where the program starts
            continue
        k = layers.index(key)
        assert pos[last] < spans[max(k - 1, 0)][0], (last.name, k)
        checked.add(k)
    assert len(layers) >= 2 and checked == set(range(len(layers))), checked
