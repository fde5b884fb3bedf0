"""Exceptions autopar raises on purpose: each message says what went wrong and what to do."""

from __future__ import annotations

from typing import Optional


class AutoparError(Exception):
    """Base class of every error autopar raises deliberately."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph (untraceable code, unsupported inputs or outputs,
    missing gradients)."""


class PlacementError(AutoparError, ValueError):
    """A placement string or object that cannot be understood."""


class MeshError(AutoparError, ValueError):
    """A mesh description that cannot be used (bad axes, device, links)."""


class HintError(AutoparError, ValueError):
    """A hint that names nothing, asks for the impossible, or contradicts another hint."""


class RecipeError(AutoparError, ValueError):
    """A recipe that does not apply to this model or mesh."""


class InfeasibleError(AutoparError):
    """No choice of strategies fits the memory budget (or the hints)."""


class LoweringError(AutoparError):
    """A plan that cannot be turned into a program for this graph."""


class CompileError(AutoparError):
    """The model, mesh, plan and process group do not go together."""


class SimulationError(AutoparError):
    """A simulated rank failed."""


class MaterializeError(AutoparError):
    """A meta tensor whose values cannot be rebuilt."""


class LaunchError(AutoparError):
    """A launched run failed: a rank raised, a rank died, the run timed out, or there is no (or the
    wrong) process group. ``rank`` is the failing rank and ``exitcode`` its exit code where known."""

    def __init__(self, message: str, rank: Optional[int] = None, exitcode: Optional[int] = None):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode

    def __reduce__(self):
        return (type(self), (str(self), self.rank, self.exitcode))


class CollectiveError(AutoparError, RuntimeError):
    """A collective that cannot complete: no backend, or ranks that stopped agreeing."""


class PlanError(AutoparError, ValueError):
    """A plan that cannot be used: unreadable file, wrong schema version, unknown module, a plan
    made for another graph."""


class ArgumentError(AutoparError, TypeError, ValueError):
    """An argument of autopar's API of the wrong type or out of range (a function where a model
    belongs, a negative budget, a hint value that is not a placement). It is a ``TypeError`` and a
    ``ValueError`` too, as the checks it replaced raised one or the other."""
