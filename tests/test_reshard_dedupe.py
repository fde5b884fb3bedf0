"""One resharding per tensor and target placement: a tensor that several consumers need at the same
placement is resharded (and paid for) once — by the evaluator, the ILP, local search, merge and
the plan's list of reshardings alike."""

import dataclasses
import itertools
import random
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions
from autopar.ir.placement import B, P, Split
from autopar.passes.search.merge import merge
from autopar.passes.search.problem import Group, PEdge, PNode, Problem, evaluate, incident_transfers, local_cost
from autopar.planner.report import build_plan
from autopar.passes.search.solve import solve

warnings.simplefilter("ignore")

S0 = Split(0)
RESHARD = {(P, B): 10e-6, (P, S0): 5e-6, (B, S0): 0.0, (S0, B): 4e-6, (B, P): 0.0, (S0, P): 0.0}


def _cost(p, q) -> float:
    return 0.0 if p == q else RESHARD[p, q]


def _node(name, compute, mult=1):
    k = len(compute)
    return PNode(name, [f"{name}:{s}" for s in range(k)], mult, 0, list(compute), [0.0] * k,
                 {"params": [0.0] * k, "grads": [0.0] * k, "optimizer": [0.0] * k, "activations": [0.0] * k})


def _edge(src, dst, out_places, in_places, share, mult=1, kind="activation"):
    """``out_places``/``in_places``: the placement each strategy of src/dst gives/takes."""
    po = sorted(set(out_places), key=out_places.index)
    pi = sorted(set(in_places), key=in_places.index)
    return PEdge(src, 0, dst, 0, [po.index(p) for p in out_places], [pi.index(q) for q in in_places], [(p,) for p in po],
                 [(q,) for q in pi], [[_cost(p, q) for q in pi] for p in po], mult, kind, 0, None, 2, share)


def _problem(nodes, edges):
    return Problem(nodes, edges, [Group("g (forward)", 1), Group("g (backward)", 1)], float("inf"))


def _brute(problem):
    best = None
    for choice in itertools.product(*[range(len(n.strategies)) for n in problem.nodes]):
        t = evaluate(problem, choice).step_time
        if best is None or t < best[0] - 1e-15:
            best = (t, list(choice))
    return best


def _two_consumers(share=(0, 0), mult=1):
    """A producer whose output is P, read by two consumers that take it as B (no compute) or as
    S(0) (4 us of compute): alone, each consumer prefers S(0) (5 + 4 < 10 us); shared, one
    all-reduce to B for both (10 us) beats two reduce-scatters and two computes (18 us)."""
    nodes = [_node("src", [0.0], mult), _node("c1", [0.0, 4e-6], mult), _node("c2", [0.0, 4e-6], mult)]
    edges = [_edge(0, 1, [P], [B, S0], share[0], mult), _edge(0, 2, [P], [B, S0], share[1], mult)]
    return _problem(nodes, edges)


def test_a_tensor_two_consumers_need_at_one_placement_is_resharded_once():
    shared = _two_consumers()
    assert shared.transfers == [[0, 1]]
    assert evaluate(shared, [0, 0, 0]).comm_time == pytest.approx(10e-6)  # one all-reduce, not two
    assert evaluate(shared, [0, 1, 1]).comm_time == pytest.approx(5e-6)  # one reduce-scatter
    assert evaluate(shared, [0, 0, 1]).comm_time == pytest.approx(15e-6)  # two targets: both paid
    # edges of separate transfers (other tensors) are paid apiece
    apart = _two_consumers(share=(0, 1))
    assert evaluate(apart, [0, 0, 0]).comm_time == pytest.approx(20e-6)
    # a folded transfer (3 producer instances) pays once per instance
    assert evaluate(_two_consumers(mult=3), [0, 0, 0]).comm_time == pytest.approx(30e-6)


def test_the_ilp_and_local_search_price_shared_reshardings_like_the_evaluator():
    shared, apart = _two_consumers(), _two_consumers(share=(0, 1))
    assert _brute(shared)[1] == [0, 0, 0] and _brute(apart)[1] == [0, 1, 1]
    for problem in (shared, apart):
        sol = solve(problem)
        assert evaluate(problem, sol.choice).step_time == pytest.approx(_brute(problem)[0], abs=1e-12)
        assert sol.objective == pytest.approx(_brute(problem)[0], abs=1e-11)
    # local cost: differences between strategies of a node are differences of the evaluator
    incident = incident_transfers(shared)
    for choice in itertools.product(range(1), range(2), range(2)):
        for i in (1, 2):
            base = evaluate(shared, choice).step_time
            for s in range(2):
                other = list(choice)
                other[i] = s
                assert local_cost(shared, incident, choice, i, s) - local_cost(shared, incident, choice, i, choice[i]) == \
                    pytest.approx(evaluate(shared, other).step_time - base, abs=1e-15)


def test_merge_keeps_a_follower_whose_tensor_another_consumer_shares():
    """u gives P (free) or B (30 us); v is a view of u's output, z reads v as B, w reads u as B.
    Resharding u's output once, before v, serves z and w (10 us); were v to follow u, z and w
    would each pay an all-reduce (20 us). Merge must keep v apart, so the merged ILP still finds
    the optimum of the unmerged problem."""
    nodes = [_node("u", [0.0, 30e-6]), _node("v", [0.0, 0.0]), _node("z", [0.0]), _node("w", [0.0])]
    edges = [
        _edge(0, 1, [P, B], [P, B], share=0),  # u -> v (a view: takes P or B as is)
        _edge(0, 3, [P, B], [B], share=0),  # u -> w
        _edge(1, 2, [P, B], [B], share=1),  # v -> z
    ]
    problem = _problem(nodes, edges)
    best, choice = _brute(problem)
    assert best == pytest.approx(10e-6) and choice == [0, 1, 0, 0]
    ops = {"u": "aten.mm.default", "v": "aten.view.default", "z": "aten.relu.default", "w": "aten.relu.default"}
    merged = merge(problem, ops)
    assert len(merged.problem.nodes) == 4  # v kept
    sol = solve(merged.problem)
    assert evaluate(problem, merged.expand(sol.choice, 4)).step_time == pytest.approx(best, abs=1e-12)
    # with w gone, u's output has one consumer: v follows u, and the optimum is unchanged
    lone = _problem(nodes[:3], edges[:1] + edges[2:])
    merged = merge(lone, ops)
    assert len(merged.problem.nodes) == 2
    assert evaluate(lone, merged.expand(solve(merged.problem).choice, 3)).step_time == pytest.approx(_brute(lone)[0], abs=1e-12)


class Block(nn.Module):
    """A residual MLP block; ``scale`` is made once outside the blocks and read by each of them."""

    def __init__(self, d, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x, scale):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x))) * scale


class Stack(nn.Module):
    def __init__(self, d, h, n):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, h) for _ in range(n))

    def forward(self, x):
        scale = torch.sigmoid(x.sum(-1, keepdim=True))
        for layer in self.layers:
            x = layer(x, scale)
        return x.float().pow(2).mean()


def test_plan_reshardings_of_folded_layers_add_up_to_the_evaluator():
    """On four blocks, three folded, for the plan and for random choices: the plan's reshardings
    (one per tensor, target placement and — for gathers — phase, listed on the unfolded graph)
    add up to the evaluator's communication (priced on the folded problem, where a layer's output
    read by the next layer and the last layer's output read by the loss are priced apart, and
    ``scale``, read by every layer, is resharded once)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack(64, 256, 4)
    planned = run_passes(model, autopar.Mesh({"tp": 4}, device="h100"), (torch.randn(32, 64),),
                         options=PlanOptions(deterministic_time=5, progress=False))
    problem, folding = planned.problem, planned.folding
    assert folding.groups and folding.groups[0].count == 3  # layers 1..3 (layer 0 has no input gradient)
    rng = random.Random(0)
    choices = [planned.choice] + [[rng.randrange(len(n.strategies)) for n in problem.nodes] for _ in range(12)]
    for choice in choices:
        cost = evaluate(problem, choice)
        listed = build_plan(dataclasses.replace(planned, choice=choice, cost=cost)).reshardings
        activation = sum(r["time"] for r in listed if r["kind"] == "activation")
        # a parameter node's comm is its optimizer step (``build``), not a resharding
        optimizer = sum(n.mult * n.comm[c] for n, c in zip(problem.nodes, choice)
                        if planned.graph.node(n.name).is_placeholder)
        # comm_time also holds the compute slowed by hidden collectives (``cost.contention``)
        assert activation == pytest.approx(cost.comm_time - cost.exposed_param_comm - cost.contention - optimizer,
                                           rel=1e-9, abs=1e-12)
        assert all(len(r["consumers"]) == len(set(r["consumers"])) and r["consumer"] == r["consumers"][0] for r in listed)
        keys = [(r["tensor"], r["to"], r["kind"]) for r in listed if r["kind"] == "activation"]
        assert len(keys) == len(set(keys))  # one entry per tensor and target placement
    # scale is made once, outside the layers, and read by each: a resharding of it serves them all
    into_layers = [e for e in problem.edges if problem.nodes[e.src].name.startswith("sigmoid")
                   and problem.nodes[e.dst].mult == 3]
    assert into_layers and all(e.mult == 1 for e in into_layers)


def test_local_cost_differences_are_evaluator_differences_on_a_captured_graph():
    """With every edge priced as an activation (no overlap hiding), a node's local cost changes
    exactly as the evaluator's step time does, shared reshardings included."""
    from autopar.models import make

    model, inputs = make("mlp", batch=64, in_dim=64, hidden_dim=256, n_layers=2, num_classes=64, device="meta")
    planned = run_passes(model, autopar.Mesh({"tp": 4}, device="h100"), inputs,
                         options=PlanOptions(deterministic_time=2, progress=False))
    p = planned.problem
    flat = Problem(p.nodes, [dataclasses.replace(e, kind="activation") for e in p.edges], p.groups, p.memory_budget)
    assert any(len(t) > 1 for t in flat.transfers)
    incident = incident_transfers(flat)
    rng = random.Random(1)
    for _ in range(20):
        choice = [rng.randrange(len(n.strategies)) for n in flat.nodes]
        base = evaluate(flat, choice).step_time
        for i in rng.sample(range(len(flat.nodes)), 8):
            for s in range(len(flat.nodes[i].strategies)):
                other = list(choice)
                other[i] = s
                delta = local_cost(flat, incident, choice, i, s) - local_cost(flat, incident, choice, i, choice[i])
                assert delta == pytest.approx(evaluate(flat, other).step_time - base, rel=1e-9, abs=1e-13)
