"""The broker's outcome counters (``status``'s ``counters``).

Service times are the estimator's (``broker.service_time.ServiceEstimator``).
"""

from __future__ import annotations

from collections import Counter


class Stats:
    """Counters by outcome: ``admitted``, ``ok``, ``shed_<reason>``, ... (one name
    per outcome, counted once per request)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()

    def count(self, outcome: str) -> None:
        """Add one to the counter ``outcome``."""
        self.counters[outcome] += 1
