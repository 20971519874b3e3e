"""Outcome counters and the live service-time estimate behind ``retry_after_ms``."""

from __future__ import annotations

from collections import Counter

#: Bounds of any ``retry_after_ms`` we advertise: below 50 ms a client would
#: hammer the node; above 30 s the advice is useless (callers should give up).
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 30_000


class Stats:
    """Counters by outcome and an EWMA of service time (seconds per request)."""

    #: EWMA weight of the newest sample (about the last 10 requests dominate).
    ALPHA = 0.2

    def __init__(self, initial_service_s: float = 1.0) -> None:
        self.counters: Counter[str] = Counter()
        self.service_s = initial_service_s
        self.samples = 0

    def count(self, outcome: str) -> None:
        """Add one to the counter ``outcome``."""
        self.counters[outcome] += 1

    def observe_service(self, seconds: float) -> None:
        """Fold one request's dispatch-to-final time into the EWMA."""
        seconds = max(0.0, seconds)
        self.samples += 1
        if self.samples == 1:
            self.service_s = seconds  # the first measurement beats the guess
        else:
            self.service_s += self.ALPHA * (seconds - self.service_s)

    def retry_after_ms(self, queued: int, slots: int) -> int:
        """Time until the queue ahead would have drained, in ms, clamped.

        Little's law over the pool: ``queued / slots`` rounds of one mean
        service time each, plus the round in progress.

        Args:
            queued: requests waiting ahead of a retry.
            slots: sequences the pool runs at once (>= 1).
        """
        estimate = (queued / max(1, slots) + 1) * self.service_s * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))
