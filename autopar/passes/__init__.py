"""Passes over the IR: ``search`` (fold, strategies, cost, merge, solve, recomputation, kept gathers,
pipeline stages) and ``lower`` (the plan to per-device programs); see docs/design/search.md and lowering.md. The
planners that run them are ``autopar.planner``."""
