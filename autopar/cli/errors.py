"""The CLI's one failure type and its exit codes (standard library only: every CLI module imports it)."""

from __future__ import annotations

from typing import Optional

#: Exit codes: a malformed command line, and a failure while doing the work.
USAGE, FAILURE = 2, 1


class CLIError(Exception):
    """A failure the CLI reports as one line: ``message`` says what, where and what to do."""

    def __init__(self, message: str, code: int = FAILURE, prog: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.prog = prog


__all__ = ["FAILURE", "USAGE", "CLIError"]
