"""Fuzz ``load_plan`` with seeded random mutations of valid plan files (a tiny MLP's searched plan and
the hand-built plan of test_plan): wrong types, sizes, nesting, unicode, huge numbers, NaN and
infinities, deleted and unknown keys, broken text. Every file either loads or raises PlanError (never
another exception, never a hang), and every plan that loads renders its summary, explain, diff and
HTML page."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from _plan_files import tiny_plan_json
from test_plan import make_plan

from autopar.plans import Plan, PlanError, load_plan
from autopar.plans.html import render_html

CASES = 200  # per base plan
HANG_S = 10  # a file that takes this long is a hang (the bounds keep every load far below a second)

ODD_VALUES = [
    None, True, False, 0, -1, 1, 2**63, -(2**63) - 1, 3.5, -0.0, 1e308, 1e-320, "", "two", "S(0)", "B, B", "P(max), S(1)",
    "S(-1), B", "S(64), B", "\u202eevil", "\u00e9t\u00e9 \U0001f600", "a\tb", "x" * 5000, "\u200b", "\ufeff", [], {},
    [1, [2, [3]]], {"a": {"b": {"c": {}}}}, ["B, B"], {"tp": 2}, [None], "-", "() -> ()", "(B) -> (-)",
]
NUMBER_TEXT = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000, "-" + "9" * 4000, "1" + "0" * 25,
               "0.5e-400", "12345678901234567890"]


def _paths(x, path=()):
    yield path, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, path + (i,))


def _set(d, path, value):
    for p in path[:-1]:
        d = d[p]
    d[path[-1]] = value


def _mutate(rng: random.Random, d: dict) -> tuple[str, str | bytes]:
    """One random change of ``d`` (a few in a row, sometimes), as the file's text and a description."""
    what = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        paths = list(_paths(d))
        path, value = rng.choice(paths[1:])
        op = rng.randrange(8)
        if op <= 2:  # another value
            new = rng.choice(ODD_VALUES)
            _set(d, path, new)
            what.append(f"{path} = {new!r:.40}")
        elif op == 3:  # deleted
            parent = d
            for p in path[:-1]:
                parent = parent[p]
            del parent[path[-1]]
            what.append(f"del {path}")
        elif op == 4 and isinstance(value, dict):  # an unknown key
            value[rng.choice(["stratgy", "extra", "", "\u00fc", "from", "axes"])] = rng.choice(ODD_VALUES)
            what.append(f"{path} + unknown key")
        elif op == 5:  # nested deeper
            depth = rng.choice((1, 5, 20, 60))
            new = value
            for _ in range(depth):
                new = [new] if rng.random() < 0.5 else {"x": new}
            _set(d, path, new)
            what.append(f"{path} nested {depth}")
        elif op == 6 and isinstance(value, list) and value:  # longer or shorter lists
            _set(d, path, value * rng.choice((0, 2, 3)) if rng.random() < 0.7 else value[:-1])
            what.append(f"{path} resized")
        elif isinstance(value, str):  # a string changed
            _set(d, path, rng.choice([value[::-1], value.upper(), value + "\x00", value * 3, value.replace(",", ";"),
                                      value.replace("S", "P"), value + ", B", "\U0001f600" + value]))
            what.append(f"{path} string changed")
        else:
            _set(d, path, rng.choice(ODD_VALUES))
            what.append(f"{path} replaced")
    text = json.dumps(d, indent=1, ensure_ascii=rng.random() < 0.5)
    r = rng.random()
    if r < 0.3:  # a number literal replaced: loose JSON numbers, huge integers, deep brackets
        spots = [i for i in range(1, len(text)) if text[i].isdigit() and text[i - 1] in " -["]
        if spots:
            i = rng.choice(spots)
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] in ".eE+-"):
                j += 1
            n = rng.choice((50, 2000, 200_000))
            lit = rng.choice(NUMBER_TEXT) if r < 0.25 else "[" * n + "1" + "]" * n
            text = text[:i] + lit + text[j:]
            what.append(f"number at {i} -> {lit[:12]} ({len(lit)} chars)")
    elif r < 0.35:
        text = text[: rng.randrange(len(text))]
        what.append("truncated")
    elif r < 0.4:
        text = text.replace('"B', '"\\ud800B', 1)
        what.append("lone surrogate")
    elif r < 0.43:
        data = bytearray(text.encode("utf-8"))
        data[rng.randrange(len(data))] = 0xFF
        return "invalid UTF-8; " + "; ".join(what), bytes(data)
    return "; ".join(what), text


def _on_alarm(signum, frame):
    raise TimeoutError(f"a plan file took more than {HANG_S} s")


def _render(plan: Plan, base: Plan) -> None:
    plan.summary()
    plan.summary(full=True)
    plan.explain("")
    for m in plan.modules[:2]:
        try:
            plan.explain(m.get("path", ""))
        except PlanError:
            pass  # a path the plan's own lists do not hold (a mutated module entry)
    plan.diff(base)
    base.diff(plan)
    plan.diff(plan)
    render_html(plan)


@pytest.mark.parametrize("which", ["tiny_mlp", "hand_built"])
def test_load_plan_fuzz(tmp_path, which):
    text = tiny_plan_json() if which == "tiny_mlp" else make_plan().to_json()
    good = json.loads(text)
    base = Plan.from_dict(good)
    _render(base, base)
    rng = random.Random(f"plan-fuzz-{which}")
    path = tmp_path / "plan.json"
    outcomes = {"loaded": 0, "refused": 0}
    slowest = (0.0, "")
    old = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for case in range(CASES):
            what, data = _mutate(rng, json.loads(text))
            path.write_bytes(data) if isinstance(data, bytes) else path.write_text(data, encoding="utf-8")
            signal.alarm(HANG_S)
            t0 = time.perf_counter()
            try:
                plan = load_plan(path)
            except PlanError as e:
                msg = str(e)
                assert msg and "\n" not in msg, (case, what, msg)
                outcomes["refused"] += 1
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"case {case} ({what}): {type(e).__name__}: {e}"[:2000])
            else:
                outcomes["loaded"] += 1
                try:
                    _render(plan, base)
                except Exception as e:  # noqa: BLE001
                    pytest.fail(f"case {case} ({what}) loads but does not render: {type(e).__name__}: {e}"[:2000])
            finally:
                signal.alarm(0)
            slowest = max(slowest, (time.perf_counter() - t0, what))
    finally:
        signal.signal(signal.SIGALRM, old)
    # the mutations reach both sides: plans that load (and render) and files that are refused
    assert outcomes["loaded"] >= CASES // 20 and outcomes["refused"] >= CASES // 2, (outcomes, slowest)


def _renamed(plan: Plan, old: str, new: str) -> Plan:
    """``plan`` with module ``old`` (and its parameters) named ``new`` wherever a name appears."""
    d = json.loads(plan.to_json())

    def swap(x):
        if isinstance(x, str):
            return new + x[len(old):] if x == old or x.startswith(old + ".") else x
        if isinstance(x, dict):
            return {swap(k): swap(v) for k, v in x.items()}
        if isinstance(x, list):
            return [swap(v) for v in x]
        return x

    return Plan.from_dict(swap(d))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(st.characters(blacklist_characters="."), min_size=1, max_size=30))
@example(name="x\x1b[31mRED\x1b[0m")
@example(name="\ud800 \u202e\n")
def test_whatever_save_writes_load_plan_reads(tmp_path, name):
    """Torch accepts any module name without a dot (control characters, bidi overrides, lone surrogates):
    a plan naming such a module saves, loads back equal, and its views show the name escaped."""
    plan = _renamed(make_plan(), "mlp.fc1", name)
    path = tmp_path / "named.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.to_json() == plan.to_json()
    _render(loaded, plan)
    assert not any(c in loaded.explain(name) for c in "\x1b\x07\r\u202e")


def test_a_planned_module_with_an_escape_in_its_name_round_trips(tmp_path):
    """The probe's case end to end: a real model with a module named with terminal escapes plans, saves and loads."""
    import torch

    import autopar

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.add_module("x\x1b[31mRED\x1b[0m", torch.nn.Linear(8, 8))
            self.head = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(getattr(self, "x\x1b[31mRED\x1b[0m")(x)).square().mean()

    torch.manual_seed(0)
    plan = autopar.plan(Net(), autopar.Mesh({"dp": 2}, device="cpu"), (torch.randn(4, 8),), progress=False,
                        deterministic_time=0.5)
    assert any("\x1b" in m["path"] for m in plan.modules)
    plan.save(tmp_path / "esc.json")
    assert load_plan(tmp_path / "esc.json").to_json() == plan.to_json()
