"""Outcome counters and the live service-time estimates behind admission and
``retry_after_ms``: a mean per engine kind, and per request from its size
(``broker.service``)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from broker.service import BatchLevels, ServiceModel

if TYPE_CHECKING:
    from broker.records import Job

#: Bounds of any ``retry_after_ms`` we advertise: below 50 ms a client would
#: hammer the node; above 30 s the advice is useless (callers should give up).
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 30_000


class Stats:
    """Counters by outcome and, per engine kind, an EWMA of service time
    (seconds per request): a rule answer (~1 ms) must not dilute the model's
    (seconds), nor the model's make rule requests look slow. ``sizes`` holds
    the per-token rates that predict one request's service from its size and
    batch level; ``levels`` follows each worker's running requests over time
    (the broker calls ``levels.running`` on every change of a worker's running
    set and ``levels.first_token`` on a request's first token) to tell each
    finished request's batch level."""

    #: EWMA weight of the newest sample (about the last 10 requests dominate).
    ALPHA = 0.2

    def __init__(self, initial_service_s: float = 1.0) -> None:
        self.counters: Counter[str] = Counter()
        self.initial_service_s = initial_service_s
        self._service: dict[str, float] = {}
        self._samples: Counter[str] = Counter()
        self.sizes = ServiceModel()
        self.levels = BatchLevels()

    @property
    def service_s(self) -> float:
        """The model's mean service time (s)."""
        return self.service_time("llm")

    @service_s.setter
    def service_s(self, seconds: float) -> None:
        self._service["llm"] = seconds

    @property
    def samples(self) -> int:
        """How many model service times were observed."""
        return self._samples["llm"]

    def service_time(self, kind: str) -> float:
        """Mean service time of ``kind``'s workers (s); the initial guess until measured."""
        return self._service.get(kind, self.initial_service_s)

    def samples_of(self, kind: str) -> int:
        """How many service times of ``kind`` were observed."""
        return self._samples[kind]

    def count(self, outcome: str) -> None:
        """Add one to the counter ``outcome``."""
        self.counters[outcome] += 1

    def observe_service(self, seconds: float, kind: str = "llm") -> None:
        """Fold one request's dispatch-to-final time into ``kind``'s EWMA."""
        seconds = max(0.0, seconds)
        self._samples[kind] += 1
        if self._samples[kind] == 1:
            self._service[kind] = seconds  # the first measurement beats the guess
        else:
            self._service[kind] += self.ALPHA * (seconds - self._service[kind])

    def observe_final(self, job: Job, usage: object, now: float, max_tokens: int) -> None:
        """A successful FINAL of ``job`` (dispatched) at ``now``: its dispatch-to-final
        time joins the mean; with a first token and the worker's ``usage``, its
        prefill and decode times teach ``sizes`` at the batch levels it ran at
        (``levels``; call before its worker's running set drops it).
        ``max_tokens``: the worker's limit."""
        assert job.dispatched_at is not None
        total_s = now - job.dispatched_at
        self.observe_service(total_s, job.kind)
        if job.first_token_at is not None:
            ttft_s = job.first_token_at - job.dispatched_at
            at = (1.0, 1.0) if job.worker is None else self.levels.levels(job.worker, job.rid, now)
            self.sizes.observe(job.kind, job.req, max_tokens, ttft_s, total_s, usage, *at)

    def snapshot(self) -> dict[str, dict[str, float | int | dict[str, float] | None]]:
        """For ``status``, per engine kind observed: ``mean_ms`` (dispatch to final),
        ``samples``, and the learned per-token rates (``ServiceModel.snapshot``:
        ``prefill_ms_per_token``, ``decode_ms_per_token``, ...) once they exist,
        and ``decode_ms_per_token_by_level`` (``{"1": 31.0, "4": 85.0}``) once a
        level above 1 was measured."""
        return {
            kind: {
                "mean_ms": round(self._service[kind] * 1000, 1),
                "samples": self._samples[kind],
                **(self.sizes.snapshot(kind) or {}),
                **self._by_level(kind),
            }
            for kind in sorted(self._service)
        }

    def _by_level(self, kind: str) -> dict[str, dict[str, float]]:
        """``decode_ms_per_token_by_level`` of ``kind`` once a level above 1 was
        measured (a one-slot pool's status stays as it was)."""
        by_level = self.sizes.decode_by_level(kind)
        if not any(level != "1" for level in by_level):
            return {}
        return {"decode_ms_per_token_by_level": by_level}

    def retry_after_ms(self, queued: int, slots: int, kind: str = "llm") -> int:
        """Time until the queue ahead would have drained, in ms, clamped.

        Little's law over the pool: ``queued / slots`` rounds of one mean
        service time each, plus the round in progress.

        Args:
            queued: requests waiting ahead of a retry.
            slots: sequences the pool runs at once (>= 1).
            kind: whose service time applies (``llm`` or ``rules``).
        """
        estimate = (queued / max(1, slots) + 1) * self.service_time(kind) * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))
