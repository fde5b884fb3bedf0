"""Cost model: compute, communication and memory per strategy (issue: cost model and search)."""
