"""The search: the ILP's optimum equals brute force on small graphs, recipes are feasible points of
the folded and merged ILP, the classic strategies are rediscovered, and bad input fails clearly."""

import itertools
import math
import re
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
import autopar.models
from autopar.planner.intra import run_passes
from autopar.planner.options import PlanOptions
from autopar.cost_model.precision import get_precision
from autopar.ir.capture import capture
from autopar.passes.search.build import build_problem
from autopar.passes.search.fold import no_folding
from autopar.passes.search.merge import merge
from autopar.passes.search.problem import evaluate
from autopar.passes.search.solve import solve
from autopar.errors import HintError
from autopar.passes.search.strategies import node_strategies, resolve_hints

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


@pytest.mark.parametrize("batch", [64, 1024])
def test_large_mlp_block_small_batch_gives_megatron_column_then_row(batch):
    """4096 -> 16384 -> 4096 on 8 devices: weight gathers cannot hide under the forward compute of
    so few tokens, so weights stay split: the first column-parallel, the second row-parallel.

    At 64 tokens the block's forward has exactly one collective: the all-reduce of the
    row-parallel output (Partial), done once and shared by every op that reads it (the loss's max
    and subtraction; charged per consumer, two all-reduces would lose to a reduce-scatter and
    gathers). At 1024 tokens a reduce-scatter and an all-gather (the same bytes, one latency more)
    win instead: between them the loss's element-wise ops run on an eighth of the logits
    (Megatron's sequence parallelism)."""
    model, inputs = _mlp(4096, 16384, batch=batch)
    plan = autopar.plan(model, autopar.Mesh({"tp": 8}, device="h100"), inputs)
    # nn.Linear weights are [out, in]: column parallel splits out (dim 0), row parallel in (dim 1)
    assert plan.placements["layers.0.weight"] == "S(0)"
    assert plan.placements["head.weight"] == "S(1)"
    assert not [r for r in plan.reshardings if r["kind"] == "param" and r["time"] > 0]
    assert plan.step_time <= plan.baselines["megatron_tp"]["step_time"]
    if batch == 64:
        forward = {n["name"] for n in plan.nodes if n["phase"] == "forward"} | {"loss"}
        moved = [r for r in plan.reshardings if r["consumer"] in forward and r["time"] > 0]
        assert [s["kind"] for r in moved for s in r["steps"]] == ["all_reduce"], moved
        (ar,) = moved
        assert ar["kind"] == "activation" and ar["from"] == "P" and ar["to"] == "B"
        head_out = next(n for n in plan.nodes if n["module"] == "head" and n["phase"] == "forward" and "P" in n["outputs"])
        assert ar["tensor"] == head_out["name"] and len(ar["consumers"]) >= 2


def test_small_model_large_batch_gives_data_parallel():
    model, inputs = _mlp(1024, 1024, batch=65536, layers=2, classes=8)
    plan = autopar.plan(model, autopar.Mesh({"dp": 8}, device="h100"), inputs)
    assert plan.placements["input:0"] == "S(0)"
    # every forward matmul runs on its batch block (rows), weights whole: data parallelism
    forward_mm = [n for n in plan.nodes if n["phase"] == "forward" and n["op"] in ("aten.addmm.default", "aten.mm.default")]
    assert forward_mm and all(n["tags"] == ["S:m"] for n in forward_mm), [n["tags"] for n in forward_mm]
    assert plan.step_time <= plan.baselines["ddp"]["step_time"]


def _crossover_batch(mesh, d, h, c) -> tuple[float, dict]:
    """The batch at which sharded data parallelism and tensor parallelism cost the same, in closed
    form (alpha-beta links, roofline compute), for Linear(d, h) -> GELU -> Linear(h, c) on n devices.

    Both split the matmul work n ways, so their compute is the same; they differ in communication:

    - tensor parallel (column then row): one all-reduce of the [B, c] logits (bf16), exposed:
          A(B) = AR(2cB) = (2n-1) alpha + 2 (n-1)/n * 2cB / beta
    - data parallel, the first layer's parameters sharded (p in S), the small head replicated
      (p in R, as the search keeps it): an all-gather of each sharded bf16 weight before the
      forward, a reduce-scatter of its fp32 gradient and an all-reduce of each head gradient in
      the backward,
          G_f = sum_S AG(2|p|),   G_b = sum_S RS(4|p|) - (1 - s_p) RS(0) + sum_R AR(4|p|) - (1 - s_p) AR(0),
          AG(x) = RS(x) = n alpha + (n-1)/n * x / beta
      (gradients share buckets, which pay each collective's latency once: a gradient pays its
      share s_p = min(1, 4|p| / bucket size) of it, as ``cost_model.buckets.grad_time`` prices it)
      each hidden under the same phase's compute of the B/n local samples:
          F(B) = kappa_f B/n,  kappa_f = 2dh / (peak * eff_mm) + 3 * 2h / (hbm * eff_mem)
          H(B) = kappa_b B/n,  kappa_b = 2dh / (peak * eff_mm) + 6 * 2h / (hbm * eff_mem)
      (eff_mm the matmul's achieved fraction at its local shape near the crossover, eff_mem the
      best bandwidth fraction; the optimizer step, priced as compute of the forward group, is left
      out: it is the same for both up to the sharded share)
      (per sample: the first matmul's FLOPs, forward or weight gradient, plus the passes over the
      h-wide bf16 hidden activation: GELU in and out and the head's read in the forward; the
      head's two gradient matmuls, GELU's backward (three) and the bias gradient in the backward).
      Exposed: max(0, G_f - F(B)) + max(0, G_b - H(B)).

    With both exposures positive at the crossover, G_f + G_b - (kappa_f + kappa_b) B/n = A(B):

          B* = n (G_f + G_b - A(0)) / (kappa_f + kappa_b + n dA/dB)

    (and with the backward's exposure gone there, from G_f - kappa_f B/n = A(B):
    B* = n (G_f - A(0)) / (kappa_f + n dA/dB)).
    """
    from autopar.cost_model.comm import collective_time

    from autopar.cost_model import efficiency

    hw, link, n = mesh.hardware, mesh.links[0], mesh.shape[0]
    # the matmul's achieved rate depends on its local shape ((B/n) x h outputs, K = d): taken at
    # the crossover's own batch (a fixed point from 12k samples); memory-bound passes over large
    # tensors run at the best bandwidth fraction
    mm = hw.flops("bfloat16") * efficiency.matmul(hw.efficiency, 12288 / n * h, d)
    mem = hw.hbm_bandwidth * hw.efficiency.mem_max
    kf = 2 * d * h / mm + 3 * 2 * h / mem
    kb = 2 * d * h / mm + 6 * 2 * h / mem
    sharded, replicated = [d * h, h], [h * c, c]  # the search keeps the small head replicated
    gf = sum(collective_time("all_gather", 2 * p, n, link) for p in sharded)
    from autopar.cost_model.buckets import BUCKET_SIZE

    def bucketed(kind, nbytes):
        return collective_time(kind, nbytes, n, link) - (1 - min(1.0, nbytes / BUCKET_SIZE)) * collective_time(kind, 0, n, link)

    gb = sum(bucketed("reduce_scatter", 4 * p) for p in sharded) + sum(bucketed("all_reduce", 4 * p) for p in replicated)
    a0 = collective_time("all_reduce", 0, n, link)
    slope = (collective_time("all_reduce", 2 * c * 1e6, n, link) - a0) / 1e6
    b = n * (gf + gb - a0) / (kf + kb + n * slope)
    if gb - kb * b / n <= 0:  # the backward's reductions hide entirely: only the forward's gathers count
        b = n * (gf - a0) / (kf + n * slope)
    return b, {"G_f": gf, "G_b": gb, "A0": a0, "kappa_f": kf, "kappa_b": kb,
               "exposed_f": gf - kf * b / n, "exposed_b": gb - kb * b / n}


def test_batch_sweep_switches_from_tensor_to_data_parallel_once_near_the_closed_form_crossover():
    """MLP 2048 -> 8192 -> 8 on 8 H100s: small batches keep the input whole (weights split), large
    ones split the batch; the switch happens once, within a factor of 2 of ``_crossover_batch``'s
    closed form (about 12.3k samples: G_f 129 us, G_b 164 us, A(0) 60 us, kappa_f 67 ns,
    kappa_b 85 ns; the sweep switches between 5.8k and 8.2k). The search switches somewhat earlier
    than the closed form: its tensor-parallel plan pays a little replicated compute on the
    logits."""
    mesh = autopar.Mesh({"x": 8}, device="h100")
    batches = [int(1024 * 2 ** (k / 2)) // 64 * 64 for k in range(2, 11)]  # 2048 .. 32768, steps of sqrt(2)
    kinds = []
    for batch in batches:
        model, inputs = _mlp(2048, 8192, batch=batch, classes=8)
        planned = run_passes(model, mesh, inputs, options=PlanOptions(deterministic_time=5))
        node = planned.problem.index[planned.graph.inputs["input:0"]]
        placement = str(planned.problem.nodes[node].strategies[planned.choice[node]][0].outputs[0])
        kinds.append("data" if placement == "S(0)" else "tensor")
    assert kinds[0] == "tensor" and kinds[-1] == "data", kinds
    assert sum(a != b for a, b in zip(kinds, kinds[1:])) == 1, kinds
    k = kinds.index("data")
    observed = math.sqrt(batches[k - 1] * batches[k])
    predicted, parts = _crossover_batch(mesh, 2048, 8192, 8)
    assert parts["exposed_f"] > 0, parts  # the closed form's regime
    assert predicted / 2 <= observed <= predicted * 2, (observed, predicted, kinds)


def test_model_too_large_to_replicate_gets_parameters_sharded():
    model, inputs = _mlp(4096, 4096, batch=64, layers=4)
    n_params = sum(p.numel() for p in model.parameters())
    budget = n_params * 16 // 3  # AdamW mixed precision needs 16 B/param replicated: it cannot fit
    plan = autopar.plan(model, autopar.Mesh({"dp": 8}, device="h100"), inputs, memory_budget=budget)
    assert plan.peak_memory <= budget
    sharded = [p for p, pl in plan.placements.items() if p.endswith("weight") and "S(" in pl]
    assert sharded
    assert plan.baselines["ddp"]["fits"] is False  # the premise: replicating does not fit
    # the lean plan: every layer's weight matrix split over the 8 devices (on its rows or its
    # columns); only biases and one matrix (the head: its gathers would be exposed at the end of
    # the forward and the start of the backward) may stay whole within the budget
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    weights = [n for n in sizes if n.startswith("layers.") and n.endswith("weight")]
    assert len(weights) == 4 and set(weights) <= set(sharded)
    assert all(plan.placements[n] in ("S(0)", "S(1)") for n in weights), plan.placements
    whole = [n for n in sizes if plan.placements[n] == "B"]
    assert all(n.endswith("bias") or n == "head.weight" for n in whole), whole
    assert all(plan.placements[n] in ("B", "S(0)") for n in sizes if n.endswith("bias"))
    local = sum(k if plan.placements[n] == "B" else k // 8 for n, k in sizes.items())
    # and the memory the plan reports is that share of parameters, gradients and optimizer state
    for kind, nbytes in (("params", "param_bytes"), ("grads", "grad_bytes"), ("optimizer", "optimizer_bytes")):
        assert plan.memory[kind] == local * plan.precision[nbytes], (kind, plan.memory)


def test_memory_budget_too_small_is_a_clear_error():
    model, inputs = _mlp(256, 256, batch=8)
    with pytest.raises(autopar.errors.InfeasibleError, match="no plan fits the memory budget.*needs") as info:
        autopar.plan(model, autopar.Mesh({"dp": 2}, device="h100"), inputs, memory_budget=1000)
    # the largest tensors by the user's names: parameters by FQN, inputs by input:N, ops by module path: op
    assert re.search(r"largest tensors at their leanest placement: .*layers.0.weight \(", str(info.value))
    assert re.search(r"<root>: sub.Tensor \(", str(info.value)) and not NODE_NAME.search(str(info.value)), str(info.value)


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


#: An internal node name (``primals_3``, ``mm_7``): no message may show one. (A module path may
#: look alike, ``ln_1``: the models' messages checked with it have none.)
NODE_NAME = re.compile(r"\b(primals|tangents)_\d+|\b[a-z]+_\d+\b")
PLACEHOLDER_NAME = re.compile(r"\b(primals|tangents)_\d+")


@pytest.mark.parametrize(
    "hints, match",
    [
        ({"input:0": "S(-3), B"}, r"^hints\['input:0'\]: S\(-3\), B splits dim -3, but input:0 has only 2 dims "
                                  r"\(shape \[64, 64\]\)$"),
        ({"layers.0.weight": "S(5), B"}, r"^hints\['layers.0.weight'\]: S\(5\), B splits dim 5, but layers.0.weight "
                                         r"has shape \[64, 64\]$"),
        ({"layers.*.bias": "S(0), S(0)", "_hidden": 3}, r"^hints\['layers.\*.bias'\]: S\(0\), S\(0\) cannot split "
                                                       r"layers.0.bias of shape \[3\] over mesh"),
        ({"layers.*.weight": "S(0), B", "layers.0.weight": "S(1), B"},
         r"^contradictory hints for layers.0.weight: S\(0\), B \(hints\['layers.\*.weight'\]\) and S\(1\), B"),
    ],
)
def test_hint_errors_name_the_users_tensor(hints, match):
    hints = dict(hints)
    model, inputs = _mlp(64, hints.pop("_hidden", 64), batch=64)
    with pytest.raises(HintError, match=match) as info:
        autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), inputs, hints=hints)
    assert not NODE_NAME.search(str(info.value)), str(info.value)


def test_negative_split_dims_in_hints_count_from_the_end():
    model, inputs = _mlp(64, 64, batch=64)
    plan = autopar.plan(model, autopar.Mesh({"dp": 2, "tp": 2}, device="h100"), inputs,
                        hints={"input:0": "dp=S(-1)", "layers.0.weight": "S(-2), S(-1)"})
    assert plan.placements["input:0"] == "S(1), B"
    assert plan.placements["layers.0.weight"] == "S(0), S(1)"


def test_hint_that_cuts_fused_blocks_unevenly_names_the_parameter():
    model, inputs = autopar.models.make("gpt", batch=6, n_layer=2, n_embd=32, vocab_size=64, block_size=16)
    with pytest.raises(HintError, match=r"^hints\['blocks.0.attn.qkv.weight'\]: blocks.0.attn.qkv.weight cannot be "
                                        r"placed S\(0\): a split would cut its equal blocks unevenly"):
        autopar.plan(model, autopar.Mesh({"tp": 3}, device="h100"), inputs,
                     hints={"blocks.0.attn.qkv.weight": "S(0)"})


def test_recipes_that_conflict_with_a_hint_say_so_in_the_baselines():
    """The README's hint (the batch split on dp only) against recipes that also split it on tp: those
    recipes are not priced, and their baseline says which hint they conflict with."""
    model, inputs = autopar.models.make("gpt", batch=8, n_layer=2, n_embd=32, vocab_size=64, block_size=16)
    mesh = autopar.Mesh({"dp": 2, "tp": 2}, device="h100")
    plan = autopar.plan(model, mesh, inputs, hints={"input:0": "dp=S(0)"}, progress=False)
    assert plan.baselines["ddp"] == {"error": "conflicts with your hint on input:0: ddp places it S(0), S(0), "
                                              "the hint S(0), B"}
    assert plan.baselines["fsdp"] == {"error": "conflicts with your hint on input:0: fsdp places it S(0), S(0), "
                                               "the hint S(0), B"}
    assert plan.baselines["megatron_sp"] == {"error": "conflicts with your hint on input:0: megatron_sp places it "
                                                      "S(0), S(1), the hint S(0), B"}
    for name in ("megatron_tp", "fsdp_tp"):  # these split the batch on dp only: priced as usual
        assert plan.baselines[name]["step_time"] > 0, plan.baselines[name]
    assert "error: conflicts with your hint on input:0: ddp places it S(0), S(0)" in plan.summary()
    assert not PLACEHOLDER_NAME.search(plan.summary())
    with pytest.raises(autopar.errors.RecipeError, match=r"^the ddp recipe conflicts with your hint on input:0: ddp "
                       r"places it S\(0\), S\(0\), the hint S\(0\), B; drop the hint or choose another recipe$"):
        autopar.recipes.ddp(model, mesh, inputs, hints={"input:0": "dp=S(0)"})


@pytest.mark.parametrize("axes, match", [({}, "at least one"), ({"dp": 0}, "size"), ({"dp": 2, "tp": "x"}, "size")])
def test_malformed_mesh_is_a_clear_error(axes, match):
    with pytest.raises(autopar.errors.MeshError, match=match):
        autopar.Mesh(axes)


@pytest.mark.gloo
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
        subprocess.run([sys.executable, "-c", script, str(path)], check=True, env=env, timeout=180)  # 52 s under load
        outs.append(path.read_bytes())
    assert outs[0] == outs[1]
