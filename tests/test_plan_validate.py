"""Plan files are validated on load (``autopar.plans.validate``): each bad file is one PlanError line
naming the field and the value; a stale plan names the parameters and inputs whose shapes changed; a
plan used on a mesh of other axis names, sizes or order names both meshes; the CLI prints one line."""

from __future__ import annotations

import json

import pytest
from _plan_files import AXES, compile_errors_on_rank, tiny_mlp, tiny_plan_json

import autopar
from autopar.cost_model.hardware import Link
from autopar.errors import CompileError
from autopar.plans import bounds
from autopar.plans import SCHEMA_VERSION, Plan, PlanError, load_plan


@pytest.fixture(scope="module")
def good() -> dict:
    return json.loads(tiny_plan_json())


def _write(tmp_path, d_or_text, name="bad.json"):
    path = tmp_path / name
    path.write_text(d_or_text if isinstance(d_or_text, str) else json.dumps(d_or_text), encoding="utf-8")
    return path


def _load_error(tmp_path, d_or_text) -> str:
    path = _write(tmp_path, d_or_text)
    with pytest.raises(PlanError) as e:
        load_plan(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{str(path)!r}: "), msg
    return msg[len(f"{str(path)!r}: "):]


def _mutated(good: dict, change) -> dict:
    d = json.loads(json.dumps(good))
    change(d)
    return d


# -- the cases of the issue ------------------------------------------------------------------------

def test_axis_size_of_the_wrong_type_names_the_field(tmp_path, good):
    d = _mutated(good, lambda d: d["mesh"]["axes"].update(dp="two"))
    assert _load_error(tmp_path, d) == "mesh.axes.dp: input should be a valid integer, got 'two'"


@pytest.mark.parametrize("digits", [4000, 5000, 20])
def test_huge_integers_are_refused_without_converting_them(tmp_path, good, digits):
    text = json.dumps(good).replace(f'"memory_budget": {good["memory_budget"]}', '"memory_budget": ' + "9" * digits)
    assert _load_error(tmp_path, text) == (f"memory_budget: an integer of {digits} digits (999999999999...); "
                                           f"plan integers fit in 64 bits")


def test_deep_nesting_is_refused(tmp_path, good):
    deep = json.dumps(good).replace('"solver": {', '"solver": {"x": ' + "[" * 100_000 + "]" * 100_000 + ", ", 1)
    path = _write(tmp_path, deep)
    with pytest.raises(PlanError) as e:
        load_plan(path)
    assert str(e.value) == (f"{str(path)!r} is not a plan file: its JSON nests too deep to read (a plan nests at "
                            f"most 16 levels)")
    nested = json.dumps(good).replace('"solver": {', '"solver": {"x": ' + "[" * 20 + "]" * 20 + ", ", 1)
    assert _load_error(tmp_path, nested) == "solver.x" + "[0]" * 15 + ": nested deeper than 16 levels"


def test_a_placement_that_does_not_parse_names_the_parameter(tmp_path, good):
    d = _mutated(good, lambda d: d["placements"].update({"head.bias": "lol"}))
    assert _load_error(tmp_path, d) == ("placements['head.bias']: cannot parse placement 'lol': expected S(<dim>), Z(<dim>), B "
                                        "or P (or P(max), P(min)), got 'lol'")
    d = _mutated(good, lambda d: d["modules"][0]["placements"].update(weight="S(0)"))
    assert _load_error(tmp_path, d).startswith("modules[0].placements.weight: placement 'S(0)' has 1 entries but "
                                               "the mesh has 2 axes")
    d = _mutated(good, lambda d: d["nodes"][1]["inputs"].__setitem__(0, "S(99999), B"))
    assert _load_error(tmp_path, d) == ("nodes[1].inputs[0]: placement 'S(99999), B' splits dim 99999; tensor dims "
                                        "are 0..63, got 'S(99999), B'")


@pytest.mark.parametrize("literal, shown", [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"),
                                            ("1e400", "inf")])
def test_numbers_that_are_not_finite_are_refused(tmp_path, good, literal, shown):
    text = json.dumps(good).replace(f'"step_time": {json.dumps(good["step_time"])}', f'"step_time": {literal}')
    assert _load_error(tmp_path, text) == f"step_time: {shown} is not a finite number"


def test_numbers_out_of_range_are_refused(tmp_path, good):
    d = _mutated(good, lambda d: d["nodes"][2].update(compute=-1.0))
    assert _load_error(tmp_path, d) == "nodes[2].compute: input should be greater than or equal to 0, got -1.0"
    d = _mutated(good, lambda d: d["mesh"]["axes"].update(tp=0))
    assert _load_error(tmp_path, d) == "mesh.axes.tp: input should be greater than or equal to 1, got 0"
    d = _mutated(good, lambda d: d.update(step_time=1e300))
    assert _load_error(tmp_path, d) == "step_time: 1e+300 is out of range (at most 1e+30 in size)"
    d = _mutated(good, lambda d: d["reshardings"][0].update(bytes=True))
    assert _load_error(tmp_path, d) == "reshardings[0].bytes: input should be a valid integer, got True"


def test_unknown_keys_are_refused_with_a_suggestion(tmp_path, good):
    def typo(d):
        d["nodes"][3]["stratgy"] = d["nodes"][3].pop("strategy")
    assert _load_error(tmp_path, _mutated(good, typo)) == (
        "nodes[3].stratgy: unknown key 'stratgy' (did you mean 'strategy'?); a plan file holds only the keys "
        "Plan.save writes, so an unknown key is refused rather than ignored")
    msg = _load_error(tmp_path, _mutated(good, lambda d: d.update(comment="mine")))
    assert msg.startswith("comment: unknown key 'comment'")
    # a resharding's keys are known too: a typo there gets its suggestion
    def typo_resharding(d):
        d["reshardings"][0]["tensr"] = d["reshardings"][0].pop("tensor")
    assert _load_error(tmp_path, _mutated(good, typo_resharding)).startswith(
        "reshardings[0].tensr: unknown key 'tensr' (did you mean 'tensor'?)")
    # free-form maps take any name: solver statistics
    d = _mutated(good, lambda d: d["solver"].update(my_note="fast"))
    assert load_plan(_write(tmp_path, d)).solver["my_note"] == "fast"


def test_axis_names_must_agree_across_the_file(tmp_path, good):
    d = _mutated(good, lambda d: d["nodes"][0].update(strategy=d["nodes"][0]["strategy"][:1]))
    msg = _load_error(tmp_path, d)
    assert msg.startswith("nodes[0].strategy: 1 entries for a mesh of 2 axes (dp, tp); give one per axis, got [")
    d = _mutated(good, lambda d: d["collectives"][0].update(axis="pp"))
    assert _load_error(tmp_path, d) == "collectives[0].axis: axis 'pp' is not one of the mesh's axes ['dp', 'tp'], got 'pp'"
    d = _mutated(good, lambda d: d.update(axis_names=["dp", "pp"]))
    assert _load_error(tmp_path, d) == "axis_names: ['dp', 'pp'] does not list the mesh's axes ['dp', 'tp']"
    d = _mutated(good, lambda d: d["mesh"]["axes"].update({"d p": 2}))
    assert _load_error(tmp_path, d).startswith("mesh.axes['d p']: string should match pattern")
    d = _mutated(good, lambda d: d["mesh"]["links"].pop("tp"))
    assert _load_error(tmp_path, d).startswith("mesh: links are given for the axes ['dp'], the mesh has ['dp', 'tp']")


def test_strings_with_control_characters_load_and_show_escaped(tmp_path, good):
    """Torch accepts any character in a module name, so a plan may hold control characters (``Plan.save``
    writes them JSON-escaped): they load, and the views show them escaped. Only a string's length is bounded."""
    for change in (lambda d: d.update(source="search\x1b[2J"),
                   lambda d: d["nodes"][0].update(module="a\nb\x1b[31m\u202e")):
        path = _write(tmp_path, _mutated(good, change))
        plan = load_plan(path)
        for text in (plan.summary(full=True), plan.explain(""), plan.diff(Plan.from_dict(good))):
            assert not any(c in text for c in "\x1b\u202e"), text
    long = "x" * 70_000
    d = _mutated(good, lambda d: d.update(source=long))
    assert _load_error(tmp_path, d) == f"source: a string of 70,000 characters ({bounds.shown(long)}); at most 65,536"


def test_files_too_large_or_not_text_are_refused(tmp_path, good, monkeypatch):
    monkeypatch.setattr(bounds, "MAX_FILE_BYTES", 1000)
    size = len(json.dumps(good).encode())
    assert _load_error(tmp_path, good) == f"the file is {size:,} bytes; a plan file is at most 1,000 bytes"
    monkeypatch.undo()
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(PlanError, match=r"bin.json' is not a plan file: it is not UTF-8 text$"):
        load_plan(path)
    assert _load_error(tmp_path, "[1, 2]") == "a plan is a JSON object, got list"
    unreadable = tmp_path / "unreadable.json"
    unreadable.write_text("{}")
    monkeypatch.setattr(bounds, "open", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied")),
                        raising=False)
    with pytest.raises(PlanError, match=r"unreadable.json' is not a plan file: cannot read it \(Permission denied\)$"):
        load_plan(unreadable)


# -- schema versions and the unchanged format -----------------------------------------------------

def test_a_saved_plan_loads_and_saves_to_the_same_bytes(tmp_path):
    text = tiny_plan_json()
    path = _write(tmp_path, text, "plan.json")
    plan = load_plan(path)
    plan.save(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text(encoding="utf-8") == text
    assert json.loads(text)["schema_version"] == SCHEMA_VERSION == 10


def test_later_versions_only_add_fields(good):
    """The format of version 1 is kept: version 2 adds ``graph.shapes``, 3 ``mesh.hardware.nics_per_node``,
    4 ``checkpointing``, ``kept_gathers`` and ``layer_groups``, 5 the MFU fields and replaces the two
    efficiency constants of ``mesh.hardware`` by its ``efficiency`` curves, 6 ``mesh.hardware.overlap_slowdown``
    and ``mesh_search``, 7 a link's ``factors`` (written only where there are any), 8 ``peak_at``."""
    assert good["graph"]["shapes"] == {"head.bias": "float32[4]", "head.weight": "float32[4, 32]",
                                       "layers.0.bias": "float32[32]", "layers.0.weight": "float32[32, 16]",
                                       "layers.1.bias": "float32[32]", "layers.1.weight": "float32[32, 32]"}
    version_1 = ["axis_names", "baselines", "bucket_size", "collectives", "comm_time", "compute_time", "fingerprint",
                 "graph", "memory", "memory_budget", "mesh", "modules", "nodes", "peak_memory", "placements",
                 "precision", "reshardings", "schema_version", "solver", "source", "step_time", "training"]
    assert sorted(good) == sorted(version_1 + ["checkpointing", "kept_gathers", "layer_groups", "model_flops", "mfu",
                                               "tokens_per_step", "tokens_per_second_per_device", "pipeline",
                                               "mesh_search", "peak_at"])
    assert "nics_per_node" in good["mesh"]["hardware"]
    assert "efficiency" in good["mesh"]["hardware"] and "matmul_efficiency" not in good["mesh"]["hardware"]
    assert "overlap_slowdown" in good["mesh"]["hardware"]
    assert all("factors" not in link for link in good["mesh"]["links"].values())  # the presets' ring links


def test_a_version_5_file_loads_without_a_mesh_search(tmp_path, good):
    old = _mutated(good, lambda d: (d.update(schema_version=5), d.pop("mesh_search")))
    plan = load_plan(_write(tmp_path, old))
    assert plan.schema_version == SCHEMA_VERSION and plan.mesh_search is None


def test_a_version_6_file_loads_with_its_links_at_their_ring_time(tmp_path, good):
    old = _mutated(good, lambda d: d.update(schema_version=6))
    plan = load_plan(_write(tmp_path, old))
    assert plan.schema_version == SCHEMA_VERSION and plan.step_time == good["step_time"]
    assert all(Link.from_dict(link).factors == () for link in plan.mesh["links"].values())
    bad = _mutated(good, lambda d: d["mesh"]["links"]["dp"].update(factors={"reduce_scatter": -1.0}))
    assert _load_error(tmp_path, bad).startswith("mesh.links.dp.factors.reduce_scatter")


def test_a_version_1_file_loads_with_shapes_left_out(tmp_path, good):
    old = _mutated(good, lambda d: (d.update(schema_version=1), d["graph"].pop("shapes")))
    plan = load_plan(_write(tmp_path, old))
    assert plan.schema_version == SCHEMA_VERSION and "shapes" not in plan.graph
    assert plan.placements == good["placements"] and plan.nodes == good["nodes"]


def test_a_version_3_file_loads_with_nothing_recomputed_or_kept(tmp_path, good):
    old = _mutated(good, lambda d: (d.update(schema_version=3), [d.pop(k) for k in ("checkpointing", "kept_gathers",
                                                                                   "layer_groups")]))
    plan = load_plan(_write(tmp_path, old))
    assert plan.schema_version == SCHEMA_VERSION
    assert (plan.checkpointing, plan.kept_gathers, plan.layer_groups) == ({}, [], [])


def test_a_version_4_file_loads_with_mfu_unknown_and_its_constants_as_a_flat_efficiency(tmp_path, good):
    """A version 4 plan has no MFU fields and prices with two constants: it loads with the MFU at 0
    (not known, and the summary leaves it out) and its hardware prices every shape at the constants."""
    from autopar.cost_model.efficiency import Efficiency
    from autopar.cost_model.hardware import Hardware

    def old_form(d):
        d.update(schema_version=4)
        for k in ("model_flops", "mfu", "tokens_per_step", "tokens_per_second_per_device"):
            d.pop(k)
        hw = d["mesh"]["hardware"]
        hw.pop("efficiency")
        hw.update(matmul_efficiency=0.7, memory_efficiency=0.8)

    plan = load_plan(_write(tmp_path, _mutated(good, old_form)))
    assert (plan.model_flops, plan.mfu, plan.tokens_per_step, plan.tokens_per_second_per_device) == (0.0, 0.0, 0, 0.0)
    assert "MFU" not in plan.summary()
    hw = Hardware.from_dict(plan.mesh["hardware"])
    assert hw.efficiency == Efficiency.flat(0.7, 0.8)


def test_version_4_fields_round_trip_and_a_wrong_mode_is_refused(tmp_path, good):
    group = {"prefix": "layers", "count": 2, "paths": ["layers.0", "layers.1"], "checkpointed": 1, "mode": "full",
             "saved_bytes": 4096, "input_bytes": 512, "recompute_time": 0.001, "kept_gathers": False}
    new = _mutated(good, lambda d: d.update(schema_version=4, checkpointing={"layers.0": "full"},
                                            kept_gathers=["layers.1"], layer_groups=[group]))
    plan = load_plan(_write(tmp_path, new))
    assert plan.checkpointing == {"layers.0": "full"} and plan.kept_gathers == ["layers.1"]
    assert plan.layer_groups == [group]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan
    bad = _mutated(new, lambda d: d.update(checkpointing={"layers.0": "some"}))
    assert _load_error(tmp_path, bad) == "checkpointing['layers.0']: input should be 'full' or 'selective', got 'some'"
    lacking = _mutated(new, lambda d: d.pop("layer_groups"))
    assert _load_error(tmp_path, lacking) == "plan lacks the field(s) layer_groups (schema version 4)"


def test_version_5_layer_groups_say_what_keeping_gathers_costs(tmp_path, good):
    """Version 5 adds per layer group what keeping its gathered parameters holds and saves; a version 4
    group without them loads as it was."""
    group = {"prefix": "layers", "count": 2, "paths": ["layers.0", "layers.1"], "checkpointed": 0, "mode": "none",
             "saved_bytes": 4096, "input_bytes": 512, "recompute_time": 0.001, "kept_gathers": True, "kept": 2,
             "kept_bytes": 2048, "kept_time": 0.0005}
    new = _mutated(good, lambda d: d.update(kept_gathers=["layers.0", "layers.1"], layer_groups=[group]))
    plan = load_plan(_write(tmp_path, new))
    assert plan.layer_groups == [group] and plan.schema_version == SCHEMA_VERSION
    assert "2 of 2 keep their gathered parameters" in plan.summary()
    bad = _mutated(new, lambda d: d["layer_groups"][0].update(kept_bytes=-1))
    assert _load_error(tmp_path, bad).startswith("layer_groups[0].kept_bytes")


def test_a_version_5_file_loads_with_overlap_free_and_a_slowdown_out_of_range_is_refused(tmp_path, good):
    """Version 6 adds ``mesh.hardware.overlap_slowdown``: a version 5 plan (priced with hidden
    communication free) loads with it at 0, and its hardware prices as it did."""
    from autopar.cost_model.hardware import Hardware

    def old_form(d):
        d.update(schema_version=5)
        d["mesh"]["hardware"].pop("overlap_slowdown")

    plan = load_plan(_write(tmp_path, _mutated(good, old_form)))
    assert plan.schema_version == SCHEMA_VERSION and plan.mesh["hardware"]["overlap_slowdown"] == 0.0
    assert Hardware.from_dict(plan.mesh["hardware"]).overlap_slowdown == 0.0
    assert plan.step_time == good["step_time"]  # the price as written
    for bad in (1.0, -0.1):
        d = _mutated(good, lambda d: d["mesh"]["hardware"].update(overlap_slowdown=bad))
        assert _load_error(tmp_path, d).startswith("mesh.hardware.overlap_slowdown")


@pytest.mark.parametrize("version", [0, 11, "2", True, None])
def test_other_versions_are_refused_naming_the_version(tmp_path, good, version):
    d = _mutated(good, lambda d: d.update(schema_version=version))
    assert _load_error(tmp_path, d) == (f"plan schema version {version!r} found, this autopar reads version 10 (and "
                                        f"the earlier 1, 2, 3, 4, 5, 6, 7, 8, 9): make the plan again with autopar.plan(...) (or use the "
                                        f"autopar version that wrote it)")


# -- a plan meets a model and a mesh --------------------------------------------------------------

def test_a_plan_used_on_a_model_of_other_shapes_names_them():
    plan = Plan.from_dict(json.loads(tiny_plan_json()))
    model, inputs = tiny_mlp(hidden=48)
    with pytest.raises(PlanError) as e:
        autopar.simulate(model, plan, inputs)
    msg = str(e.value)
    assert "this plan was made for another graph" in msg and "(plan -> model)" in msg
    assert ("(plan -> model):\n  parameter head.weight: float32[4, 32] -> float32[4, 48]\n"
            "  parameter layers.0.bias: float32[32] -> float32[48]\n"
            "  parameter layers.0.weight: float32[32, 16] -> float32[48, 16]\n"
            "  parameter layers.1.bias: float32[32] -> float32[48]\n"
            "  parameter layers.1.weight: float32[32, 32] -> float32[48, 48]\n") in msg
    assert "head.bias" not in msg  # its shape did not change
    assert "(no difference" not in msg
    model, inputs = tiny_mlp(batch=8)
    with pytest.raises(PlanError, match=r"input input:0: float32\[4, 16\] -> float32\[8, 16\]\n"
                                        r"  input input:1: int64\[4\] -> int64\[8\]"):
        autopar.simulate(model, plan, inputs)


def test_a_version_1_plan_on_a_model_of_other_shapes_says_it_records_none(good):
    old = _mutated(good, lambda d: (d.update(schema_version=1), d["graph"].pop("shapes")))
    model, inputs = tiny_mlp(hidden=48)
    with pytest.raises(PlanError, match=r"the parameters' shapes, which this plan \(from a schema version 1 file\) "
                                        r"does not record"):
        autopar.simulate(model, Plan.from_dict(old), inputs)


@pytest.mark.parametrize("axes, why", [
    ({"tp": 2, "dp": 2}, "the same axes in another order: placements are per axis in mesh order"),
    ({"data": 2, "tp": 2}, "axis names differ: the plan's ['dp', 'tp'], the mesh's ['data', 'tp']"),
    ({"dp": 4, "tp": 1}, "axis sizes differ: dp 2 vs 4, tp 2 vs 1"),
    ({"dp": 4}, "axis names differ: the plan's ['dp', 'tp'], the mesh's ['dp']"),
])
def test_a_plan_used_on_another_mesh_names_both(axes, why):
    plan = Plan.from_dict(json.loads(tiny_plan_json()))
    model, inputs = tiny_mlp()
    theirs = " x ".join(f"{k}={v}" for k, v in axes.items())
    want = (f"this plan was made for mesh dp=2 x tp=2, not {theirs} ({why}): build the mesh as "
            f"autopar.Mesh({AXES!r}, ...) or plan again for this mesh")
    with pytest.raises(PlanError) as e:
        plan.check_mesh(axes)
    assert str(e.value) == want
    with pytest.raises(CompileError) as e:  # before any process group is needed
        autopar.compile(model, autopar.Mesh(axes, device="cpu"), inputs, plan=plan)
    assert str(e.value) == want
    plan.check_mesh(dict(AXES))


# -- the command line ---------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    (lambda d: d["mesh"]["axes"].update(dp="two"), "mesh.axes.dp: input should be a valid integer, got 'two'"),
    (lambda d: d["placements"].update({"head.bias": "lol"}), "placements['head.bias']: cannot parse placement 'lol'"),
    (lambda d: d.update(memory_budget=None), "plan field 'memory_budget' should be int, got NoneType None"),
])
def test_cli_show_prints_one_line_naming_the_field(tmp_path, good, capsys, change, field):
    from autopar.cli import main

    path = _write(tmp_path, _mutated(good, change))
    assert main(["show", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "internal error" not in err, err
    assert err.startswith(f"autopar show: error: {str(path)!r}: {field}"), err
    text = json.dumps(good).replace(f'"memory_budget": {good["memory_budget"]}', '"memory_budget": ' + "9" * 5000)
    path.write_text(text)
    assert main(["show", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory_budget: an integer of 5000 digits" in err, err


@pytest.mark.gloo
def test_compile_with_a_plan_file_fails_alike_on_every_rank(tmp_path, good):
    """Rank 0 reads the file; a file it refuses, or a plan for other mesh axes, is the same error on
    every rank (none is left waiting for rank 0's plan)."""
    from autopar.runtime.launch import launch

    model, inputs = tiny_mlp()
    plan = autopar.plan(model, autopar.Mesh({"dp": 2}, device="cpu"), inputs, deterministic_time=0.5, progress=False)
    ok = tmp_path / "dp.json"
    plan.save(ok)
    bad = _write(tmp_path, json.loads(ok.read_text()) | {"step_time": "fast"})
    results = launch(compile_errors_on_rank, 2, [str(bad), str(ok)], {"data": 2}, timeout=120)
    assert results[0] == results[1], results
    assert results[0] == [
        f"PlanError: {str(bad)!r}: plan field 'step_time' should be int or float, got str 'fast'",
        ("CompileError: this plan was made for mesh dp=2, not data=2 (axis names differ: the plan's ['dp'], the "
         "mesh's ['data']): build the mesh as autopar.Mesh({'dp': 2}, ...) or plan again for this mesh"),
    ]
