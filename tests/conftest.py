"""Shared test configuration: figures that tests report go into pytest's closing summary."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Lines that tests want shown after the run (e.g. how many rule signatures were proven).
REPORT: list[str] = []


def pytest_terminal_summary(terminalreporter):
    if REPORT:
        terminalreporter.write_sep("-", "autopar figures")
        for line in REPORT:
            terminalreporter.write_line(line)
