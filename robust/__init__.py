"""Byzantine-robust reduction of one part of a group exchange: validation, screening and the
aggregation rules. Shared by the worker's reducer and the coordinator, which re-runs a
reduction to check a reducer accused with evidence; may import protocol and compression only."""
