"""Proving sharding rules by execution: ``interp`` runs one op's rule on every device's blocks in one
process and reassembles the result; ``check`` does that for every op and strategy of a captured
graph, against the op on whole tensors, with a mutation test of the rules themselves."""
