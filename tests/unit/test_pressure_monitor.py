"""The pressure monitor's levels and budget, on fake readings."""

from __future__ import annotations

from capacitykit import memory_reading
from node.config import PressureSection
from node.pressure import PressureMonitor
from node.sandbox.driver import MemoryReading

MiB = 1 << 20


class FakeSource:
    def __init__(self) -> None:
        self.reading = memory_reading()

    def memory(self, worker_id: str | None = None) -> MemoryReading | None:
        return self.reading

    def use(
        self,
        current_mib: int,
        inactive_mib: int = 0,
        limit_mib: int | None = None,
    ) -> None:
        self.reading = memory_reading(
            current_mib * MiB,
            limit=None if limit_mib is None else limit_mib * MiB,
            inactive_file=inactive_mib * MiB,
        )


def test_levels_follow_the_working_set_with_hysteresis() -> None:
    src = FakeSource()
    mon = PressureMonitor(PressureSection(poll_ms=0), src, default_budget=1000 * MiB)
    levels = []
    for current, inactive in [(500, 0), (900, 0), (900, 300), (960, 0), (800, 0), (700, 0)]:
        src.use(current, inactive)
        levels.append(mon.poll(float(len(levels))) or mon.level)
    # 90 % high; reclaimable cache does not count; 96 % critical; 80 % stays high
    # (above clear_pct 75); 70 % clears.
    assert levels == ["ok", "high", "ok", "critical", "high", "ok"]


def test_the_cgroup_limit_wins_over_the_default_budget() -> None:
    src = FakeSource()
    mon = PressureMonitor(PressureSection(poll_ms=0), src, default_budget=10_000 * MiB)
    src.use(900, limit_mib=1000)
    assert mon.poll(0.0) == "high"
    assert mon.snapshot()["budget"] == 1000 * MiB


def test_near_limit_counts_the_working_set_not_the_page_cache() -> None:
    source = FakeSource()
    source.use(58, limit_mib=64)  # 90.6 % of memory.max: the kernel reclaims its own pages
    assert source.reading.working_set == 58 * MiB and source.reading.near_limit
    source.use(63, inactive_mib=10, limit_mib=64)  # mostly page cache: reclaim is cheap
    assert source.reading.working_set == 53 * MiB and not source.reading.near_limit
    source.use(63)  # no limit: never near it
    assert not source.reading.near_limit
