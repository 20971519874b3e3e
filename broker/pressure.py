"""The node's pressure levels as the broker last heard them, and the rules that follow.

The node reads its memory pressure (its cgroup) and the host's CPU pressure (PSI,
``node.pressure``) and tells the broker (``Broker.set_pressure``,
``Broker.set_cpu_pressure``); ``PressureLevels`` keeps both. The broker owns the one
instance; admission (``broker.admission``), the pool snapshot (``broker.snapshot``)
and hence dispatch read it by reference, and never set it.

Memory ``high`` sheds sheddable work and halves the queue and the model's credit the
broker uses; ``critical`` admits only critical work. CPU ``high`` sheds sheddable
model work as memory's ``high`` does, but leaves the queue and the credit alone:
they bound memory, not CPU time. ``ok`` restores everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.kinds import CpuLevel, PressureLevel, Priority

#: The classes memory pressure sheds at each level, in the order they are shed.
_MEMORY_SHEDS: dict[PressureLevel, tuple[Priority, ...]] = {
    "ok": (),
    "high": ("sheddable",),
    "critical": ("normal", "sheddable"),
}


@dataclass
class PressureLevels:
    """The memory ``level`` (``ok``, ``high``, ``critical``) and the ``cpu`` level
    (``ok``, ``high``) now."""

    level: PressureLevel = "ok"
    cpu: CpuLevel = "ok"

    def queue_bound(self, slots: int, max_queue: int) -> int:
        """How many requests for one engine of ``slots`` may wait: ``max_queue``
        (0: 8 per slot), halved under memory pressure (at least 1)."""
        bound = max_queue or 8 * max(1, slots)
        return bound if self.level == "ok" else max(1, bound // 2)

    def concurrency(self, slots: int) -> int:
        """How many of the model's ``slots`` the broker may use now: all, or half
        (at least 1) under memory pressure."""
        return slots if self.level == "ok" else max(1, slots // 2)

    def memory_sheds(self) -> tuple[Priority, ...]:
        """The request classes the memory level sheds (model work only), in the
        order queued jobs are answered 503."""
        return _MEMORY_SHEDS[self.level]

    def cpu_sheds(self, priority: Priority) -> bool:
        """Whether the CPU level sheds model work of ``priority``."""
        return self.cpu == "high" and priority == "sheddable"
