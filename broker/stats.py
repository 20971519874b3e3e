"""The broker's outcome counters (``status``'s ``counters``).

Service times are the estimator's (``broker.service_time.ServiceEstimator``).
"""

from __future__ import annotations

from collections import Counter

from broker.kinds import REFUSALS, SIDES, Refusal, Side


class Stats:
    """Counters by outcome: ``admitted``, ``ok``, ``shed_<reason>``, ... (one name
    per outcome, counted once per request)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        #: CURVE handshakes refused, by socket and cause (counted per attempt: a
        #: peer with the wrong server key retries every reconnect interval).
        self.refused: Counter[tuple[Side, Refusal]] = Counter()

    def count(self, outcome: str) -> None:
        """Add one to the counter ``outcome``."""
        self.counters[outcome] += 1

    def refuse(self, side: Side, cause: Refusal) -> None:
        """Count one CURVE handshake refused on ``side`` for ``cause``."""
        self.refused[(side, cause)] += 1

    def refusals(self) -> dict[str, dict[str, int]]:
        """``{side: {cause: count}}``, every side and cause present (0 if none)."""
        return {s: {c: self.refused[(s, c)] for c in REFUSALS} for s in SIDES}
