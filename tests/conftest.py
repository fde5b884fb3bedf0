"""Shared test configuration: figures that tests report go into pytest's closing summary, and the
markers of the test tiers.

Markers (registered in pyproject.toml): ``gloo`` marks a test that starts processes (gloo ranks
through ``autopar.launch`` or a ``WorkerPool``, torchrun, the CLI or any other subprocess); ``slow`` one
that takes more than about 10 s alone on an idle machine. ``make test-fast`` runs
``pytest -m "not gloo and not slow"`` with ``AUTOPAR_TEST_NO_PROCESSES=1``: there a test that starts a
process fails naming itself, so a test that should be marked ``gloo`` cannot slow the fast tier
unnoticed. A test is marked ``gloo`` by ``pytestmark`` or a decorator in its file, or here, by the
fixtures it uses: ``gloo_pool4`` and those its module lists in ``PROCESS_FIXTURES``.
"""

import multiprocessing.process
import os
import subprocess

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Fixtures that start processes: a test that uses one (directly or through another fixture) is
#: marked ``gloo``. A test module adds its own in ``PROCESS_FIXTURES`` (a set of fixture names).
PROCESS_FIXTURES = frozenset({"gloo_pool4"})

#: Lines that tests want shown after the run (e.g. how many rule signatures were proven).
REPORT: list[str] = []


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker hands its lines to the controller, which prints them."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["autopar_report"] = list(REPORT)


class _XdistReport:
    """xdist's hook, registered only when the xdist plugin is active (pytest refuses a hook it does
    not know, so under ``-p no:xdist`` it must not exist even though xdist is importable)."""

    def pytest_testnodedown(self, node, error):
        """The controller keeps each finished worker's lines."""
        REPORT.extend(getattr(node, "workeroutput", {}).get("autopar_report", []))


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistReport(), "autopar-xdist-report")


#: the modules that take longest (docs/benchmarks.md, "Suite time"), collected first: ``make test``
#: hands whole modules to its two workers in collection order, and a long one taken last runs alone
#: while the other worker idles (longest first is the classic makespan order)
LONGEST_FIRST = ("test_ladder.py", "test_compiled.py", "test_liveness_fast.py", "test_ladder_cutoff.py",
                 "test_launch.py", "test_replan.py", "test_dropless.py", "test_kept_gathers.py",
                 "test_checkpoint_search.py", "test_pipeline_context.py")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark ``gloo`` every test that uses a fixture that starts processes; the longest modules first."""
    for item in items:
        starting = PROCESS_FIXTURES | frozenset(getattr(item.module, "PROCESS_FIXTURES", ()))
        if starting.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gloo)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


def _no_processes(config) -> bool:
    """Whether this run starts no process: ``AUTOPAR_TEST_NO_PROCESSES=1`` (``make test-fast``), or a
    ``-m`` expression that leaves out every ``gloo`` test."""
    if os.environ.get("AUTOPAR_TEST_NO_PROCESSES", "") not in ("", "0"):
        return True
    expr = config.getoption("markexpr", "") or ""
    if "gloo" not in expr:
        return False
    try:  # marker expressions are Python's boolean syntax over names: a gloo test, other markers off
        return not eval(compile(expr, "-m", "eval"), {"__builtins__": {}}, _Markers(gloo=True))
    except Exception:  # noqa: BLE001 - an expression beyond that syntax: no check
        return False


class _Markers(dict):
    def __missing__(self, name: str) -> bool:
        return False


def _refuse(kind: str):
    """A stand-in for ``Process.start`` / ``Popen.__init__`` that fails the running test."""

    def start(self, *args, **kwargs):
        test = os.environ.get("PYTEST_CURRENT_TEST", "a test").rsplit(" ", 1)[0]
        what = kind if kind != "subprocess" else f"subprocess {str(args[0] if args else kwargs.get('args'))[:120]}"
        # pytest.fail, not an Exception: a fixture that skips on any Exception cannot hide it
        pytest.fail(f"{test} starts a process ({what}) in a run that starts none (the fast tier: "
                    f"AUTOPAR_TEST_NO_PROCESSES=1 or -m 'not gloo'): mark the test gloo (pytestmark, "
                    f"@pytest.mark.gloo or its module's PROCESS_FIXTURES)")

    return start


@pytest.fixture(scope="session", autouse=True)
def _fast_tier_starts_no_process(request):
    """In a run that starts no process, starting one fails the test that does. Set up in the
    process that runs the tests (an xdist worker, not the controller that starts the workers)."""
    if not _no_processes(request.config):
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing: gloo ranks or a pool"))
    mp.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
    yield
    mp.undo()


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.write_sep("-", "autopar figures")
        for line in REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def gloo_pool4():
    """``get()`` -> this pytest process's 4-rank gloo ``WorkerPool``, shared by every module that runs
    its ranks' functions on one (``make test`` keeps a file on one xdist worker, so each worker starts
    one pool instead of one per module: 4 processes importing torch and autopar, seconds each). The
    functions a pool runs build their own models and groups, so modules share nothing else; a pool
    that a run broke (a rank died or timed out) is replaced for the next module."""
    from autopar.runtime.pool import WorkerPool

    held: list = []

    def get():
        if held and held[0].broken:
            held.pop().close()
        if not held:
            # a run took at most 32 s under load (tests/test_dcp.py), the start-up (4 processes
            # importing torch) tens of seconds: a hang fails in minutes
            held.append(WorkerPool(4, timeout=120.0, start_timeout=180.0))
        return held[0]

    yield get
    for p in held:
        p.close()
