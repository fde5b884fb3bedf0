"""Running ``autopar.cli.main`` in the test process, for the CLI tests."""

from __future__ import annotations

import contextlib
import io
import warnings


def run_cli(argv: list) -> tuple[int, str, str]:
    """``autopar.cli.main(argv)`` in this process: (exit code, stdout, stderr)."""
    from autopar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()
