"""With torch's structured trace on (``TORCH_TRACE``), planning writes the plan, its phases and its
summary as ``artifact`` records, the form tlparse lists (``autopar/_torch_compat/trace.py``). The
trace handler is installed in this process (``tracing_to``), as ``TORCH_TRACE=DIR`` installs it at
import; the records are read back from the file it wrote."""

from __future__ import annotations

import json

import autopar
from autopar._torch_compat.trace import tracing, tracing_to
from autopar.models import make


def _records(path: str) -> dict[str, tuple[dict, str]]:
    """The trace file's artifact records: name -> (metadata, payload). A record is one line (a log
    prefix, then its JSON) followed by its payload's lines, each starting with a tab."""
    out: dict[str, tuple[dict, str]] = {}
    current = None
    for line in open(path, encoding="utf-8").read().splitlines():
        if line.startswith("\t"):
            if current is not None:
                current[1].append(line[1:])
            continue
        meta = json.loads(line[line.index("{"):])
        current = None
        if "artifact" in meta:
            current = (meta, [])
            out[meta["artifact"]["name"]] = current
    return {k: (m, "\n".join(p).rstrip("\n")) for k, (m, p) in out.items()}


def test_plan_and_phases_are_trace_artifacts(tmp_path):
    model, args = make("gpt", "tiny", batch=4, seq=16)
    mesh = autopar.Mesh({"dp": 2}, device="cpu")
    assert not tracing()
    with tracing_to(str(tmp_path)) as files:
        assert tracing()
        plan = autopar.plan(model, mesh, args, progress=False, recipe="fsdp")
    assert not tracing(), "the handler goes when the block ends"
    written = files()
    assert len(written) == 1, written
    records = _records(written[0])
    assert set(records) >= {"autopar_plan", "autopar_plan_phases", "autopar_plan_summary"}
    meta, payload = records["autopar_plan"]
    assert meta["artifact"]["encoding"] == "json"
    assert payload == plan.to_json().rstrip("\n"), "the artifact is the plan file's JSON"
    assert autopar.Plan.from_dict(json.loads(payload)).placements == plan.placements
    phases = json.loads(records["autopar_plan_phases"][1])
    assert set(phases) >= {"capture", "recipes", "solve", "total"} and phases == plan.phases
    assert records["autopar_plan_summary"][0]["artifact"]["encoding"] == "string"
    assert "fsdp" in records["autopar_plan_summary"][1]


def test_nothing_is_written_without_the_trace(tmp_path, monkeypatch):
    model, args = make("mlp", "tiny", batch=4)
    calls = []
    monkeypatch.setattr(autopar.Plan, "to_json", lambda self, timing=False: calls.append(1) or "{}")
    autopar.plan(model, autopar.Mesh({"dp": 2}, device="cpu"), args, progress=False, recipe="ddp")
    assert calls == [], "the payload is not even computed when the trace is off"
