"""Memory pressure of the node, read from its own cgroup, as a level for the broker.

psutil's ``virtual_memory()`` describes the host, not the cgroup the node lives
in, so the reading comes from the node's cgroup (``node.sandbox``). The figure
compared against the budget is the *working set*: usage minus inactive file
pages, as the kubelet computes it, because the mmapped weights sit in page
cache that the kernel reclaims before it OOM-kills anything — counting them
would make a healthy node look full.

Levels: ``ok`` -> ``high`` at ``high_pct`` of the budget (or when v2 reports
new ``memory.high`` events) -> ``critical`` at ``critical_pct``; back to ``ok``
only below ``clear_pct`` (hysteresis, so admission does not flap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from node.config import PressureSection
from node.units import parse_size

if TYPE_CHECKING:
    from node.sandbox import MemoryReading


class MemorySource(Protocol):
    """Where readings come from (the worker pool; a fake in tests)."""

    def memory(self, worker_id: str | None = None) -> MemoryReading | None: ...


class PressureMonitor:
    """Polls the node's cgroup and says when the pressure level changes."""

    def __init__(
        self, settings: PressureSection, source: MemorySource, default_budget: int | None = None
    ) -> None:
        self.settings = settings
        self.source = source
        self.default_budget = default_budget
        self.level = "ok"
        self._next_poll = 0.0
        self._high_events: int | None = None
        self._last: dict[str, Any] = {}

    def budget(self, reading: MemoryReading) -> int | None:
        """Bytes the node may use: configured, else its cgroup limit, else the default
        the node computed (its workers' limits plus its own share)."""
        if self.settings.budget:
            return parse_size(self.settings.budget)
        return reading.limit if reading.limit is not None else self.default_budget

    def poll(self, now: float) -> str | None:
        """At most every ``poll_ms``: the new level if it changed, else None."""
        if now < self._next_poll:
            return None
        self._next_poll = now + self.settings.poll_ms / 1000
        reading = self.source.memory(None)
        if reading is None:
            return None
        level = self._classify(reading)
        if level == self.level:
            return None
        self.level = level
        return level

    def _classify(self, reading: MemoryReading) -> str:
        s = self.settings
        budget = self.budget(reading)
        working_set = reading.working_set
        pct = 100.0 * working_set / budget if budget else 0.0
        new_high_events = (
            reading.high_events is not None
            and self._high_events is not None
            and reading.high_events > self._high_events
        )
        self._high_events = reading.high_events
        self._last = {
            "working_set": working_set,
            "budget": budget,
            "used_pct": round(pct, 1),
            "current": reading.current,
            "inactive_file": reading.inactive_file,
        }
        if pct >= s.critical_pct:
            return "critical"
        if pct >= s.high_pct or new_high_events:
            return "high"
        if self.level != "ok" and pct >= s.clear_pct:
            return "high"  # hysteresis: stay shedding until clearly below
        return "ok"

    def snapshot(self) -> dict[str, Any]:
        """For ``status``: the level and the last reading behind it."""
        return {"level": self.level, **self._last}
