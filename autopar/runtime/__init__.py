"""Running sharded programs: the single-process SPMD simulator and rule verification."""
