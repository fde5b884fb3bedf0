"""Shared test configuration: figures that tests report go into pytest's closing summary."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

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
            held.append(WorkerPool(4, timeout=300.0, start_timeout=300.0))
        return held[0]

    yield get
    for p in held:
        p.close()
