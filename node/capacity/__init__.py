"""The memory plan: what fits in the budget (from GGUF metadata), the budget itself, and
the per-worker cgroup memory limits that follow from the plan."""
