"""The pipeline on the surface: the CLI plans a pinned pipeline (``--mesh pp=...,dp=... --pipeline``) and
a device count (``--devices``), ``show`` and its HTML page show stages, schedule, micro-batches, bubble
and per-stage memory, and ``diff`` compares two pipelined plans."""

from __future__ import annotations

import re

import pytest

from tests._cli_helpers import run_cli

FACTORY = '''
from autopar.models import make


def gpt(batch=8, n_layer=4):
    return make("gpt", "tiny", batch=batch, n_layer=n_layer)
'''


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("pipe_cli")
    (cwd / "pipe_models.py").write_text(FACTORY)
    target = f"{cwd}/pipe_models.py:gpt"
    runs = {}
    for name, extra in (("a", ["--pipeline", "schedule=1F1B,microbatches=4"]),
                        ("b", ["--pipeline", "schedule=GPipe,microbatches=2"])):
        runs[name] = run_cli(["plan", target, "--mesh", "pp=2,dp=2", "--device", "cpu", *extra,
                            "-o", f"{cwd}/{name}.json"])
    return cwd, runs


def test_cli_plans_a_pinned_pipeline_and_shows_it(plans):
    cwd, runs = plans
    rc, out, err = runs["a"]
    assert rc == 0, err
    assert "pipeline on axis 'pp'" in out and "1F1B, 4 micro-batches" in out and "bubble" in out
    assert re.search(r"stage 1 \(rank 1\): .*in flight; rank memory", out)
    rc, shown, err = run_cli(["show", f"{cwd}/a.json"])
    assert rc == 0 and "1F1B, 4 micro-batches" in shown


def test_html_page_shows_the_pipeline(plans):
    import autopar
    from autopar.plans.html import render_html

    cwd, _ = plans
    plan = autopar.load_plan(cwd / "a.json")
    page = render_html(plan)
    section = page[page.index('<section id="pipeline">'):]
    section = section[:section.index("</section>")]
    for text in ("1F1B", "micro-batches", "bubble", "rank memory", "micro-batches in flight"):
        assert text in section
    stages = section[section.index('id="pipeline-stages"'):]
    stages = stages[:stages.index("</table>")]
    assert stages.count("<tr>") == 1 + len(plan.pipeline.stages)  # the header and one row per stage
    assert 'href="#pipeline"' in page
    rc, _, err = run_cli(["show", f"{cwd}/a.json", "--html", f"{cwd}/a.html"])
    assert rc == 0, err
    assert (cwd / "a.html").read_text(encoding="utf-8") == page


def test_diff_compares_pipelined_plans(plans):
    cwd, runs = plans
    assert runs["b"][0] == 0, runs["b"][2]
    rc, out, err = run_cli(["diff", f"{cwd}/a.json", f"{cwd}/b.json"])
    assert rc == 0, err
    assert "pipeline schedule: 1F1B -> GPipe" in out and "pipeline microbatches: 4 -> 2" in out
    assert "pipeline memory per rank" in out


@pytest.mark.slow
def test_cli_devices_lets_the_planner_factorize(plans):
    cwd, _ = plans
    rc, out, err = run_cli(["plan", f"{cwd}/pipe_models.py:gpt", "--devices", "4", "--devices-per-node", "2",
                          "--device", "cpu", "-o", f"{cwd}/d.json"])
    assert rc == 0, err
    assert "mesh search: 4 devices (nodes of 2), chose" in out
    rc, out, err = run_cli(["plan", f"{cwd}/pipe_models.py:gpt", "--device", "cpu", "-o", f"{cwd}/e.json"])
    assert rc == 2 and "either --mesh" in err
    rc, out, err = run_cli(["plan", f"{cwd}/pipe_models.py:gpt", "--mesh", "pp=2,dp=2", "--pipeline", "m=4",
                          "-o", f"{cwd}/e.json"])
    assert rc == 2 and "unknown key 'm'" in err
