"""The public API's arguments are checked up front (``autopar.validate``): each bad argument of
``plan``, ``compile``, ``simulate``, ``launch``, the recipes, ``Mesh``, ``hint`` and ``load_plan``
gets one ``ArgumentError`` line naming it, before any capture or planning. Sizes read as the CLI
reads them."""

from __future__ import annotations

import math
import pathlib
import warnings

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.errors import ArgumentError, AutoparError, MeshError
from autopar.validate import parse_size

warnings.simplefilter("ignore")


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return self.fc(x).sum()


def make_lin():
    return Lin()


MODEL, INPUTS = Lin(), (torch.randn(8, 16),)
MESH = autopar.Mesh({"dp": 2}, device="cpu")

PLAN_CASES = {
    "negative budget": (dict(memory_budget=-1), r"^autopar.plan: memory_budget must be a positive size such as "
                        r"60GiB, 80GB or 6e10 \(bytes\), got -1$"),
    "zero budget": (dict(memory_budget=0), r"^autopar.plan: memory_budget must be a positive size .*, got 0$"),
    "budget under a byte": (dict(memory_budget=0.5), r"^autopar.plan: memory_budget .*, got 0.5$"),
    "NaN budget": (dict(memory_budget=math.nan), r"^autopar.plan: memory_budget must be a positive size .*, got nan$"),
    "unreadable budget": (dict(memory_budget="lots"), r"^autopar.plan: memory_budget must be a positive size .*, "
                          r"got 'lots'$"),
    "negative size text": (dict(memory_budget="-60GiB"), r"^autopar.plan: memory_budget .*, got '-60GiB'$"),
    "budget of a bool": (dict(memory_budget=True), r"^autopar.plan: memory_budget .*, got True$"),
    "int hint": (dict(hints={"fc.weight": 3}), r"^autopar.plan: hints\['fc.weight'\] must be a placement such as "
                 r"'dp=S\(0\)' or 'S\(0\), B' \(or a list of placements, one per mesh axis\), got 3$"),
    "hints as a list": (dict(hints=[("fc.weight", "S(0)")]), r"^autopar.plan: hints must be a dict of name -> "
                        r"placement, e.g. \{'input:0': 'dp=S\(0\)'\}, got \[\('fc.weight', 'S\(0\)'\)\] \(a list\)$"),
    "hint key not a name": (dict(hints={0: "S(0)"}), r"^autopar.plan: hints: key 0 is not a name"),
    "misspelt keyword": (dict(memory_budgt=3), r"^autopar.plan got an unknown keyword argument 'memory_budgt'; "
                         r"did you mean 'memory_budget'\?$"),
    "unknown precision": (dict(precision="fp8"), r"^autopar.plan: unknown precision 'fp8': choose one of \["),
    "unknown optimizer": (dict(optimizer="lion"), r"^autopar.plan: unknown optimizer 'lion': choose one of \["),
    "negative time limit": (dict(time_limit=-3), r"^autopar.plan: time_limit \(seconds\) must be a positive number "
                            r"or None, got -3$"),
    "training not a bool": (dict(training="yes"), r"^autopar.plan: training must be True or False, got 'yes'$"),
    "unknown tensor axis": (dict(tensor_axis="tp"), r"^autopar.plan: tensor_axis: the mesh has no axis 'tp'; its axes "
                            r"are \['dp'\]$"),
    "unknown search": (dict(search="greedy"), r"^autopar.plan: search='greedy': choose 'ilp'"),
    "unknown recipe": (dict(recipe="zero3"), r"^autopar.plan: recipe must be one of 'ddp', 'fsdp', 'megatron_tp', "
                       r"'megatron_sp', 'fsdp_tp', got 'zero3'$"),
    "kwargs not a dict": (dict(example_kwargs=[1]), r"^autopar.plan: example_kwargs must be a dict of keyword name -> "
                          r"value \(or None\), got \[1\] \(a list\)$"),
}


@pytest.mark.parametrize("case", PLAN_CASES)
def test_bad_plan_arguments_are_one_line_errors(case):
    kw, match = PLAN_CASES[case]
    with pytest.raises(ArgumentError, match=match) as info:
        autopar.plan(MODEL, MESH, INPUTS, **kw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model, match", [
    (make_lin, r"got the function 'make_lin': pass the module itself \(call the function that builds it\)$"),
    (Lin, r"got the class 'Lin': pass an instance, e.g. Lin\(...\)$"),
    ((MODEL, INPUTS), r"got a tuple: a factory's \(model, inputs\) pair\? pass the model and the inputs as two "
                      r"arguments$"),
    ("gpt", r"got 'gpt'$"),
])
def test_a_model_that_is_not_a_module_is_named(model, match):
    with pytest.raises(ArgumentError, match=r"^autopar.plan: model must be a torch.nn.Module, " + match):
        autopar.plan(model, MESH, INPUTS)
    with pytest.raises(ArgumentError, match=r"^autopar.compile: model must be a torch.nn.Module, " + match):
        autopar.compile(model, MESH, INPUTS)  # before any process group is needed
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: model must be a torch.nn.Module, " + match):
        autopar.simulate(model, "plan.json", INPUTS)
    with pytest.raises(ArgumentError, match=r"^autopar.recipes.ddp: model must be a torch.nn.Module, " + match):
        autopar.recipes.ddp(model, MESH, INPUTS)


def test_a_mesh_that_is_not_a_mesh_says_how_to_build_one():
    with pytest.raises(ArgumentError, match=r"^mesh must be an autopar.Mesh, got dict: build one, e.g. "
                                            r"autopar.Mesh\(\{'dp': 2, 'tp': 4\}, device='h100'\)$"):
        autopar.plan(MODEL, {"dp": 2}, INPUTS)


def test_budget_text_is_read_as_the_cli_reads_it():
    from autopar.cli.args import parse_bytes

    for text in ("60GiB", "80GB", "6e10", "2 M", "1.5e3", "512k"):
        assert parse_size(text) == parse_bytes(text)
    assert parse_size("60GiB") == 60 * 2**30 and parse_size(2.5e9) == 2.5e9
    assert parse_size(math.inf, allow_inf=True) == math.inf
    with pytest.raises(ArgumentError, match=r"^budget must be a positive size .*, got inf$"):
        parse_size(math.inf, "budget")
    with pytest.raises(ArgumentError, match=r"^expected a positive size such as 60GiB, 80GB or 6e10 \(bytes\), "
                                            r"got '1e400'$"):
        parse_size("1e400")  # no OverflowError from int(inf)
    plan = autopar.plan(MODEL, MESH, INPUTS, memory_budget="1GiB", progress=False)
    assert plan.memory_budget == 2**30  # as the CLI's --memory-budget 1GiB


def test_a_budget_over_the_device_memory_is_refused_naming_both():
    """A budget above the device's memory would let a plan "fit" that the device cannot hold: it is
    refused in ``plan``, the recipes and ``compile``, naming the budget and the device's memory; the
    device's whole memory and no limit (inf) stay budgets."""
    h100 = autopar.Mesh({"dp": 2}, device="h100")
    with pytest.raises(ArgumentError, match=r"^autopar.plan: memory_budget 200 GiB is more than the 74.5 GiB of one "
                                            r"h100 device; give at most 74.5 GiB"):
        autopar.plan(MODEL, h100, INPUTS, memory_budget="200GiB")
    with pytest.raises(ArgumentError, match=r"^autopar.recipes.fsdp: memory_budget 60.0 GiB is more than the 7.45 GiB "
                                            r"of one cpu device"):
        autopar.recipes.fsdp(MODEL, MESH, INPUTS, memory_budget="60GiB")
    with pytest.raises(ArgumentError, match=r"^autopar.compile: memory_budget 8.38 GiB is more than the 7.45 GiB"):
        autopar.compile(MODEL, MESH, INPUTS, memory_budget=9 * 10**9)
    with pytest.raises(ArgumentError, match=r"^autopar.plan: memory_budget 1.00 TiB is more than the 74.5 GiB"):
        autopar.plan(MODEL, autopar.Mesh.devices(4, device="h100"), INPUTS, memory_budget="1TiB")
    assert autopar.plan(MODEL, MESH, INPUTS, memory_budget=8 * 10**9, progress=False).memory_budget == 8 * 10**9
    assert autopar.plan(MODEL, MESH, INPUTS, memory_budget=math.inf, progress=False).memory_budget == 0  # no limit


def test_recipes_check_their_arguments():
    with pytest.raises(ArgumentError, match=r"^autopar.recipes.fsdp: memory_budget must be a positive size .*, "
                                            r"got -5$"):
        autopar.recipes.fsdp(MODEL, MESH, INPUTS, memory_budget=-5)
    with pytest.raises(ArgumentError, match=r"^autopar.recipes.ddp takes no recipe= \(it is the ddp recipe\); call "
                                            r"autopar.plan\(..., recipe=...\) for another$"):
        autopar.recipes.ddp(MODEL, MESH, INPUTS, recipe="fsdp")
    with pytest.raises(ArgumentError, match=r"^autopar.recipes.megatron_tp: tensor_axis: the mesh has no axis 'tp'"):
        autopar.recipes.megatron_tp(MODEL, MESH, INPUTS, tensor_axis="tp")


def test_compile_checks_every_argument_before_the_process_group():
    with pytest.raises(ArgumentError, match=r"^autopar.compile: precision must be one of 'plan', .*got 'fp8'$"):
        autopar.compile(MODEL, MESH, INPUTS, precision="fp8")
    with pytest.raises(ArgumentError, match=r"^autopar.compile: plan \(a Plan, a saved plan's path, or None\) must be "
                                            r"a file path \(a str or pathlib.Path\), got 3$"):
        autopar.compile(MODEL, MESH, INPUTS, plan=3)
    with pytest.raises(ArgumentError, match=r"^autopar.compile: memory_budget must be a positive size .*, got -1$"):
        autopar.compile(MODEL, MESH, INPUTS, memory_budget=-1)
    with pytest.raises(ArgumentError, match=r"^autopar.compile got an unknown keyword argument 'hint'; did you mean "
                                            r"'hints'\?$"):
        autopar.compile(MODEL, MESH, INPUTS, hint={"input:0": "S(0)"})


def test_simulate_launch_hint_and_load_plan_check_their_arguments(tmp_path):
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: precision must be one of 'model', 'plan', "
                                            r"got 'bf16'$"):
        autopar.simulate(MODEL, "plan.json", INPUTS, precision="bf16")
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: trace must be a dict to fill \(or None\), got list$"):
        autopar.simulate(MODEL, "plan.json", INPUTS, trace=[])
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: predicted must be a dict to fill \(or None\), got list$"):
        autopar.simulate(MODEL, "plan.json", INPUTS, predicted=[])
    with pytest.raises(ArgumentError, match=r"^autopar.launch: fn must be a function, got 3$"):
        autopar.launch(3, 2)
    with pytest.raises(ArgumentError, match=r"^autopar.launch: nprocs \(the number of ranks\) must be a positive "
                                            r"integer, got 0$"):
        autopar.launch(print, 0)
    with pytest.raises(ArgumentError, match=r"^autopar.launch: nprocs \(the number of ranks\) .*, got 2.0$"):
        autopar.launch(print, 2.0)
    with pytest.raises(ArgumentError, match=r"^autopar.launch: timeout \(seconds\) must be a positive number "
                                            r"or None, got -1$"):
        autopar.launch(print, 2, timeout=-1)
    with pytest.raises(ArgumentError, match=r"^autopar.hint expects a tensor, got int: hint a tensor of forward, "
                                            r"x = autopar.hint\(x, 'dp=S\(0\)'\)$"):
        autopar.hint(3, "S(0)")
    with pytest.raises(ArgumentError, match=r"^load_plan: path must be a file path \(a str or pathlib.Path\), "
                                            r"got 3$"):
        autopar.load_plan(3)
    with pytest.raises(ArgumentError, match=r"^load_plan: path must be a file path .*, got ''$"):
        autopar.load_plan("")
    with pytest.raises(autopar.PlanError, match="no plan file at"):  # a path is fine: the file's own checks follow
        autopar.load_plan(pathlib.Path(tmp_path) / "none.json")


def test_simulate_takes_the_plans_graph_and_checks_it():
    """``simulate(..., graph=)`` skips the capture (the corpus parity tests share one per model): the
    same loss and gradients as its own capture; a graph of the wrong kind is refused by name."""
    from autopar.ir.capture import capture

    torch.manual_seed(0)
    model, x = Lin(), (torch.randn(8, 16),)
    graph = capture(model, x, {})
    plan = autopar.plan(model, MESH, x, graph=graph, search="propagate", progress=False)
    loss, grads = autopar.simulate(model, plan, x)
    loss_g, grads_g = autopar.simulate(model, plan, x, graph=graph)
    assert torch.equal(loss, loss_g) and grads.keys() == grads_g.keys()
    assert all(torch.equal(grads[k], grads_g[k]) for k in grads)
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: graph must be a Graph from "
                                            r"autopar.ir.capture.capture, got str$"):
        autopar.simulate(model, plan, x, graph="g")
    with pytest.raises(ArgumentError, match=r"^autopar.simulate: graph was captured with training=False, the "
                                            r"plan has training=True"):
        autopar.simulate(model, plan, x, graph=capture(model, x, {}, training=False))


def test_argument_errors_are_autopar_errors_and_the_builtin_kinds_they_replaced():
    """Callers that caught ``TypeError`` (a non-mesh) or ``ValueError`` (an unknown search) still do."""
    for kind in (AutoparError, TypeError, ValueError):
        with pytest.raises(kind):
            autopar.plan(MODEL, {"dp": 2}, INPUTS)
        with pytest.raises(kind):
            autopar.plan(MODEL, MESH, INPUTS, search="greedy")


def test_mesh_arguments():
    """A list of sizes is a documented form (axes dim0, dim1, ...); a list of names is not."""
    m = autopar.Mesh([2, 2], device="cpu")
    assert m.axes == {"dim0": 2, "dim1": 2}
    with pytest.raises(MeshError, match=r"^Mesh axes given as a list are sizes \(named dim0, dim1, ...\), got "
                                        r"\['dp', 'tp'\]: for named axes pass a dict, "
                                        r"e.g. Mesh\(\{'dp': 2, 'tp': 4\}\)$"):
        autopar.Mesh(["dp", "tp"])
    assert autopar.Mesh({"dp": 2}, memory="80GiB").hardware.memory == 80 * 2**30
    with pytest.raises(MeshError, match=r"^Mesh: memory \(bytes per device\) must be a positive size such as 60GiB, "
                                        r"80GB or 6e10 \(bytes\), got '-80GiB'$"):
        autopar.Mesh({"dp": 2}, memory="-80GiB")
    with pytest.raises(MeshError, match=r"^Mesh: device must be a preset name such as 'h100' or 'cpu' \(or a "
                                        r"Hardware\), got int$"):
        autopar.Mesh({"dp": 2}, device=3)
    with pytest.raises(MeshError, match=r"^Mesh: profile must be a file path .*, got 3$"):
        autopar.Mesh({"dp": 2}, device="cpu", profile=3)


def test_numbers_too_large_for_a_float_are_argument_errors():
    assert parse_size(10 ** 400, allow_inf=True) == math.inf  # no limit, as inf is; not an OverflowError
    with pytest.raises(ArgumentError, match=r"^expected a positive size"):
        parse_size(10 ** 400)
    with pytest.raises(ArgumentError, match=r"^autopar.plan: time_limit \(seconds\) must be a positive number or None, got an int$"):
        autopar.plan(MODEL, MESH, INPUTS, time_limit=10 ** 400)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "10", -1])
def test_launch_checks_its_collective_timeout(bad):
    with pytest.raises(ArgumentError, match=r"^autopar.launch: collective_timeout \(seconds\) must be a positive number "
                                            r"or None, got "):
        autopar.launch(make_lin, 2, collective_timeout=bad)
