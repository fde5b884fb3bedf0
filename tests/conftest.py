"""Shared test configuration: figures that tests report go into pytest's closing summary."""

import os

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
