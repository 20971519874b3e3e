"""Fencing the workers in: per-worker cgroups (v2, v1, none), their cores and nice levels."""
