"""The search: the ILP's optimum equals brute force on small graphs, recipes are feasible points of
the folded and merged ILP, the classic strategies are rediscovered, and bad input fails clearly."""

import itertools
import math
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.models
from autopar.api import run_passes
from autopar.cost_model.precision import get_precision
from autopar.ir.capture import capture
from autopar.passes.cost import build_problem
from autopar.passes.fold import no_folding
from autopar.passes.merge import merge
from autopar.passes.problem import evaluate
from autopar.passes.solve import solve
from autopar.passes.strategies import HintError, node_strategies, resolve_hints

warnings.simplefilter("ignore")


class Tiny(nn.Module):
    """(x @ w).sum(): a joint graph of 8 nodes (with followers to merge) and ~2*10^4 combinations."""

    def __init__(self, d_in=8, d_out=6):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x):
        return (x @ self.w).sum()


def _problem(model, inputs, mesh, budget=float("inf")):
    graph = capture(model, inputs)
    strategies = {n.name: node_strategies(graph, n, mesh) for n in graph.nodes}
    prec = get_precision(None, mesh.hardware)
    return graph, build_problem(graph, mesh, no_folding(), strategies, prec, budget, resolve_hints(graph, mesh, None))


def _brute_force(problem):
    sizes = [len(n.strategies) for n in problem.nodes]
    assert math.prod(sizes) <= 10**7
    best = None
    for choice in itertools.product(*[range(k) for k in sizes]):
        cost = evaluate(problem, choice)
        if cost.peak_memory <= problem.memory_budget and (best is None or cost.step_time < best[0] - 1e-15):
            best = (cost.step_time, choice)
    return best


@pytest.mark.parametrize("budget_fraction", [None, 0.5])
@pytest.mark.parametrize("devices, batch, device", [(2, 4, "h100"), (4, 4096, "h100"), (2, 64, "cpu")])
def test_ilp_optimum_equals_brute_force(budget_fraction, devices, batch, device):
    torch.manual_seed(0)
    mesh = autopar.Mesh({"x": devices}, device=device)
    model, inputs = Tiny(4096 if batch > 64 else 8, 2048 if batch > 64 else 6), (torch.randn(batch, 4096 if batch > 64 else 8),)
    graph, problem = _problem(model, inputs, mesh)
    combos = math.prod(len(n.strategies) for n in problem.nodes)
    if budget_fraction is not None:  # a budget between the leanest and the fattest plan binds
        mems = [evaluate(problem, c).peak_memory for c in itertools.product(*[range(len(n.strategies)) for n in problem.nodes])]
        problem.memory_budget = min(mems) + budget_fraction * (max(mems) - min(mems))
    best_time, _ = _brute_force(problem)
    merged = merge(problem, {n.name: n.op for n in graph.nodes})
    sol = solve(merged.problem)
    choice = merged.expand(sol.choice, len(problem.nodes))
    cost = evaluate(problem, choice)
    assert cost.peak_memory <= problem.memory_budget
    # equal up to the ILP's integer costs (1 ps per term)
    terms = len(problem.nodes) + len(problem.edges)
    assert cost.step_time == pytest.approx(best_time, rel=0, abs=terms * 1e-12), f"{combos} combinations"
    if budget_fraction is not None:  # the budget really binds: the unconstrained optimum is over it
        unbounded = merge(problem, {n.name: n.op for n in graph.nodes})
        unbounded.problem.memory_budget = float("inf")
        free = evaluate(problem, unbounded.expand(solve(unbounded.problem).choice, len(problem.nodes)))
        assert free.step_time <= cost.step_time


def _mlp(d, hidden, batch, layers=1, classes=None):
    from autopar.models import make

    return make("mlp", batch=batch, in_dim=d, hidden_dim=hidden, n_layers=layers, num_classes=classes or d, device="meta")


def test_recipes_are_feasible_points_of_the_merged_ilp():
    model, inputs = autopar.models.make("mlp", batch=64, n_layers=3, device="meta")
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    planned = run_passes(model, mesh, inputs)
    assert planned.recipe_choices
    for name, choice in planned.recipe_choices.items():
        hint = [choice[i] for i in planned.merged.keep]
        as_merged = evaluate(planned.problem, planned.merged.expand(hint, len(planned.problem.nodes)))
        assert as_merged.step_time <= evaluate(planned.problem, choice).step_time * (1 + 1e-9), name
    best = min(b["step_time"] for b in planned.baselines.values() if b.get("fits"))
    assert planned.cost.step_time <= best * (1 + 1e-9)


def test_large_mlp_block_small_batch_gives_megatron_column_then_row():
    # 4096 -> 16384 -> 4096 on 8 devices with 1024 tokens: weight gathers cannot hide under the
    # forward compute, so weights stay split: the first column-parallel, the second row-parallel.
    model, inputs = _mlp(4096, 16384, batch=1024)
    plan = autopar.plan(model, autopar.Mesh({"tp": 8}, device="h100"), inputs)
    # nn.Linear weights are [out, in]: column parallel splits out (dim 0), row parallel in (dim 1)
    assert plan.placements["layers.0.weight"] == "S(0)"
    assert plan.placements["head.weight"] == "S(1)"
    assert not [r for r in plan.reshardings if r["kind"] == "param" and r["time"] > 0]
    assert plan.step_time <= plan.baselines["megatron_tp"]["step_time"]


def test_small_model_large_batch_gives_data_parallel():
    model, inputs = _mlp(1024, 1024, batch=65536, layers=2, classes=8)
    plan = autopar.plan(model, autopar.Mesh({"dp": 8}, device="h100"), inputs)
    assert plan.placements["input:0"] == "S(0)"
    # every forward matmul runs on its batch block (rows), weights whole: data parallelism
    forward_mm = [n for n in plan.nodes if n["phase"] == "forward" and n["op"] in ("aten.addmm.default", "aten.mm.default")]
    assert forward_mm and all(n["tags"] == ["S:m"] for n in forward_mm), [n["tags"] for n in forward_mm]
    assert plan.step_time <= plan.baselines["ddp"]["step_time"]


def test_batch_sweep_switches_from_tensor_to_data_parallel_once():
    # MLP 2048 -> 8192 on 8 H100s: small batches keep the input whole (weights split), large ones
    # split the batch; the switch happens once. (Where, against a closed form: see issue notes.)
    mesh = autopar.Mesh({"x": 8}, device="h100")
    kinds = []
    for batch in (1024, 4096, 16384, 65536):
        model, inputs = _mlp(2048, 8192, batch=batch, classes=8)
        planned = run_passes(model, mesh, inputs, deterministic_time=5)
        node = planned.problem.index[planned.graph.inputs["input:0"]]
        placement = str(planned.problem.nodes[node].strategies[planned.choice[node]][0].outputs[0])
        kinds.append("data" if placement == "S(0)" else "tensor")
    assert kinds[0] == "tensor" and kinds[-1] == "data", kinds
    assert sum(a != b for a, b in zip(kinds, kinds[1:])) == 1, kinds


def test_model_too_large_to_replicate_gets_parameters_sharded():
    model, inputs = _mlp(4096, 4096, batch=64, layers=4)
    n_params = sum(p.numel() for p in model.parameters())
    budget = n_params * 16 // 3  # AdamW mixed precision needs 16 B/param replicated: it cannot fit
    plan = autopar.plan(model, autopar.Mesh({"dp": 8}, device="h100"), inputs, memory_budget=budget)
    assert plan.peak_memory <= budget
    sharded = [p for p, pl in plan.placements.items() if p.endswith("weight") and "S(" in pl]
    assert sharded


def test_memory_budget_too_small_is_a_clear_error():
    model, inputs = _mlp(256, 256, batch=8)
    with pytest.raises(autopar.passes.solve.InfeasibleError, match="no plan fits the memory budget.*needs"):
        autopar.plan(model, autopar.Mesh({"dp": 2}, device="h100"), inputs, memory_budget=1000)


def test_plans_are_deterministic(tmp_path):
    model, inputs = autopar.models.make("gpt", batch=4, n_layer=2, n_embd=32, vocab_size=64, block_size=16)
    mesh = autopar.Mesh({"dp": 2}, device="h100")
    a = autopar.plan(model, mesh, inputs)
    b = autopar.plan(model, mesh, inputs)
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    loaded = autopar.load_plan(tmp_path / "a.json")
    assert loaded.diff(a) == "plans are identical"


def test_hints_are_hard_constraints():
    model, inputs = _mlp(64, 64, batch=64)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    plan = autopar.plan(model, mesh, inputs, hints={"layers.*.weight": "tp=S(1)", "input:0": "S(0), B"})
    assert plan.placements["layers.0.weight"] == "B, S(1)"
    assert plan.placements["input:0"] == "S(0), B"


@pytest.mark.parametrize(
    "hints, match",
    [
        ({"layers.9.nothing": "B, B"}, "no parameter, buffer or input matches"),
        ({"input:3": "B, B"}, "not a tensor input"),
        ({"layers.0.bias": "S(0), S(0)", "_hidden": 3}, "smaller than the number of devices"),
        ({"layers.0.weight": "S(5), B"}, "splits dim 5"),
        ({"layers.0.weight": "S(0)"}, "has 1 entries but the mesh has 2 axes"),
        ({"layers.*.weight": "S(0), B", "layers.0.weight": "S(1), B"}, "contradictory hints"),
    ],
)
def test_bad_hints_are_clear_errors(hints, match):
    hints = dict(hints)
    model, inputs = _mlp(64, hints.pop("_hidden", 64), batch=64)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    with pytest.raises(HintError, match=match):
        autopar.plan(model, mesh, inputs, hints=hints)


@pytest.mark.parametrize("axes, match", [({}, "at least one"), ({"dp": 0}, "size"), ({"dp": 2, "tp": "x"}, "size")])
def test_malformed_mesh_is_a_clear_error(axes, match):
    with pytest.raises(autopar.mesh.MeshError, match=match):
        autopar.Mesh(axes)


def test_plans_are_byte_identical_across_processes(tmp_path):
    """Different hash seeds, separate processes: the same plan file."""
    import os
    import subprocess
    import sys

    script = (
        "import sys, warnings; warnings.simplefilter('ignore')\n"
        "import autopar, autopar.models as M\n"
        "m, i = M.make('mlp', batch=64, n_layers=3, device='meta')\n"
        "autopar.plan(m, autopar.Mesh({'dp': 2, 'tp': 2}, device='h100'), i).save(sys.argv[1])\n"
    )
    outs = []
    for seed in ("1", "2"):
        path = tmp_path / f"plan{seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=600)
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]
