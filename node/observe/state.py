"""The gauges read from the node's state: one snapshot the broker loop publishes,
exposed by a custom collector at scrape time.

The HTTP server answers scrapes on its own thread while the loop mutates the
broker and the pool, so the collector never reads them: the loop builds an
immutable ``StateSnapshot`` at most every ``PUBLISH_EVERY_S`` (``StateCollector.publish``,
from its tick) and swaps one reference, which a scrape reads whole. A scrape
therefore sees the state as of at most ``PUBLISH_EVERY_S`` plus one loop turn
ago (``edgenode_state_age_seconds`` says how old).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from broker.breaker import BreakerState
from broker.core import Broker
from broker.kinds import ENGINE_KINDS, PRESSURE_LEVELS, CpuLevel, EngineKind, PressureLevel
from broker.snapshot import free_credit
from node.pool import RULES_WORKER, WorkerPool
from node.sandbox.driver import MemoryReading
from node.supervisor import ProcessState

#: How often the loop rebuilds the snapshot at most (s): far below any scrape
#: interval (Prometheus' default is 15 s), and the per-worker cgroup reads it
#: costs (a few small files each) stay off the loop's busy turns.
PUBLISH_EVERY_S = 0.5
PROCESS_STATES: tuple[ProcessState, ...] = get_args(ProcessState)
CPU_LEVELS: tuple[CpuLevel, ...] = get_args(CpuLevel)


@dataclass(frozen=True)
class WorkerFigures:
    """One worker process as the supervisor, its cgroup and the broker see it.

    ``memory``: its cgroup's reading (bytes), None without a sandbox or for the
    rule worker; ``last_heard_s``: seconds since the broker last heard from it
    (its liveness age), None while it is not registered.
    """

    worker_id: str
    engine: EngineKind
    state: ProcessState
    restarts: int
    oom_kills: int
    memory: MemoryReading | None
    last_heard_s: float | None


@dataclass(frozen=True)
class StateSnapshot:
    """The node's state at monotonic ``at`` (s); per-engine tuples follow ``ENGINE_KINDS``."""

    at: float
    credit_free: tuple[int, ...]
    slots: tuple[int, ...]
    queue_depth: tuple[int, ...]
    in_flight: int
    breaker: BreakerState
    pressure: PressureLevel
    cpu_pressure: CpuLevel
    workers: tuple[WorkerFigures, ...]


def take_snapshot(broker: Broker, pool: WorkerPool, now: float) -> StateSnapshot:
    """Read the broker and the pool at ``now``; call it on the loop's thread only
    (the breaker's state applies its timed transitions)."""
    registered = {w.worker_id: w for w in broker.workers}
    workers = []
    for entry in pool.supervisor.status():
        wid = entry["worker_id"]
        seen = registered.get(wid)
        workers.append(
            WorkerFigures(
                worker_id=wid,
                engine="rules" if wid == RULES_WORKER else "llm",
                state=entry["state"],
                restarts=entry["restarts"],
                oom_kills=pool.oom_kills.get(wid, 0),
                memory=pool.memory(wid) if wid != RULES_WORKER else None,
                last_heard_s=None if seen is None else max(0.0, now - seen.last_seen),
            )
        )
    return StateSnapshot(
        at=now,
        credit_free=tuple(free_credit(broker.workers, broker.pressure, k) for k in ENGINE_KINDS),
        slots=tuple(broker.workers.slots(k) for k in ENGINE_KINDS),
        queue_depth=tuple(broker.queue.of_kind(k) for k in ENGINE_KINDS),
        in_flight=broker.jobs.running(),
        breaker=broker.router.breaker.state(now),
        pressure=broker.pressure.level,
        cpu_pressure=broker.pressure.cpu,
        workers=tuple(workers),
    )


class StateCollector(Collector):
    """Exposes the latest ``StateSnapshot`` (``publish``) as gauges and counters."""

    def __init__(self, broker: Broker, pool: WorkerPool) -> None:
        self._broker = broker
        self._pool = pool
        self._snapshot: StateSnapshot | None = None

    def publish(self, now: float) -> None:
        """Rebuild the snapshot if the last is ``PUBLISH_EVERY_S`` old (loop thread)."""
        last = self._snapshot
        if last is None or now - last.at >= PUBLISH_EVERY_S:
            self._snapshot = take_snapshot(self._broker, self._pool, now)

    def collect(self) -> Iterator[Metric]:
        """The metrics of the snapshot published last (the scrape's thread)."""
        snap = self._snapshot  # one read: the loop may swap it meanwhile
        if snap is None:
            return
        age = GaugeMetricFamily(
            "edgenode_state_age_seconds", "Age of the state snapshot these gauges come from."
        )
        age.add_metric([], max(0.0, time.monotonic() - snap.at))
        yield age
        yield from _per_engine(snap)
        yield _one_of(
            "edgenode_breaker_state",
            "The model pool's circuit breaker state (1 = current).",
            "state",
            [s.value for s in BreakerState],
            snap.breaker.value,
        )
        yield _one_of(
            "edgenode_memory_pressure",
            "The node's memory pressure level (1 = current).",
            "level",
            PRESSURE_LEVELS,
            snap.pressure,
        )
        yield _one_of(
            "edgenode_cpu_pressure",
            "The host's CPU pressure level (1 = current).",
            "level",
            CPU_LEVELS,
            snap.cpu_pressure,
        )
        yield from _per_worker(snap.workers)


def _per_engine(snap: StateSnapshot) -> Iterator[Metric]:
    for name, doc, values in (
        (
            "edgenode_credit_free",
            "Credit the broker may still use: free sequences it may dispatch.",
            snap.credit_free,
        ),
        (
            "edgenode_slots",
            "Sequences the registered workers run at once (their credit limit).",
            snap.slots,
        ),
        ("edgenode_queue_depth", "Requests waiting for a slot.", snap.queue_depth),
    ):
        family = GaugeMetricFamily(name, doc, labels=["engine"])
        for kind, value in zip(ENGINE_KINDS, values, strict=True):
            family.add_metric([kind], value)
        yield family
    running = GaugeMetricFamily("edgenode_requests_running", "Requests on a worker now.")
    running.add_metric([], snap.in_flight)
    yield running


def _one_of(
    name: str, doc: str, label: str, values: tuple[str, ...] | list[str], current: str
) -> Metric:
    """A state set: one series per possible value, 1 for ``current``, 0 for the rest."""
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value in values:
        family.add_metric([value], 1.0 if value == current else 0.0)
    return family


def _per_worker(workers: tuple[WorkerFigures, ...]) -> Iterator[Metric]:
    labels = ["worker", "engine"]
    current = GaugeMetricFamily(
        "edgenode_worker_memory_bytes", "A worker cgroup's memory usage.", labels=labels
    )
    limit = GaugeMetricFamily(
        "edgenode_worker_memory_limit_bytes",
        "A worker cgroup's memory.max (absent: none).",
        labels=labels,
    )
    peak = GaugeMetricFamily(
        "edgenode_worker_memory_peak_bytes", "A worker cgroup's memory peak.", labels=labels
    )
    ooms = CounterMetricFamily(
        "edgenode_worker_oom_kills", "OOM kills in a worker's cgroup.", labels=labels
    )
    restarts = CounterMetricFamily(
        "edgenode_worker_restarts", "Restarts of a worker process.", labels=labels
    )
    heard = GaugeMetricFamily(
        "edgenode_worker_last_heard_seconds",
        "Seconds since the broker last heard from a registered worker (liveness age).",
        labels=labels,
    )
    state = GaugeMetricFamily(
        "edgenode_worker_state",
        "A worker process's state (1 = current).",
        labels=[*labels, "state"],
    )
    for w in workers:
        ids = [w.worker_id, w.engine]
        if w.memory is not None:
            current.add_metric(ids, w.memory.current)
            if w.memory.limit is not None:
                limit.add_metric(ids, w.memory.limit)
            if w.memory.peak is not None:
                peak.add_metric(ids, w.memory.peak)
        ooms.add_metric(ids, w.oom_kills)
        restarts.add_metric(ids, w.restarts)
        if w.last_heard_s is not None:
            heard.add_metric(ids, w.last_heard_s)
        for value in PROCESS_STATES:
            state.add_metric([*ids, value], 1.0 if value == w.state else 0.0)
    yield from (current, limit, peak, ooms, restarts, heard, state)
