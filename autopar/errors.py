"""Exceptions autopar raises on purpose: each message says what went wrong and what to do."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises deliberately."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph (untraceable code, unsupported inputs or outputs,
    missing gradients)."""


class PlanError(AutoparError, ValueError):
    """A plan that cannot be used: unreadable file, wrong schema version, unknown module, a plan
    made for another graph."""
