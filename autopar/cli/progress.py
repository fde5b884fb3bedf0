"""A live status line for the CLI's long phases, shown only on a terminal.

``autopar.plan(..., progress=True)`` prints one line per finished phase (``autopar: capture 1.8 s``)
to ``sys.stderr``; between those lines nothing moves for seconds. ``Progress`` adds a status line
(``| planning: solve  12 s``) that redraws itself while the work runs. Lines that anybody writes to
``sys.stderr`` meanwhile (the phase lines, warnings) clear the status line first, so the terminal
never shows a status glued to a message. When stderr is not a terminal ``Progress`` does nothing at
all: no thread, no escape codes, stderr untouched.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from typing import Optional, Sequence, TextIO

#: The phases ``autopar.plan`` reports, in order (``planner/intra.py``'s ``_Clock``).
PLAN_PHASES = ("capture", "fold", "strategies", "cost", "merge", "recipes", "solve")

_LAP = re.compile(r"^autopar: (\w+)\s")
_FRAMES = "|/-\\"
_CLEAR = "\r\033[K"


def is_terminal(stream: Optional[TextIO] = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is a terminal; False for a closed or odd stream."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _Stderr:
    """Stands in for ``sys.stderr`` while a status line is shown: clears it before every write and
    learns the current phase from ``autopar: <phase> ...`` lines."""

    def __init__(self, owner: "Progress", real: TextIO):
        self._owner = owner
        self._real = real

    def write(self, text: str) -> int:
        with self._owner._lock:
            self._owner._clear()
            n = self._real.write(text)
            self._owner._at_line_start = text.endswith("\n") if text else self._owner._at_line_start
            for line in text.splitlines():
                m = _LAP.match(line)
                if m:
                    self._owner._finished(m.group(1))
            return n

    def flush(self) -> None:
        self._real.flush()

    def __getattr__(self, name: str):
        return getattr(self._real, name)


class Progress:
    """``with Progress("planning", PLAN_PHASES): ...``: a self-redrawing status line on stderr
    while the block runs, if stderr is a terminal (``enabled`` overrides the check)."""

    def __init__(self, label: str, phases: Sequence[str] = (), enabled: Optional[bool] = None,
                 interval: float = 0.2):
        self.label = label
        self.phases = tuple(phases)
        self.phase = self.phases[0] if self.phases else ""
        self.enabled = is_terminal() if enabled is None else enabled
        self.interval = interval
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._real: Optional[TextIO] = None
        self._shown = False
        self._at_line_start = True
        self._start = 0.0
        self._tick = 0

    # -- called with the lock held ----------------------------------------------------------------
    def _clear(self) -> None:
        if self._shown and self._real is not None:
            self._real.write(_CLEAR)
            self._shown = False

    def _draw(self) -> None:
        if self._real is None or not self._at_line_start:
            return
        elapsed = time.monotonic() - self._start
        what = f"{self.label}: {self.phase}" if self.phase else self.label
        self._real.write(f"{_CLEAR}{_FRAMES[self._tick % len(_FRAMES)]} {what}  {elapsed:.0f} s")
        self._real.flush()
        self._shown = True
        self._tick += 1

    def _finished(self, phase: str) -> None:
        if phase in self.phases:
            i = self.phases.index(phase)
            self.phase = self.phases[i + 1] if i + 1 < len(self.phases) else "finishing"

    # -- the drawing thread, and the context manager ------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._draw()

    def __enter__(self) -> "Progress":
        if not self.enabled:
            return self
        self._start = time.monotonic()
        self._real = sys.stderr
        sys.stderr = _Stderr(self, self._real)  # type: ignore[assignment]
        with self._lock:
            self._draw()
        self._thread = threading.Thread(target=self._run, name="autopar-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or self._real is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._clear()
            self._real.flush()
        if isinstance(sys.stderr, _Stderr) and sys.stderr._owner is self:
            sys.stderr = self._real  # type: ignore[assignment]
        self._real = None


__all__ = ["PLAN_PHASES", "Progress", "is_terminal"]
