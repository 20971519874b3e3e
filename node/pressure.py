"""Memory pressure of the node and CPU pressure of the host, as levels for the broker.

**Memory.** psutil's ``virtual_memory()`` describes the host, not the cgroup
the node lives in, so the reading comes from the node's cgroup
(``node.sandbox.cgroups``). The figure compared against the budget is the *working
set*: usage minus inactive file pages, as the kubelet computes it, because the
mmapped weights sit in page cache that the kernel reclaims before it OOM-kills
anything — counting them would make a healthy node look full. The budget is
never above the tightest limit on the node's cgroup path (``node.capacity.budget``), so
``critical`` comes before the OOM killer.

Levels: ``ok`` -> ``high`` at ``high_pct`` of the budget (or when v2 reports
new ``memory.high`` events) -> ``critical`` at ``critical_pct``; back to ``ok``
only below ``clear_pct`` (hysteresis, so admission does not flap).

**CPU.** Pressure stall information (PSI, Documentation/accounting/psi.rst):
``some avg10`` is the share of the last ~10 s (an exponential average the
kernel updates every 2 s) in which at least one runnable task waited for a
CPU. Read from the node cgroup's ``cpu.pressure`` on cgroup v2 (the node's own
tasks), else the host's ``/proc/pressure/cpu``, or from the file
``pressure.cpu_psi`` names (e.g. the host's main workload's cgroup: "is the
workload the node must protect short of CPU?"); where none can be read (a
kernel without CONFIG_PSI, or booted with ``psi=0``) CPU pressure is not
measured, stays ``ok`` and ``status`` says why. ``ok`` -> ``high`` at
``cpu_warn_pct``, back to ``ok`` below ``cpu_clear_pct``. The model's own
threads count too: a pool with more threads than cores raises it by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from broker.kinds import CpuLevel
from node.capacity.budget import CgroupLimit, cut_to_limit
from node.config import PressureSection
from node.observe.logs import event_extra
from node.units import parse_size

if TYPE_CHECKING:
    from node.sandbox.driver import MemoryReading

log = logging.getLogger("edgenode.pressure")

#: Where the host-wide PSI files are, under /proc (psi.rst).
PROC_PRESSURE = "pressure"
#: Why a PSI file may be missing or unreadable (psi.rst: CONFIG_PSI, the psi= boot flag).
NO_PSI_HINT = "a kernel without CONFIG_PSI, or booted with psi=0"


class MemorySource(Protocol):
    """Where readings come from (the worker pool; a fake in tests)."""

    def memory(self, worker_id: str | None = None) -> MemoryReading | None: ...


#: The tightest memory limit on the node's cgroup path (``node.capacity.budget``).
LimitSource = Callable[[], CgroupLimit | None]

#: Where the memory budget comes from: ``pressure.budget`` (cut to a cgroup limit below
#: it), a cgroup limit on the node's path, or, with neither, the node's own figure (its
#: workers' limits plus its share). ``status`` compares the capacity plan's budget with a
#: cgroup limit only: the node's own figure was never the machine's.
BudgetKind = Literal["configured", "cgroup", "node"]

#: Seconds a read of the path's limits is used before it is read again. They change only
#: when an operator writes an ancestor's file, and reading every ancestor's files on each
#: poll was a fifth of the broker's CPU at 4 concurrent (docs/bench/figures.md,
#: "node.pressure"); the node cgroup's own limit comes with every reading.
LIMIT_TTL_S = 2.0


class PressureMonitor:
    """Polls the node's cgroup and says when the memory pressure level changes."""

    def __init__(
        self,
        settings: PressureSection,
        source: MemorySource,
        default_budget: int | None = None,
        limit: LimitSource | None = None,
    ) -> None:
        self.settings = settings
        self.source = source
        self.default_budget = default_budget
        self.limit = limit
        self.level = "ok"
        self._next_poll = 0.0
        self._high_events: int | None = None
        self._last: dict[str, Any] = {}
        self._budget_source = ""
        self._budget_kind: BudgetKind = "node"
        self._path_limit: CgroupLimit | None = None
        self._path_limit_due = float("-inf")

    def budget(self, reading: MemoryReading, now: float) -> int | None:
        """Bytes the node may use: ``pressure.budget``, else the tightest cgroup limit on
        the node's path (``node.capacity.budget``, read at most every ``LIMIT_TTL_S``
        seconds of ``now``; the node cgroup's own, ``reading.limit``, included), else the
        default the node computed (its workers' limits plus its own share). A configured
        budget is cut to that cgroup limit."""
        if self.limit is not None and now >= self._path_limit_due:
            self._path_limit, self._path_limit_due = self.limit(), now + LIMIT_TTL_S
        limit = self._path_limit
        if reading.limit is not None and (limit is None or reading.limit < limit.bytes):
            limit = CgroupLimit(reading.limit, "of the node's cgroup")
        if self.settings.budget:
            size = parse_size(self.settings.budget)
            budget, self._budget_source = cut_to_limit(size, "pressure.budget", limit)
            self._budget_kind = "configured" if budget == size else "cgroup"
            return budget
        if limit is not None:
            self._budget_source, self._budget_kind = limit.describe(), "cgroup"
            return limit.bytes
        self._budget_source = "workers' limits + the node's share"
        self._budget_kind = "node"
        return self.default_budget

    def poll(self, now: float) -> str | None:
        """At most every ``poll_ms``: the new level if it changed, else None."""
        if now < self._next_poll:
            return None
        self._next_poll = now + self.settings.poll_ms / 1000
        reading = self.source.memory(None)
        if reading is None:
            return None
        level = self._classify(reading, now)
        if level == self.level:
            return None
        self.level = level
        return level

    def _classify(self, reading: MemoryReading, now: float) -> str:
        s = self.settings
        budget = self.budget(reading, now)
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
            "budget_source": self._budget_source,
            "budget_kind": self._budget_kind,
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


# ---------------------------------------------------------------- CPU (PSI)


@dataclass(frozen=True)
class PsiLine:
    """One line of a PSI file: the share of time (percent) stalled, averaged over
    10, 60 and 300 s, and the total stall time (µs)."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


def parse_psi(text: str) -> dict[str, PsiLine]:
    """The lines of a PSI file by kind (``some``, ``full``), psi.rst's format:
    ``some avg10=1.84 avg60=0.96 avg300=0.83 total=3487003738``.

    Raises:
        ValueError: no ``some`` line, or a line without the four fields.
    """
    lines: dict[str, PsiLine] = {}
    for line in filter(str.strip, text.splitlines()):
        kind, *pairs = line.split()
        fields = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
        try:
            lines[kind] = PsiLine(
                float(fields["avg10"]),
                float(fields["avg60"]),
                float(fields["avg300"]),
                int(fields["total"]),
            )
        except (KeyError, ValueError) as exc:
            raise ValueError(f"not a PSI line: {line!r}") from exc
    if "some" not in lines:
        raise ValueError("no 'some' line in the PSI file")
    return lines


def cpu_psi_file(
    v2_cgroup: Path | None, proc: Path = Path("/proc"), configured: str = ""
) -> tuple[Path | None, str]:
    """Where CPU pressure is read: ``configured`` (``pressure.cpu_psi``) when set,
    and only it; else the node cgroup's ``cpu.pressure`` when the node has a
    cgroup v2 of its own (``v2_cgroup``), else the host's ``/proc/pressure/cpu``.
    Returns (the first of them that reads as PSI, "") or (None, why none does)."""
    if configured:
        candidates = [Path(configured)]
    else:
        candidates = [] if v2_cgroup is None else [v2_cgroup / "cpu.pressure"]
        candidates.append(proc / PROC_PRESSURE / "cpu")
    why: list[str] = []
    for path in candidates:
        try:
            parse_psi(path.read_text())
        except OSError as exc:
            why.append(f"{path}: {exc.strerror or exc}")
            continue
        except ValueError as exc:
            why.append(f"{path}: {exc}")
            continue
        return path, ""
    return None, f"{'; '.join(why)} ({NO_PSI_HINT})"


class CpuPressureMonitor:
    """Reads CPU PSI at most every ``poll_ms`` and says when the CPU level changes.

    Args:
        settings: ``cpu_warn_pct`` (0 = CPU pressure ignored), ``cpu_clear_pct``, ``poll_ms``.
        path: the PSI file (``cpu_psi_file``), or None where there is none.
        reason: why there is none (shown in ``status``).
    """

    def __init__(self, settings: PressureSection, path: Path | None, reason: str = "") -> None:
        self.settings = settings
        self.path = None if settings.cpu_warn_pct == 0 else path
        self.reason = "pressure.cpu_warn_pct = 0" if settings.cpu_warn_pct == 0 else reason
        self.level: CpuLevel = "ok"
        self.some_avg10: float | None = None
        self._next_poll = 0.0

    def poll(self, now: float) -> CpuLevel | None:
        """At most every ``poll_ms``: the new level if it changed, else None. A file
        that stops being readable ends the measuring: the level returns to ``ok``."""
        if self.path is None or now < self._next_poll:
            return None
        self._next_poll = now + self.settings.poll_ms / 1000
        try:
            self.some_avg10 = parse_psi(self.path.read_text())["some"].avg10
        except (OSError, ValueError) as exc:
            self.reason = f"{self.path} stopped being readable: {exc}"
            log.warning("CPU pressure is no longer measured: %s", self.reason)
            self.path, self.some_avg10 = None, None
            return self._set("ok")
        return self._set(self._classify(self.some_avg10))

    def _classify(self, avg10: float) -> CpuLevel:
        s = self.settings
        if avg10 >= s.cpu_warn_pct:
            return "high"
        if self.level == "high" and avg10 >= s.cpu_clear_pct:
            return "high"  # hysteresis: stay until clearly below
        return "ok"

    def _set(self, level: CpuLevel) -> CpuLevel | None:
        if level == self.level:
            return None
        fields = {"resource": "cpu", "from": self.level, "to": level, "some_avg10": self.some_avg10}
        self.level = level
        log.log(
            logging.WARNING if level == "high" else logging.INFO,  # high sheds sheddable work
            "CPU pressure %s (some avg10 %s%%)",
            level,
            self.some_avg10,
            extra=event_extra("pressure_change", fields),
        )
        return level

    def snapshot(self) -> dict[str, Any]:
        """For ``status``: the level, the reading behind it, its file and thresholds,
        or why CPU pressure is not measured (``source`` None, ``reason``)."""
        return {
            "level": self.level,
            "some_avg10": self.some_avg10,
            "source": None if self.path is None else str(self.path),
            "warn_pct": self.settings.cpu_warn_pct,
            "clear_pct": self.settings.cpu_clear_pct,
            "reason": self.reason or None,
        }
