"""Each worker's count of running requests over time: the batch level a request ran at.

A worker with S slots decodes all its running sequences in one step, so a
request's per-token time depends on how many run beside it
(``broker.service_model``); ``BatchLevels`` tells that count for each finished
request, and ``broker.service_time.ServiceEstimator`` owns one.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field


@dataclass
class _Clock:
    """One worker's running requests, integrated over time (``BatchLevels``).

    ``area`` is request-seconds up to ``since``; ``marks`` holds, per running
    request, (time, area, running) at its dispatch and, once seen, at its first
    token."""

    running: int = 0
    since: float = 0.0
    area: float = 0.0
    marks: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)

    def area_at(self, now: float) -> float:
        return self.area + self.running * max(0.0, now - self.since)


class BatchLevels:
    """Each worker's count of running requests over time, so that a finished
    request's batch level is known: the time-weighted mean count over its prefill
    (dispatch to first token) and over its decode (first token to FINAL).

    Cheaper than it sounds (O(1) per dispatch, token and FINAL, besides the
    worker's own running set) and better than the mean of the counts at dispatch
    and at FINAL, which cannot tell a request that ran beside three others for
    most of its life from one they joined just before it ended. Times are the
    broker's clock (s), passed in.
    """

    def __init__(self) -> None:
        self._clocks: dict[bytes, _Clock] = {}

    def running(self, worker: bytes, rids: Collection[int], now: float) -> None:
        """``worker`` runs ``rids`` from ``now`` on: call after every change of its
        running set (dispatch, FINAL; ``()`` when it is lost). A new rid is marked
        dispatched at ``now``; the marks of rids no longer running are dropped."""
        if not rids:
            self._clocks.pop(worker, None)
            return
        clock = self._clocks.setdefault(worker, _Clock(since=now))
        clock.area = clock.area_at(now)
        clock.since = now
        clock.running = len(rids)
        for rid in [r for r in clock.marks if r not in rids]:
            del clock.marks[rid]
        for rid in rids:
            if rid not in clock.marks:
                clock.marks[rid] = [(now, clock.area, clock.running)]

    def first_token(self, worker: bytes, rid: int, now: float) -> None:
        """``rid``'s first token arrived from ``worker`` at ``now``: its prefill ended."""
        clock = self._clocks.get(worker)
        marks = None if clock is None else clock.marks.get(rid)
        if clock is not None and marks is not None and len(marks) == 1:
            marks.append((now, clock.area_at(now), clock.running))

    def levels(self, worker: bytes, rid: int, now: float) -> tuple[float, float]:
        """(prefill level, decode level) of ``rid`` finishing on ``worker`` at ``now``
        (before its FINAL is taken out of the running set). (1.0, 1.0) for a
        request never marked; a phase of no duration has the count at its start."""
        clock = self._clocks.get(worker)
        marks = None if clock is None else clock.marks.get(rid)
        if clock is None or not marks:
            return 1.0, 1.0
        end = (now, clock.area_at(now), clock.running)
        first = marks[1] if len(marks) > 1 else end
        return _mean_level(marks[0], first), _mean_level(first, end)


def _mean_level(start: tuple[float, float, int], end: tuple[float, float, int]) -> float:
    """Time-weighted mean running count between two marks (time, area, running)."""
    span = end[0] - start[0]
    return (end[1] - start[1]) / span if span > 0 else float(start[2])
