"""The IR: captured graphs, SBP placements, op sharding rules."""
