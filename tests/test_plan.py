"""Plan: persistence (canonical bytes, schema checks), rendering (summary, explain, diff) and the
stale-graph check, on a small hand-built plan (no model, no solve)."""

from __future__ import annotations

import copy
import json

import pytest

from autopar.errors import AutoparError
from autopar.plans import SCHEMA_VERSION, Plan, PlanError, human_bytes, human_time, load_plan

MIB = 1 << 20

MESH = {
    "axes": {"tp": 4, "dp": 2},  # deliberately not alphabetical: the order must survive sorted JSON
    "device": "h100",
    "hardware": {"name": "h100", "peak_flops": {"bfloat16": 9.89e14, "float32": 6.7e13}, "hbm_bandwidth": 3.35e12,
                 "memory": 80_000_000_000, "intra_node": {"latency": 3e-6, "bandwidth": 4.5e11},
                 "inter_node": {"latency": 1e-5, "bandwidth": 5e10}, "devices_per_node": 8,
                 "nics_per_node": 8, "matmul_efficiency": 0.7, "memory_efficiency": 0.8, "launch_floor": 5e-6,
                 "flash_attention": True, "default_precision": "bf16-mixed"},
    "links": {"tp": {"latency": 3e-6, "bandwidth": 4.5e11}, "dp": {"latency": 1e-5, "bandwidth": 5e10}},
}


def _node(name, op, module, phase, strategy, inputs, outputs, compute, tags=("", "")):
    return {"name": name, "op": op, "module": module, "phase": phase, "strategy": list(strategy),
            "tags": list(tags), "inputs": list(inputs), "outputs": list(outputs), "compute": compute}


def make_plan(**changes) -> Plan:
    graph = {"nodes": 14, "ops": 9, "params": 3, "fqns": ["embed.weight", "mlp.fc1.weight", "mlp.fc2.weight"],
             "inputs": {"input:0": "int64[8, 128]"}, "ops_hist": {"aten.embedding": 1, "aten.mm": 6, "aten.gelu": 2}}
    nodes = [
        _node("embedding", "aten.embedding", "embed", "forward", ["(B, S(0)) -> (S(0))", "(S(0), B) -> (S(0))"],
              ["B, S(0)", "S(0), B"], ["S(0), S(0)"], 2.1e-5, tags=("vocab-parallel", "batch")),
        _node("mm", "aten.mm", "mlp.fc1", "forward", ["(B, S(1)) -> (S(1))", "(S(0), B) -> (S(0))"],
              ["S(0), B", "B, S(1)"], ["S(0), S(1)"], 1.234e-4, tags=("column", "batch")),
        _node("gelu", "aten.gelu", "mlp", "forward", ["(S(1)) -> (S(1))", "(S(0)) -> (S(0))"],
              ["S(0), S(1)"], ["S(0), S(1)"], 8.5e-6),
        _node("mm_1", "aten.mm", "mlp.fc2", "forward", ["(S(1), S(0)) -> (P)", "(S(0), B) -> (S(0))"],
              ["S(0), S(1)", "B, S(0)"], ["S(0), P"], 1.19e-4, tags=("row", "batch")),
        _node("mm_2", "aten.mm", "mlp.fc2", "backward", ["(S(1), S(0)) -> (P)", "(S(0), B) -> (P)"],
              ["S(0), S(1)", "S(0), B"], ["P, S(0)", None], 1.2e-4),
    ]
    reshardings = [
        {"tensor": "embedding[0]", "consumer": "mm", "consumers": ["mm"], "kind": "activation", "from": "S(0), S(0)", "to": "S(0), B",
         "bytes": 2 * MIB, "time": 1.7e-5, "module": "mlp.fc1",
         "steps": [{"kind": "all_gather", "axis": "tp", "bytes": 2 * MIB, "time": 1.7e-5}]},
        {"tensor": "mm_1[0]", "consumer": "loss", "consumers": ["loss"], "kind": "activation", "from": "S(0), P", "to": "S(0), B",
         "bytes": 4 * MIB, "time": 2.5e-5, "module": "mlp.fc2",
         "steps": [{"kind": "all_reduce", "axis": "tp", "bytes": 4 * MIB, "time": 2.5e-5}]},
        {"tensor": "mm_2[0]", "consumer": "param:mlp.fc2.weight", "consumers": ["param:mlp.fc2.weight"], "kind": "grad", "from": "P, S(0)", "to": "B, S(0)",
         "bytes": 8 * MIB, "time": 3.1e-4, "module": "mlp.fc2",
         "steps": [{"kind": "all_reduce", "axis": "dp", "bytes": 8 * MIB, "time": 3.1e-4}]},
    ]
    modules = [
        {"path": "embed", "time": 2.1e-5, "comm": 0.0, "bytes": 0, "memory": 48 * MIB,
         "placements": {"embed.weight": "B, S(0)"},
         "alternatives": [{"name": "replicate", "time": 2.1e-5, "comm": 1.1e-4, "delta": 1.1e-4}]},
        {"path": "mlp.fc1", "time": 1.234e-4, "comm": 1.7e-5, "bytes": 2 * MIB, "memory": 40 * MIB,
         "placements": {"mlp.fc1.weight": "B, S(1)"},
         "alternatives": [{"name": "shard dim 0 on tp", "time": 1.234e-4, "comm": 6e-5, "delta": 4.3e-5}]},
        {"path": "mlp", "time": 8.5e-6, "comm": 0.0, "bytes": 0, "memory": 4 * MIB, "placements": {},
         "alternatives": []},
        {"path": "mlp.fc2", "time": 2.39e-4, "comm": 3.35e-4, "bytes": 12 * MIB, "memory": 40 * MIB,
         "placements": {"mlp.fc2.weight": "B, S(0)"},
         "alternatives": [{"name": "replicate", "time": 2.39e-4, "comm": 4.0e-4, "delta": 6.5e-5},
                          {"name": "fsdp", "time": 2.39e-4, "comm": 5.1e-4, "delta": 1.75e-4}]},
    ]
    kw = dict(
        fingerprint={"graph": "a" * 64, "mesh": "b" * 64, "hardware": "c" * 64},
        mesh=copy.deepcopy(MESH),
        precision={"name": "bf16-mixed", "compute_bytes": 2, "compute_dtype": "bfloat16", "param_bytes": 4,
                   "grad_bytes": 4, "gather_bytes": 2, "optimizer": "adamw", "optimizer_bytes": 4},
        training=True, memory_budget=80_000_000_000,
        step_time=1 / 1500, compute_time=3.915e-4, comm_time=0.1 + 0.2 - 0.3 + 2.75e-4,
        peak_memory=132 * MIB, memory={"params": 24 * MIB, "grads": 24 * MIB, "optimizer": 48 * MIB, "activations": 36 * MIB},
        placements={"embed.weight": "B, S(0)", "mlp.fc1.weight": "B, S(1)", "mlp.fc2.weight": "B, S(0)",
                    "input:0": "B, S(0)"},
        nodes=nodes, reshardings=reshardings,
        collectives=[{"kind": "all_reduce", "axis": "dp", "bytes": 25 * MIB, "count": 1, "phase": "backward", "bucketed": True},
                     {"kind": "all_gather", "axis": "tp", "bytes": 2 * MIB, "count": 2, "phase": "forward", "bucketed": False}],
        bucket_size=25 * MIB,
        baselines={"ddp": {"step_time": 9.9e-4, "peak_memory": 300 * MIB, "fits": True},
                   "fsdp": {"step_time": 1.2e-3, "peak_memory": 90 * MIB, "fits": True},
                   "tp": {"error": "mlp.fc1: hidden size 30 is not divisible by tp=4"}},
        solver={"solver": "cp-sat", "variables": 1234, "constraints": 5678, "status": "OPTIMAL", "gap": 0.0,
                "wall_time": 0.4213, "deterministic_time": 0.081},
        source="search", modules=modules,
        phases={"capture": 0.52, "fold": 0.01, "strategies": 0.2, "cost": 0.3, "merge": 0.02, "solve": 0.42, "total": 1.47},
        graph=graph,
    )
    kw.update(changes)
    return Plan(**kw)


def test_properties():
    p = make_plan()
    assert p.axis_names == ("tp", "dp") and p.mesh_shape == (4, 2)
    assert p.fits and not make_plan(peak_memory=10**12).fits
    assert issubclass(PlanError, AutoparError) and issubclass(PlanError, ValueError)


def test_dict_round_trip():
    p = make_plan()
    d = p.to_dict()
    assert "phases" not in d and d["timing"]["phases"] == p.phases and "wall_time" not in d["solver"]
    assert Plan.from_dict(d) == p
    assert Plan.from_dict(json.loads(json.dumps(d))) == p
    q = Plan.from_dict(d)
    q.nodes[0]["name"] = "changed"  # from_dict copies: the source dict is untouched
    assert d["nodes"][0]["name"] == "embedding"
    untimed = Plan.from_dict(p.to_dict(timing=False))
    assert untimed.phases == {} and "wall_time" not in untimed.solver


def test_save_is_canonical(tmp_path):
    p = make_plan()
    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    p.save(a)
    p.save(b)
    assert a.read_bytes() == b.read_bytes()
    # another run: other wall times, floats off in the last bits, dicts built in another order
    other = make_plan(phases={"total": 9.9, "solve": 7.0}, solver={**p.solver, "wall_time": 3.3},
                      step_time=p.step_time * (1 + 1e-15),
                      placements=dict(reversed(list(p.placements.items()))))
    other.save(c)
    assert c.read_bytes() == a.read_bytes()
    text = a.read_text()
    assert '"timing"' not in text and "wall_time" not in text
    # timing=True keeps the wall times, and a load gives the same plan back
    p.save(c, timing=True)
    assert '"timing"' in c.read_text() and load_plan(c) == Plan.from_dict(json.loads(p.to_json(timing=True)))
    loaded = load_plan(a)
    assert loaded.axis_names == ("tp", "dp") and loaded.mesh_shape == (4, 2)
    assert list(loaded.mesh["links"]) == ["tp", "dp"]
    assert loaded.placements == p.placements and loaded.nodes == p.nodes
    assert abs(loaded.comm_time - p.comm_time) < 1e-15
    loaded.save(b)  # load -> save is a fixed point
    assert b.read_bytes() == a.read_bytes()


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="no plan file"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="invalid JSON at line 1"):
        load_plan(bad)
    d = json.loads(make_plan().to_json())
    d["schema_version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match=f"version 99 found.*reads version {SCHEMA_VERSION}"):
        load_plan(bad)
    del d["schema_version"]
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="no 'schema_version'"):
        load_plan(bad)
    d = json.loads(make_plan().to_json())
    del d["nodes"], d["bucket_size"]
    with pytest.raises(PlanError, match="lacks the field.*nodes.*bucket_size|lacks the field.*bucket_size.*nodes"):
        Plan.from_dict(d)
    d = json.loads(make_plan().to_json())
    d["training"] = "yes"
    with pytest.raises(PlanError, match="'training' should be bool"):
        Plan.from_dict(d)
    with pytest.raises(PlanError, match="JSON object"):
        Plan.from_dict([1, 2])


def test_unstorable_value_is_named():
    p = make_plan(solver={"status": object()})
    with pytest.raises(PlanError, match=r"plan\['solver'\]\['status'\]"):
        p.to_json()


def test_human_units():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(int(1.5 * 2**30)) == "1.50 GiB"
    assert human_bytes(-3 * MIB) == "-3.00 MiB"
    assert human_time(0.0123) == "12.3 ms"
    assert human_time(85e-6) == "85 us"
    assert human_time(0.9997e-3) == "1 ms"
    assert human_time(2.5) == "2.5 s" and human_time(0) == "0 s" and human_time(-2e-3) == "-2 ms"


def test_summary():
    p = make_plan()
    s = p.summary()
    assert all(len(line) <= 120 for line in s.splitlines()), s
    assert "dp" in s and "tp=4" in s and "bf16-mixed" in s
    row = next(line for line in s.splitlines() if line.startswith("mlp.fc2 "))
    assert "weight: B,S(0)" in row and "0.239" in row and "0.335" in row and "12.0 MiB" in row
    assert any(line.startswith("embed ") for line in s.splitlines())
    assert any(line.startswith("total ") for line in s.splitlines())
    assert "input:0 B, S(0)" in s
    assert "step time 667 us" in s and "compute 392 us" in s
    assert "peak memory 132 MiB of 74.5 GiB per device (fits)" in s
    assert "params 24.0 MiB" in s and "activations 36.0 MiB" in s
    assert "source search" in s
    assert "ddp" in s and "990 us" in s and "1.49x" in s and "error: mlp.fc1: hidden size 30" in s
    assert "status OPTIMAL" in s and "1,234 variables" in s and "5,678 constraints" in s
    assert "planning: capture 520 ms" in s


def test_summary_truncates_long_module_lists():
    mods = [{"path": f"layers.{i}.mlp.some_long_submodule_name.fc{i}", "time": 1e-5, "comm": 0.0, "bytes": 0, "memory": 0,
             "placements": {f"layers.{i}.mlp.w{j}": "S(0), B" for j in range(12)}, "alternatives": []} for i in range(70)]
    p = make_plan(modules=mods)
    s = p.summary()
    assert "... 10 more modules" in s and "layers.69." not in s
    full = p.summary(full=True)
    assert "more modules" not in full and "fc69" in full
    assert all(len(line) <= 120 for line in full.splitlines())


def test_explain_module():
    """Ops, tensors and consumers by user names: ``module: op`` (``(backward)`` for a backward op), a parameter's
    FQN, the gradient of a parameter, the loss; never a captured graph's node name (``mm_1``, ``embedding[0]``)."""
    p = make_plan()
    e = p.explain("mlp")
    for name in ("mlp.fc1: mm", "mlp: gelu", "mlp.fc2: mm", "mlp.fc2: mm (backward)"):
        assert f"  {name}  (aten." in e
    assert "embed: embedding  (aten." not in e
    assert "tp: (B, S(1)) -> (S(1))  [column]" in e and "dp: (S(0), B) -> (S(0))" in e
    assert "compute 123 us" in e
    # mm's incoming resharding: from -> to, collective, bytes, time
    assert "<- activation embed: embedding: S(0), S(0) -> S(0), B, 2.00 MiB tensor, 17 us" in e
    assert "all_gather on tp 2.00 MiB 17 us" in e
    assert "<- grad of mlp.fc2.weight: P, S(0) -> B, S(0)" in e and "all_reduce on dp 8.00 MiB" in e
    assert "<- activation mlp.fc2: mm for the loss: S(0), P -> S(0), B" in e
    assert "alternatives for mlp.fc2" in e and "replicate" in e and "+65 us" in e and "fsdp" in e
    assert "alternatives for mlp.fc1" in e and "shard dim 0 on tp" in e
    for internal in ("mm_1", "mm_2", "embedding[0]", "param:"):
        assert internal not in e, internal
    only = p.explain("mlp.fc1")
    assert "  mlp.fc1: mm  (aten.mm)" in only and "mlp.fc2: mm" not in only and "gelu" not in only


def test_explain_parameter():
    e = make_plan().explain("mlp.fc2.weight")
    assert e.startswith("parameter mlp.fc2.weight: B, S(0) over (tp, dp), in module mlp.fc2")
    assert "  mlp.fc2: mm  (aten.mm)" in e and "mlp.fc1: mm" not in e
    assert "<- grad of mlp.fc2.weight: P, S(0) -> B, S(0)" in e


def test_explain_names_parameters_and_inputs_by_their_placement_and_size():
    """A resharding of a parameter or input (a graph placeholder in the plan) is named by the parameter's FQN or
    the input's name, found from its placement, bytes and module; alike candidates are all named, never guessed."""
    from autopar.plans.names import namer

    p = make_plan()
    p.graph["shapes"] = {"embed.weight": "float32[1000, 64]", "mlp.fc1.weight": "float32[64, 256]",
                         "mlp.fc2.weight": "float32[256, 64]"}
    name = namer(p)
    assert name("primals_2", {"kind": "param", "from": "B, S(1)", "bytes": 64 * 256 * 2, "module": "mlp.fc1"}) == \
        "mlp.fc1.weight"
    p.placements["mlp.fc2.weight"] = "B, S(1)"
    assert name("primals_2", {"kind": "param", "from": "B, S(1)", "bytes": 64 * 256 * 4, "module": "mlp.fc1"}) == \
        "mlp.fc1.weight or mlp.fc2.weight"
    assert name("primals_9", {"kind": "activation", "from": "B, S(0)", "bytes": 8 * 128 * 8}) == "input:0"
    assert name("mm_1[0]") == "mlp.fc2: mm" and name("mm_2[1]") == "mlp.fc2: mm (backward) output 1"


def test_explain_unknown_suggests():
    p = make_plan()
    with pytest.raises(PlanError, match="no module or parameter 'mlp.fc3'.*did you mean.*mlp.fc2"):
        p.explain("mlp.fc3")
    with pytest.raises(PlanError, match="did you mean.*embed"):
        p.explain("embd")
    with pytest.raises(PlanError, match="modules in this plan: embed"):
        p.explain("zzzzzz")


def test_diff():
    p = make_plan()
    assert p.diff(make_plan(phases={"total": 5.0})) == "plans are identical"
    assert p.diff(load_plan_roundtrip(p)) == "plans are identical"
    q = make_plan(placements={**p.placements, "mlp.fc1.weight": "S(0), B"}, step_time=2e-3, source="recipe:fsdp",
                  peak_memory=200 * MIB, memory={**p.memory, "activations": 104 * MIB},
                  precision={**p.precision, "name": "fp32"})
    d = p.diff(q)
    assert "mlp.fc1.weight  B, S(1) -> S(0), B" in d
    assert "embed.weight" not in d
    assert "source: search -> recipe:fsdp" in d
    assert "step time: 667 us -> 2 ms (+1.33 ms, +200.0%)" in d
    assert "peak memory: 132 MiB -> 200 MiB (+68.0 MiB" in d and "memory activations" in d
    assert "precision: name bf16-mixed -> fp32" in d
    other_mesh = copy.deepcopy(MESH)
    other_mesh["axes"] = {"dp": 8}
    assert "mesh: tp=4 x dp=2 (h100) -> dp=8 (h100)" in p.diff(make_plan(mesh=other_mesh))


def load_plan_roundtrip(p: Plan) -> Plan:
    return Plan.from_dict(json.loads(p.to_json()))


def test_check_graph():
    p = make_plan()
    p.check_graph("a" * 64, {})  # same fingerprint: nothing to check
    now = copy.deepcopy(p.graph)
    now["fqns"] = ["embed.weight", "mlp.fc1.weight", "mlp.fc3.weight", "mlp.fc1.bias"]
    now["inputs"] = {"input:0": "int64[16, 128]"}
    now["nodes"], now["params"] = 17, 4
    now["ops_hist"] = {"aten.embedding": 1, "aten.mm": 7, "aten.gelu": 2, "aten.add": 1}
    with pytest.raises(PlanError) as e:
        p.check_graph("d" * 64, now)
    msg = str(e.value)
    assert "another graph" in msg and "autopar.plan(" in msg
    assert "parameters added: mlp.fc1.bias, mlp.fc3.weight" in msg
    assert "parameters removed: mlp.fc2.weight" in msg
    assert "input input:0: int64[8, 128] -> int64[16, 128]" in msg
    assert "nodes: 14 -> 17" in msg and "aten.add 0 -> 1" in msg and "aten.mm 6 -> 7" in msg
    with pytest.raises(PlanError, match="attributes or connections"):
        p.check_graph("d" * 64, p.graph)


@pytest.mark.gloo
def test_old_module_paths_still_work():
    """``autopar.plan`` and ``autopar.plan_html`` are deprecated re-exports of ``autopar.plans``; importing
    them (first thing, in a fresh interpreter) must not turn ``autopar.plan`` from the function into a module."""
    import subprocess
    import sys

    code = (
        "import types\n"
        "from autopar.plan import SCHEMA_VERSION, Plan, PlanError, human_bytes, human_time, load_plan\n"
        "import autopar, autopar.errors, autopar.plans, autopar.plans.html, autopar.plan_html\n"
        "assert callable(autopar.plan) and not isinstance(autopar.plan, types.ModuleType), autopar.plan\n"
        "assert autopar.plan.__module__ == 'autopar.api'\n"
        "assert (Plan, PlanError, load_plan, SCHEMA_VERSION) == (autopar.plans.Plan, autopar.plans.PlanError,\n"
        "        autopar.plans.load_plan, autopar.plans.SCHEMA_VERSION)\n"
        "assert PlanError is autopar.errors.PlanError and issubclass(PlanError, (autopar.AutoparError, ValueError))\n"
        "assert (human_bytes, human_time) == (autopar.plans.human_bytes, autopar.plans.human_time)\n"
        "assert autopar.plan_html.render_html is autopar.plans.html.render_html\n"
        "assert autopar.plan_html.write_html is autopar.plans.html.write_html\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_text_output_escapes_control_characters():
    # Names come from user code or a plan file: an escape sequence in one must reach the terminal as text.
    evil = "mlp.fc\x1b]0;owned\x07\x1b[2J\r\u202e"
    p = make_plan()
    p.modules[1]["path"] = evil
    p.modules[1]["placements"] = {f"{evil}.weight": "B, S(1)"}
    p.placements[f"{evil}.weight"] = p.placements.pop("mlp.fc1.weight")
    for n in p.nodes:
        if n["module"] == "mlp.fc1":
            n["module"] = evil
    q = make_plan(source="search\x1b[31m")
    texts = {"summary": p.summary(full=True), "explain": p.explain(evil), "diff": p.diff(q)}
    escaped = "mlp.fc\\x1b]0;owned\\x07\\x1b[2J\\x0d\\u202e"
    for name, text in texts.items():
        assert not any(c in text for c in "\x1b\x07\r\u202e"), name
    assert escaped in texts["explain"] and escaped + ".weight" in texts["diff"]
    assert "source: search -> search\\x1b[31m" in texts["diff"]
    assert any(line.startswith(escaped + " ") for line in texts["summary"].splitlines())
    from autopar.plans.format import printable

    assert printable("a\tb\nc\x00\x7f\x9b") == "a\tb\nc\\x00\\x7f\\x9b"


def test_summary_reads_the_same_after_a_save_and_says_what_it_shows(tmp_path):
    """The table lists a module's parameters and the memory split in the same order before and after a save
    (the file's keys are sorted), a legend says what the columns are, and the solver line is in words."""
    p = make_plan(memory={"params": 24 * MIB, "grads": 24 * MIB, "optimizer": 48 * MIB, "activations": 36 * MIB})
    p.modules[1]["placements"] = {"mlp.fc1.weight": "B, S(1)", "mlp.fc1.bias": "B, B"}
    p.save(tmp_path / "p.json", timing=True)
    s = p.summary()

    def rows(text):
        lines = text.splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("peak memory"))
        return [line for line in lines if line.startswith("mlp.fc1 ")] + lines[at:at + 2]

    assert rows(load_plan(tmp_path / "p.json").summary()) == rows(s)
    assert "bias: B,B; weight: B,S(1)" in rows(s)[0]
    assert "params 24.0 MiB, grads 24.0 MiB, optimizer 48.0 MiB, activations 36.0 MiB" in " ".join(s.split())
    assert "comm ms: its reshardings' collectives, each timed alone" in s
    assert "status OPTIMAL (proven the best plan under the cost model)" in s
    q = make_plan(solver={"solver": "HiGHS by mesh axis", "status": "FEASIBLE", "gap": None, "rounds": 3,
                          "relative_gap_per_round": 0.02})
    assert ("status FEASIBLE (a valid plan, not proven the best), solved one mesh axis at a time in 3 rounds, each "
            "within 2% of that round's best; gap unknown") in " ".join(q.summary().split())


def test_explain_and_diff_say_what_they_take(tmp_path):
    """``explain`` takes a module path or FQN (a str), ``diff`` a Plan or a saved plan's path: anything else is one
    clear ArgumentError, and a path is read."""
    from autopar.errors import ArgumentError

    p = make_plan()
    with pytest.raises(ArgumentError, match=r"^Plan.explain: module_path must be a module path or a parameter FQN "
                                            r"\(a str\) such as 'blocks.0.mlp' \(.*\), got 123 \(int\)$"):
        p.explain(123)
    with pytest.raises(ArgumentError, match=r"^Plan.diff: other must be a Plan or a saved plan's path, got int 3$"):
        p.diff(3)
    other = make_plan(source="recipe:ddp")
    other.save(tmp_path / "other.json")
    assert p.diff(str(tmp_path / "other.json")) == p.diff(other) and "source: search -> recipe:ddp" in p.diff(other)
    with pytest.raises(PlanError, match="no plan file at"):
        p.diff(tmp_path / "missing.json")
