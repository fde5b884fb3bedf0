"""The ``autopar`` command line, driven as users drive it: ``python -m autopar ...`` (and the
``autopar`` console script) in a subprocess, from a directory holding the user's factory module.

Every command starts a Python that imports torch and autopar (seconds), so the runs are started
together at the module's start on a small thread pool and each test waits for its own; runs that
need a plan file wait for the run that writes it. Only the runs of the selected tests start.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from tests._cli_helpers import run_cli

#: fixtures that start processes (the console script in a subprocess): conftest marks their tests gloo
PROCESS_FIXTURES = {"cli"}

#: The user's module: factories returning (model, example_inputs), and some that go wrong.
FACTORIES = '''
import torch
from autopar.models import make


def mlp(batch=8, device="meta"):
    return make("mlp", "tiny", batch=batch, device=device)


def not_a_pair():
    return 42


def broken(batch=8):
    raise ValueError("no data for batch %d" % batch)


def evil():
    raise ValueError("\\x1b[2J\\x1b]0;owned\\x07gone")
'''

#: A file next to the factory module named like a package autopar imports while planning: the CLI must
#: never import it in the package's place (it did, when it put the current directory first on sys.path).
SHADOW = '''
import os
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "SHADOWED"), "w").write("imported")
raise ImportError("the test's ortools.py was imported")
'''

WORKERS = 3
TIMEOUT = 180


@dataclass
class Run:
    args: list
    rc: int
    out: str
    err: str
    seconds: float

    def __str__(self) -> str:
        return f"autopar {' '.join(self.args)} -> exit {self.rc} in {self.seconds:.1f} s\n" \
               f"--- stdout ---\n{self.out[-3000:]}\n--- stderr ---\n{self.err[-3000:]}"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "AUTOPAR_DEBUG", "PYTHONPATH"):
        env.pop(k, None)  # the factory module must be found from the working directory alone
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # the autopar under test, not another checkout's
    return env


def _console_script() -> Optional[str]:
    here = Path(sys.executable).parent / "autopar"
    return str(here) if here.exists() else shutil.which("autopar")


# argv after `autopar` of the runs that make the plan files
PLAN_A = ["plan", "cli_models:mlp", "--mesh", "dp=2", "--device", "cpu", "--kw", "batch=8", "--kw", "device=meta",
          "--hint", "input:0=dp=S(0)", "--memory-budget", "1GiB", "--time-limit", "60", "-o", "a.json"]
PLAN_B = ["plan", "{cwd}/cli_models.py:mlp", "--mesh", "dp=2,tp=1", "--device", "cpu", "--inference",
          "--hint", "layers.0.weight=S(0), B", "--search-time", "2", "-o", "{cwd}/b.json"]

#: the documented errors, each a subprocess: name -> (argv, the run it needs first, exit code,
#: what the one line on stderr says)
ERRORS: dict[str, tuple[list, Optional[str], int, list]] = {
    "module_not_importable": (["plan", "nosuchmod:make", "--mesh", "dp=2", "-o", "x.json"], None, 1,
                              ["cannot import module 'nosuchmod'", "PYTHONPATH"]),
    "factory_missing": (["plan", "cli_models:nope", "--mesh", "dp=2", "-o", "x.json"], None, 1,
                        ["has no attribute 'nope'", "it defines", "mlp"]),
    "factory_returns_wrong_thing": (["plan", "cli_models:not_a_pair", "--mesh", "dp=2", "-o", "x.json"], None, 1,
                                    ["must return (model, example_inputs)", "it returned int 42"]),
    "hint_unknown_parameter": (["plan", "cli_models:mlp", "--mesh", "dp=2", "--device", "cpu",
                                "--hint", "nosuch.*=S(0)", "-o", "x.json"], None, 1,
                               ["--hint nosuch.*=S(0)", "no parameter, buffer or input matches 'nosuch.*'",
                                "layers.0.weight"]),
    "plan_file_not_a_plan": (["diff", "a.json", "notplan.json"], "plan_a", 1,
                             ["'notplan.json'", "not an autopar plan"]),
    "explain_unknown_module": (["explain", "a.json", "layer.0"], "plan_a", 1,
                               ["no module or parameter 'layer.0'", "did you mean: layers.0"]),
}

RUNS: dict[str, tuple[list, Optional[str]]] = {
    "demo": (["demo", "--quick"], None),
    "plan_a": (PLAN_A, None),
    "show": (["show", "a.json"], "plan_a"),
    "explain": (["explain", "a.json", "layers.0"], "plan_a"),
    **{name: (argv, after) for name, (argv, after, _, _) in ERRORS.items()},
    "diff": (["diff", "a.json", "b.json"], "plan_a"),  # b.json: made in process by the fixture, first
}
#: which test needs which runs
NEEDS = {"test_plan_writes_a_plan_that_loads": ["plan_a"], "test_a_plan_from_the_cli_runs": ["plan_a"], "test_show": ["show"], "test_explain": ["explain"],
         "test_diff_with_console_script": ["diff"], "test_demo_quick": ["demo"]}


class Runner:
    """Starts the runs on a pool; ``result(name)`` waits for one."""

    def __init__(self, cwd: Path):
        self.cwd = cwd
        self.pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="cli-test")
        self.futures: dict[str, Future] = {}
        self.plan_b: Optional[tuple] = None  # (rc, out, err) of the in-process `autopar plan` of b.json

    def _exec(self, name: str) -> Run:
        argv, after = RUNS[name]
        if after:
            self.result(after)  # submitted before this one, so it runs (or ran) on another worker
        exe = [_console_script()] if name == "diff" and _console_script() else [sys.executable, "-m", "autopar"]
        t0 = time.perf_counter()
        p = subprocess.run(exe + argv, cwd=self.cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
        return Run(argv, p.returncode, p.stdout, p.stderr, time.perf_counter() - t0)

    def submit(self, name: str) -> None:
        if name in self.futures:
            return
        if RUNS[name][1]:
            self.submit(RUNS[name][1])
        self.futures[name] = self.pool.submit(self._exec, name)

    def result(self, name: str) -> Run:
        self.submit(name)
        return self.futures[name].result()


@pytest.fixture(scope="module")
def cli(request, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    (cwd / "cli_models.py").write_text(FACTORIES)
    (cwd / "ortools.py").write_text(SHADOW)
    (cwd / "notplan.json").write_text('{"hello": "world"}\n')
    runner = Runner(cwd)
    wanted = []
    for item in request.session.items:
        if item.module is request.module:
            wanted += NEEDS.get(item.name, [])
            m = re.match(r"test_documented_error\[(\w+)\]", item.name)
            wanted += [m.group(1)] if m else []
    for name in RUNS:  # in RUNS's order: the long ones first
        if name in wanted and name != "diff":
            runner.submit(name)
    # While those run: the second plan in this process (it is needed only by diff).
    runner.plan_b = run_cli([a.format(cwd=cwd) for a in PLAN_B])
    if "diff" in wanted:
        runner.submit("diff")
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


def _one_error_line(run: Run) -> str:
    lines = run.err.strip().splitlines()
    assert "Traceback" not in run.err, str(run)
    assert len(lines) == 1, f"expected one line on stderr:\n{run}"
    return lines[0]


# -- commands ------------------------------------------------------------------------------------

def test_plan_writes_a_plan_that_loads(cli):
    import autopar

    run = cli.result("plan_a")
    assert run.rc == 0, str(run)
    assert run.err == "", f"no progress off a terminal:\n{run}"
    assert "autopar plan: mesh dp=2 (cpu), 2 devices" in run.out and "baselines" in run.out, str(run)
    assert "saved the plan to a.json" in run.out
    plan = autopar.load_plan(cli.cwd / "a.json")
    assert plan.placements["input:0"] == "S(0)"  # --hint input:0=dp=S(0)
    assert plan.memory_budget == 2**30  # --memory-budget 1GiB
    assert plan.training and plan.mesh_shape == (2,)


def test_plan_never_imports_a_file_named_like_a_package(cli):
    # `python -m autopar plan` from a directory holding ortools.py: planning imports the installed OR-Tools.
    run = cli.result("plan_a")
    assert run.rc == 0, str(run)
    assert not (cli.cwd / "SHADOWED").exists(), str(run)


def test_factory_imports_its_siblings_after_installed_packages(tmp_path, monkeypatch):
    from importlib.machinery import PathFinder

    from autopar.cli.target import import_target

    (tmp_path / "ortools.py").write_text(SHADOW)
    (tmp_path / "sibling_helper.py").write_text("BATCH = 4\n")
    (tmp_path / "sibling_models.py").write_text(
        "import sibling_helper\nfrom autopar.models import make\n\n\n"
        "def mlp():\n    return make('mlp', 'tiny', batch=sibling_helper.BATCH, device='meta')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        name, factory, file = import_target("sibling_models:mlp")
        model, inputs = factory()
    finally:
        helper = sys.modules.pop("sibling_helper", None)
        sys.modules.pop("sibling_models", None)
    assert name == "sibling_models:mlp" and Path(file) == tmp_path / "sibling_models.py"
    assert helper is not None and Path(helper.__file__) == tmp_path / "sibling_helper.py"
    assert inputs[0].shape[0] == 4
    assert sys.path[-1] == str(tmp_path)  # appended, after every installed package
    found = PathFinder.find_spec("ortools", sys.path)
    assert found is not None and Path(found.origin).parent.parent != tmp_path and found.origin != str(tmp_path / "ortools.py")
    assert not (tmp_path / "SHADOWED").exists()


def test_a_plan_from_the_cli_runs(cli):
    """The plan file lowers and runs: every device's program (simulated in this process) gives the
    model's own loss and gradients. (The demo test runs a saved plan on 4 gloo processes.)"""
    import torch

    import autopar
    from autopar.models import make

    assert cli.result("plan_a").rc == 0
    torch.manual_seed(0)
    model, (x, y) = make("mlp", "tiny", batch=8)  # real weights; the plan was made on meta
    loss, grads = autopar.simulate(model, cli.cwd / "a.json", (x, y))
    ref = model(x, y)
    ref.backward()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)


def test_plan_file_path_hint_with_spaces_inference(cli):
    import autopar

    rc, out, err = cli.plan_b  # MODULE as a .py path, a hint value with a space, --inference
    assert rc == 0, out + err
    plan = autopar.load_plan(cli.cwd / "b.json")
    assert plan.placements["layers.0.weight"] == "S(0), B"
    assert not plan.training and plan.axis_names == ("dp", "tp")


def test_show(cli):
    run = cli.result("show")
    assert run.rc == 0 and run.err == "", str(run)
    assert run.out.startswith("autopar plan: mesh dp=2 (cpu)")
    assert re.search(r"^layers\.0\s", run.out, re.M) and "step time" in run.out, str(run)


def test_explain(cli):
    run = cli.result("explain")
    assert run.rc == 0 and run.err == "", str(run)
    assert run.out.startswith("module layers.0:") and "layers.0.weight" in run.out, str(run)


def test_diff_with_console_script(cli):
    run = cli.result("diff")  # through the `autopar` console script where it is installed
    assert run.rc == 0 and run.err == "", str(run)
    assert run.out.startswith("plans differ (first -> second):")
    assert "training: True -> False" in run.out and "mesh: dp=2 (cpu) -> dp=2 x tp=1 (cpu)" in run.out, str(run)


@pytest.mark.slow
def test_demo_quick(cli):
    run = cli.result("demo")
    assert run.rc == 0, str(run)
    out = run.out
    for phase in ("[1/3] planning GPT-2 tiny", "[2/3] planning a small GPT", "[3/3] training it for 2 AdamW steps"):
        assert phase in out, str(run)
    assert out.count("autopar plan: mesh dp=2 x tp=4 (h100), 8 devices") == 1, str(run)
    assert "autopar plan: mesh dp=2 x tp=2 (cpu), 4 devices" in out and "megatron_tp" in out
    steps = re.findall(r"^\s+(\d)\s+([-\d.]+)\s+([-\d.]+)\s+\S+$", out, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2], str(run)
    par, ref = [float(a) for _, a, _ in steps], [float(b) for _, _, b in steps]
    assert par == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert "the sharded run matches the single-device run" in out
    assert "Traceback" not in run.err, str(run)


# -- errors: one line on stderr, exit 2 for a malformed command line, 1 otherwise ----------------------

@pytest.mark.parametrize("name", list(ERRORS))
def test_documented_error(cli, name):
    argv, _, code, says = ERRORS[name]
    run = cli.result(name)
    assert run.rc == code, str(run)
    line = _one_error_line(run)
    assert line.startswith(f"autopar {argv[0]}: error: "), str(run)
    for text in says:
        assert text in line, f"{text!r} not in: {line}"
    assert run.out == "", str(run)


# More errors, in this process (each subprocess costs seconds of imports): the same one line. The
# subprocesses above keep the path through `python -m autopar` (a fresh interpreter's stderr) covered.
MORE_ERRORS = {
    "bad_mesh": (["plan", "{cwd}/cli_models.py:mlp", "--mesh", "dp:2", "-o", "x.json"], 2,
                 ["--mesh 'dp:2'", "NAME=SIZE"]),
    "bad_kw": (["plan", "{cwd}/cli_models.py:mlp", "--mesh", "dp=2", "--kw", "8", "-o", "x.json"], 2,
               ["--kw '8'", "NAME=VALUE"]),
    "unknown_device": (["plan", "{cwd}/cli_models.py:mlp", "--mesh", "dp=2", "--device", "h900", "-o", "x.json"], 2,
                       ["unknown device preset 'h900'", "h100", "cpu"]),
    "plan_file_missing": (["show", "{cwd}/missing.json"], 1, ["no plan file at '{cwd}/missing.json'", "autopar plan"]),
    "plan_file_unreadable": (["show", "{cwd}/garbage.json"], 1, ["'{cwd}/garbage.json' is not a plan file",
                                                                 "invalid JSON"]),
    "factory_raises": (["plan", "{cwd}/cli_models.py:broken", "--mesh", "dp=2", "--kw", "batch=3", "-o", "x.json"], 1,
                       ["cli_models:broken(batch=3) raised ValueError: no data for batch 3", "cli_models.py:",
                        "in broken"]),
    "unknown_kw": (["plan", "{cwd}/cli_models.py:mlp", "--mesh", "dp=2", "--kw", "bogus=1", "-o", "x.json"], 2,
                   ["unexpected keyword argument 'bogus'", "mlp(batch=8, device='meta')"]),
    "bad_hint_syntax": (["plan", "m:f", "--mesh", "dp=2", "--hint", "layers.0.weight", "-o", "x.json"], 2,
                        ["--hint 'layers.0.weight'", "PATH=PLACEMENTS"]),
    "bad_hint_placement": (["plan", "m:f", "--mesh", "dp=2", "--hint", "input:0=tp=S(0)", "-o", "x.json"], 2,
                           ["--hint 'input:0=tp=S(0)'", "'tp'", "['dp']"]),
    "bad_hint_arity": (["plan", "m:f", "--mesh", "dp=2", "--hint", "w=S(0), B", "-o", "x.json"], 2,
                       ["--hint 'w=S(0), B'", "2 entries", "1 axes"]),
    "bad_target": (["plan", "just_a_module", "--mesh", "dp=2", "-o", "x.json"], 2, ["MODULE:FACTORY"]),
    "bad_memory_budget": (["plan", "m:f", "--mesh", "dp=2", "--memory-budget", "lots", "-o", "x.json"], 2,
                          ["--memory-budget", "60GiB"]),
    "missing_option": (["plan", "m:f", "--mesh", "dp=2"], 2, ["-o/--output", "autopar plan --help"]),
    "no_output_dir": (["plan", "m:f", "--mesh", "dp=2", "-o", "{cwd}/nodir/p.json"], 2, ["does not exist"]),
    "unknown_command": (["bogus"], 2, ["invalid choice: 'bogus'"]),
    "bad_nics_per_node": (["plan", "m:f", "--mesh", "dp=2", "--nics-per-node", "0", "-o", "x.json"], 2,
                          ["--nics-per-node", "positive whole number", "'0'"]),
    "binary_plan_file": (["show", "{cwd}/binary.json"], 1, ["not a plan file", "UTF-8"]),
    "factory_message_with_escapes": (["plan", "{cwd}/cli_models.py:evil", "--mesh", "dp=2", "-o", "x.json"], 1,
                                     ["raised ValueError: \\x1b[2J\\x1b]0;owned\\x07gone"]),
    "target_named_like_a_package": (["plan", "{cwd}/ortools.py:make", "--mesh", "dp=2", "-o", "x.json"], 1,
                                    ["'{cwd}/ortools.py' (", "has the name of the installed module 'ortools'",
                                     "rename your file"]),
}


@pytest.mark.parametrize("name", list(MORE_ERRORS))
def test_more_errors_in_process(tmp_path, name):
    (tmp_path / "cli_models.py").write_text(FACTORIES)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "garbage.json").write_text("{ this is not json")
    (tmp_path / "ortools.py").write_text(SHADOW)
    argv, code, says = MORE_ERRORS[name]
    rc, out, err = run_cli([a.format(cwd=tmp_path) for a in argv])
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not any(c in err for c in "\x1b\x07\r"), repr(err)  # control characters reach the terminal escaped
    assert not (tmp_path / "SHADOWED").exists()
    cmd = argv[0] if argv[0] in ("plan", "show") else None
    assert lines[0].startswith(f"autopar {cmd}: error: " if cmd else "autopar: error: "), err
    for text in says:
        text = text.format(cwd=tmp_path)
        assert text in lines[0], f"{text!r} not in: {lines[0]}"


def test_node_shape_reaches_the_plans_mesh(tmp_path):
    """--devices-per-node / --nics-per-node price the mesh's links (an axis over two nodes of four
    NICs each is slower than over one rail per GPU) and are saved with the plan."""
    import autopar

    (tmp_path / "cli_models.py").write_text(FACTORIES)
    links = {}
    for nics in ("8", "4"):
        out = tmp_path / f"p{nics}.json"
        rc, _, err = run_cli(["plan", f"{tmp_path}/cli_models.py:mlp", "--mesh", "dp=16", "--devices-per-node", "8",
                            "--nics-per-node", nics, "-o", str(out)])
        assert rc == 0, err
        plan = json.loads(out.read_text())
        assert plan["mesh"]["hardware"]["nics_per_node"] == int(nics)
        links[nics] = autopar.load_plan(out).mesh["links"]["dp"]
    assert links["4"]["bandwidth"] < links["8"]["bandwidth"]


def test_debug_shows_the_traceback(tmp_path):
    rc, out, err = run_cli(["--debug", "show", str(tmp_path / "missing.json")])
    assert rc == 1 and "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("autopar show: error: no plan file at")
    rc, out, err = run_cli(["show", str(tmp_path / "missing.json"), "--debug"])  # after the command as well
    assert rc == 1 and "Traceback (most recent call last)" in err


# -- in process: the parsers and the progress line -------------------------------------------------

@pytest.mark.gloo  # starts a Python process (the tier's guard counts any)
def test_help_and_argument_errors_do_not_import_torch():
    """``import autopar``, ``autopar --help`` and a malformed command line load neither torch nor the planner
    (``autopar/__init__.py`` loads its names on first use), so they answer at once."""
    code = (
        "import sys, contextlib, io\n"
        "import autopar\n"
        "assert 'torch' not in sys.modules, 'import autopar'\n"
        "from autopar.cli import main\n"
        "for argv in (['--help'], ['plan', '--help'], ['plan', 'm:f', '--mesh', 'dp=0', '-o', 'x.json'], ['nope']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "        try:\n"
        "            rc = main(argv)\n"
        "        except SystemExit as e:\n"
        "            rc = e.code\n"
        "    assert rc in (0, 2), (argv, rc)\n"
        "    assert 'torch' not in sys.modules, argv\n"
        "assert autopar.Mesh({'dp': 2}).size == 2 and 'torch' not in sys.modules, 'Mesh'\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@pytest.mark.gloo  # starts a Python process
def test_python_m_autopar_imports_no_file_named_like_a_dependency(tmp_path):
    """``python -m autopar`` (the current directory first on ``sys.path``) drops that directory before it imports
    autopar's dependencies: a ``json.py`` or ``numpy.py`` lying there is never run, and ``show`` works."""
    from test_plan import make_plan

    make_plan().save(tmp_path / "plan.json")
    for name in ("json", "numpy", "networkx", "ortools"):
        (tmp_path / f"{name}.py").write_text(SHADOW)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-m", "autopar", "show", "plan.json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0 and run.stdout.startswith("autopar plan: mesh"), run.stderr[-2000:]
    assert not (tmp_path / "SHADOWED").exists()


def test_parsers():
    from autopar.cli.args import parse_bytes, parse_kw, parse_mesh, split_hint
    from autopar.cli.errors import CLIError

    assert parse_mesh("dp=8, tp=8") == {"dp": 8, "tp": 8} and list(parse_mesh("tp=2,dp=4")) == ["tp", "dp"]
    for bad in ("dp", "dp=0", "dp=2,dp=2", "8", "dp=2,", "2dp=2"):
        with pytest.raises(CLIError) as e:
            parse_mesh(bad)
        assert e.value.code == 2
    assert parse_kw(["batch=64", "size=125M", "dims=(1, 2)", "name='x'", "flag=True", "text="]) == \
        {"batch": 64, "size": "125M", "dims": (1, 2), "name": "x", "flag": True, "text": ""}
    assert split_hint("layers.*.attention.wq.weight=S(0),B") == ("layers.*.attention.wq.weight", "S(0),B")
    assert split_hint("input:0=dp=S(0), tp=B") == ("input:0", "dp=S(0), tp=B")
    assert parse_bytes("60GiB") == 60 * 2**30 and parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1.5e3") == 1500
    assert parse_bytes("2 M") == 2 * 2**20


def test_progress_line_only_on_a_terminal(monkeypatch):
    from autopar.cli.progress import PLAN_PHASES, Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    with Progress("planning", PLAN_PHASES, interval=0.01) as p:
        time.sleep(0.05)
        print("autopar: capture       1.00 s", file=sys.stderr)
        time.sleep(0.05)
        assert p.phase == "fold"
    assert sys.stderr is tty
    text = tty.getvalue()
    assert "planning: capture" in text and "planning: fold" in text
    assert "\r\033[Kautopar: capture       1.00 s\n" in text  # the status line is cleared first
    assert text.endswith("\r\033[K")  # and gone at the end

    quiet = io.StringIO()
    monkeypatch.setattr(sys, "stderr", quiet)
    with Progress("planning", PLAN_PHASES, interval=0.01):
        time.sleep(0.03)
    assert quiet.getvalue() == "" and sys.stderr is quiet
