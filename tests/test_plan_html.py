"""The plan's HTML page (autopar.plans.html): contents, escaping, determinism and self-containment on a
real small plan, then the page opened in a real headless browser (Chromium) to prove its script runs
without errors and sorts the module table."""

from __future__ import annotations

import copy
import html
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

import autopar
from autopar.models import make
from autopar.plans import Plan, load_plan
from autopar.plans.html import render_html, write_html

#: fixtures that start processes (a headless browser): conftest marks their tests gloo
PROCESS_FIXTURES = {"browser"}

#: bytes per device: small enough that the ddp recipe (about 31 KiB) does not fit
BUDGET = 24_000


@pytest.fixture(scope="module")
def plan() -> Plan:
    """A real plan: the tiny MLP on 2 devices with a budget that rules out ddp (about 3 s)."""
    model, args = make("mlp", "tiny", batch=8)
    return autopar.plan(model, autopar.Mesh({"dp": 2}, device="h100"), args, memory_budget=BUDGET, time_limit=5)


@pytest.fixture(scope="module")
def page(plan) -> str:
    return render_html(plan)


def _two_axis(plan: Plan) -> Plan:
    """The plan on a (tp=4, dp=2) mesh (axes deliberately not alphabetical): every placement gains
    ``S(0)`` on tp in front, so each module shows a placement per axis."""
    d = copy.deepcopy(plan.to_dict())
    d["mesh"]["axes"] = {"tp": 4, "dp": 2}
    d["mesh"]["links"] = {"tp": d["mesh"]["links"]["dp"], "dp": d["mesh"]["links"]["dp"]}
    d["axis_names"] = ["tp", "dp"]
    d["placements"] = {k: f"S(0), {v}" for k, v in d["placements"].items()}
    for m in d["modules"]:
        m["placements"] = {k: f"S(0), {v}" for k, v in m["placements"].items()}
    for n in d["nodes"]:  # a strategy per axis (load checks it): the dp one again on tp, placements alike
        n["strategy"], n["tags"] = n["strategy"][:1] + n["strategy"], n["tags"][:1] + n["tags"]
        n["inputs"] = [f"B, {p}" for p in n["inputs"]]
        n["outputs"] = [None if p is None else f"B, {p}" for p in n["outputs"]]
    for r in d["reshardings"]:
        r["from"], r["to"] = f"B, {r['from']}", f"B, {r['to']}"
    return Plan.from_dict(d)


# -- a checker for "valid-ish" HTML ------------------------------------------------------------------

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class _Checker(HTMLParser):
    """Every element closed, in order; ids unique; links only to the page itself or data: URLs."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.ids: set[str] = set()
        self.tags: dict[str, int] = {}
        self.rows: list[dict] = []  # attributes of each <tr>

    def _attrs(self, tag, attrs):
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for k, v in attrs:
            if k == "id":
                if v in self.ids:
                    self.problems.append(f"duplicate id {v!r}")
                self.ids.add(v)
            if k in ("src", "href", "action", "xlink:href", "srcset", "poster", "data") and v is not None:
                if not (v.startswith("#") or v.startswith("data:")):
                    self.problems.append(f"<{tag} {k}={v!r}> refers outside the page")
        if tag == "tr":
            self.rows.append(dict(attrs))

    def handle_starttag(self, tag, attrs):
        self._attrs(tag, attrs)
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self._attrs(tag, attrs)

    def handle_endtag(self, tag):
        if tag in _VOID:
            self.problems.append(f"end tag for void element </{tag}>")
        elif not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes <{self.stack[-1] if self.stack else '(nothing)'}>")
            if tag in self.stack:
                while self.stack and self.stack.pop() != tag:
                    pass
        else:
            self.stack.pop()


def _check(text: str) -> _Checker:
    c = _Checker()
    c.feed(text)
    c.close()
    assert not c.problems, c.problems[:10]
    assert not c.stack, f"unclosed elements: {c.stack}"
    return c


# -- unit ---------------------------------------------------------------------------------------------------

def test_page_shows_the_plan(plan, page):
    assert page.startswith("<!DOCTYPE html>\n")
    checker = _check(page)
    # the module table: one row per module, in the plan's order, each path shown
    paths = [r["data-path"] for r in checker.rows if "data-path" in r]
    assert paths == [m["path"] for m in plan.modules]
    table = page[page.index('<table class="sortable" id="modules">'):]
    table = table[:table.index("</table>")]
    for m in plan.modules:
        if m["path"]:
            assert f"<code>{html.escape(m['path'])}</code>" in table
    assert "(root)" in table
    # one placement column per mesh axis, with color-coded chips
    assert 'data-key="axis:dp"' in table and re.search(r'class="pl pl-[SBP]"', table)
    # header figures
    for text in ("dp=2", "h100", plan.precision["name"], "source", "search", "step time", "peak memory"):
        assert text in page
    # on h100 (overlap slowdown > 0) the communication figure also holds the compute it slows, and says so
    assert plan.mesh["hardware"]["overlap_slowdown"] > 0 and "exposed communication and the compute it slows" in page
    # the recipes: every one named, ddp marked as not fitting, fsdp_tp's error listed
    recipes = page[page.index('<table class="sortable" id="recipes">'):]
    recipes = recipes[:recipes.index("</table>")]
    for name, b in plan.baselines.items():
        e = html.escape(name)
        if "error" in b:  # listed with its error, and neither charted nor tabled
            assert f"<li><b>{e}</b>: {html.escape(b['error'])}</li>" in page
            assert f'data-name="{e}"' not in page and f'<td data-v="{e}">' not in recipes
            continue
        cls = "recipe" if b["fits"] else "nofit"
        assert page.count(f'data-name="{e}"') == 1  # one bar in the chart, classed by whether it fits
        assert f'<g class="brow b-{cls}" data-name="{e}">' in page
        assert f'<td data-v="{e}">{e}' in recipes  # and one row in the recipes table
    assert plan.baselines["ddp"]["fits"] is False
    assert re.search(r'<g class="brow b-nofit" data-name="ddp">((?!</g>).)*class="bar-nofit"', page)
    assert "does not fit" in page
    assert "error" in plan.baselines["fsdp_tp"]
    errors = page[page.index('id="recipe-errors"'):]
    assert "fsdp_tp" in errors[:errors.index("</ul>")]
    # communication and memory
    for c in plan.collectives:
        assert f">{c['kind']}<" in page
    assert 'id="memory-chart"' in page and 'class="budget"' in page
    for k in plan.memory:
        assert f'm-{k}"' in page


def test_page_is_self_contained(page):
    assert "http://" not in page and "https://" not in page
    assert "@import" not in page
    assert all(u.startswith("url(#") for u in re.findall(r"url\([^)]*\)", page))
    assert not re.search(r"<(link|script|img|iframe|object|embed)[^>]*\s(src|href)=\"(?!data:|#)", page)
    assert "Content-Security-Policy" in page and "default-src 'none'" in html.unescape(page)


def test_page_is_deterministic(plan, page, tmp_path):
    again = copy.deepcopy(plan)
    again.phases = {k: v + 1.0 for k, v in again.phases.items()}  # wall-clock figures are not shown
    again.solver["wall_time"] = 123.0
    assert render_html(again) == page
    plan.save(tmp_path / "plan.json")
    assert render_html(load_plan(tmp_path / "plan.json")) == page  # saved and loaded: same bytes
    write_html(plan, tmp_path / "plan.html")
    assert (tmp_path / "plan.html").read_bytes() == page.encode("utf-8")


def test_user_text_is_escaped(plan):
    d = plan.to_dict()
    evil = '<script>alert("x")</script>'
    d["modules"][0]["path"] = f"layers.{evil}"
    d["modules"][0]["placements"] = {f"w{evil}": "S(0)"}
    d["placements"][f"layers.{evil}.w{evil}"] = "S(0)"
    d["baselines"]["bad<b>&recipe"] = {"error": f"failed on {evil}"}
    page = render_html(Plan.from_dict(d), title=f"model {evil}")
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "bad&lt;b&gt;&amp;recipe" in page
    assert page.count("<script>") == 2  # the page's own two scripts, nothing else
    _check(page)


def test_one_column_per_mesh_axis_in_mesh_order(plan):
    page = render_html(_two_axis(plan))
    _check(page)
    assert page.index('data-key="axis:tp"') < page.index('data-key="axis:dp"')
    assert "tp=4 \u00d7 dp=2" in page
    row = re.search(r'<tr data-path="layers.0">(.*?)</tr>', page).group(1)
    cells = re.findall(r'<td class="axis"[^>]*>(.*?)</td>', row)
    assert len(cells) == 2 and "S(0)" in cells[0]  # tp: every parameter split on dim 0


# -- in a real browser ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> str:
    """The headless browser to run (asked for before the plan, so a skip costs no planning)."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe:
        return exe
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail("no headless browser (chromium, chromium-browser or google-chrome) on PATH in CI: "
                    ".ci/run installs Debian's chromium; the HTML page's browser test cannot run")
    pytest.skip("no chromium / chromium-browser / google-chrome on PATH: the HTML page is not opened in a "
                "browser here (apt-get install chromium to run this test)")


def _open(exe: str, page_path, tmp_path, fragment: str = "") -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, the browser's console lines for the page)."""
    url = page_path.resolve().as_uri() + fragment
    profile = tmp_path / f"profile-{page_path.stem}"
    cmd = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--dump-dom", url]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, f"{exe} failed ({res.returncode}):\n{res.stderr[-3000:]}"
    console = [line for line in res.stderr.splitlines()
               if ":CONSOLE" in line or "Uncaught" in line or "console error" in line.lower()]
    return res.stdout, console


def _errors_box(dom: str) -> str:
    m = re.search(r'<div id="errors"([^>]*)>(.*?)</div>', dom, re.S)
    assert m, "the page has no #errors element"
    return m.group(1), m.group(2)


def test_page_runs_in_a_browser(browser, plan, page, tmp_path):
    exe = browser
    path = tmp_path / "plan.html"
    path.write_text(page, encoding="utf-8")
    # the address asks the page's script to sort the module table on a numeric column, largest first
    # (one whose order differs from the graph order, so the sorted rows prove the script ran)
    mods = plan.modules
    for key in ("bytes", "memory", "time", "comm"):
        order = sorted(range(len(mods)), key=lambda i: (-mods[i][key], i))
        if order != list(range(len(mods))):
            break
    else:
        pytest.fail("every numeric column of the module table is already in graph order: no sort to observe")
    dom, console = _open(exe, path, tmp_path, f"#sort=modules:{key}:desc")
    assert not console, "the page logged to the browser console:\n" + "\n".join(console)
    attrs, text = _errors_box(dom)
    assert text.strip() == "" and "hidden" in attrs, f"script errors on the page: {html.unescape(text)}"
    assert re.search(r'<html[^>]*data-ready="1"', dom), "the page's script did not run to its end"
    body = dom[dom.index('id="modules"'):]
    body = body[body.index("<tbody>"):body.index("</tbody>")]
    shown = [html.unescape(p) for p in re.findall(r'<tr data-path="([^"]*)"', body)]
    assert shown == [mods[i]["path"] for i in order], f"the module table was not sorted by {key} by the script"
    assert re.search(rf'<th[^>]*data-key="{key}"[^>]*aria-sort="descending"|'
                     rf'<th[^>]*aria-sort="descending"[^>]*data-key="{key}"', dom)


def test_browser_check_sees_script_errors(browser, page, tmp_path):
    """The check above would notice a failing script: a page with one broken statement shows it."""
    exe = browser
    path = tmp_path / "broken.html"
    path.write_text(page.replace("</body>", "<script>autoparMissingFunction();</script></body>"), encoding="utf-8")
    dom, console = _open(exe, path, tmp_path)
    attrs, text = _errors_box(dom)
    assert "Uncaught" in text and "autoparMissingFunction" in text
    assert "hidden" not in attrs
    assert any("autoparMissingFunction" in line for line in console)
