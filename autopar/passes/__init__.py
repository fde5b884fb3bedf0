"""Passes over the IR: fold, strategies, merge, solve, lower (see docs/architecture.md)."""
