"""The pool as one request finds it: one snapshot, for routing and admission.

``PoolSnapshot.view`` is built once per request (``Broker._accept``) and shared by
routing (``broker.routing.Router.route``) and admission
(``broker.admission.AdmissionGate.check``): per engine kind, its workers, slots,
free credit and smallest context, and when the request would start there; the
pressure levels; whether the node drains. It reads the worker registry, the job
table, the queue, the pressure levels and the service-time estimator, and owns
nothing but how they combine.

``free_credit`` (what dispatch may still send) and ``engine_slots`` (the slots the
estimator plays a queue onto) are defined here once, for the dispatcher, the
snapshot and admission's ``retry_after_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.jobs import JobTable
from broker.kinds import ENGINE_KINDS, CpuLevel, EngineKind, PressureLevel, Priority
from broker.pressure import PressureLevels
from broker.queue import RequestQueue
from broker.service_time import ServiceEstimator, Slots
from broker.workers import WorkerRegistry


@dataclass(frozen=True)
class EnginePool:
    """One engine kind's workers as one request finds them: how many, the
    sequences they run at once (``slots``), the credit usable now (``free``), the
    smallest context among them (``n_ctx``, tokens; None if none reported one),
    and when the request would start there (``wait_s``, s from now) at which
    batch ``level`` (``broker.service_time.ServiceEstimator.wait``)."""

    workers: int
    slots: int = 0
    free: int = 0
    n_ctx: int | None = None
    wait_s: float = 0.0
    level: int = 1


@dataclass(frozen=True)
class PoolView:
    """The pool at one moment, built once per request and shared by routing
    (``Router.route``) and admission (``AdmissionGate.check``): each engine, the
    memory and CPU pressure, and whether the node is draining."""

    llm: EnginePool
    rules: EnginePool
    pressure: PressureLevel = "ok"
    cpu_pressure: CpuLevel = "ok"
    draining: bool = False

    def of(self, kind: EngineKind) -> EnginePool:
        """The engine of ``kind``."""
        return self.llm if kind == "llm" else self.rules


def free_credit(workers: WorkerRegistry, levels: PressureLevels, kind: EngineKind) -> int:
    """Credit of ``kind``'s workers the broker may still use: their free credit, and
    under memory pressure at most the model's halved slots
    (``PressureLevels.concurrency``) less those running; the rules need no memory
    worth protecting."""
    slots = in_flight = credit = 0
    for w in workers.of_kind(kind):  # one pass: it runs several times per request
        slots += w.slots
        in_flight += len(w.active)
        credit += w.credit
    limit = levels.concurrency(slots) if kind == "llm" else slots
    return min(credit, limit - in_flight)


def engine_slots(
    kind: EngineKind, slots: int, free: int, workers: WorkerRegistry, jobs: JobTable
) -> Slots:
    """``kind``'s ``slots`` for the estimator, ``free`` of them usable now: with
    ``kind``'s jobs holding a slot (a cancelled one until its worker acks) and the
    free credit of each of its workers, by identity."""
    running = [
        j for j in jobs if j.kind == kind and j.worker is not None and j.dispatched_at is not None
    ]
    credit = {w.identity: w.credit for w in workers.of_kind(kind)}
    return Slots(kind, slots, free, running, credit)


class PoolSnapshot:
    """Builds the ``PoolView`` a new request is routed and admitted on.

    Args:
        workers, jobs, queue: the broker's registry, job table and queue (references).
        levels: the broker's pressure levels (a reference).
        estimator: the service-time estimator, for each engine's ``wait``.
    """

    def __init__(
        self,
        workers: WorkerRegistry,
        jobs: JobTable,
        queue: RequestQueue,
        levels: PressureLevels,
        estimator: ServiceEstimator,
    ) -> None:
        self.workers = workers
        self.jobs = jobs
        self.queue = queue
        self.levels = levels
        self.estimator = estimator

    def view(self, priority: Priority, draining: bool, now: float) -> PoolView:
        """The pool as a new request of ``priority`` finds it at ``now``."""
        llm, rules = (self.engine(kind, priority, now) for kind in ENGINE_KINDS)
        return PoolView(
            llm=llm,
            rules=rules,
            pressure=self.levels.level,
            cpu_pressure=self.levels.cpu,
            draining=draining,
        )

    def engine(self, kind: EngineKind, priority: Priority, now: float) -> EnginePool:
        """``kind``'s engine as a new request of ``priority`` finds it: its workers,
        slots, free credit and smallest context, and when the request would start
        there (the queue ahead of it, its class and those above, played forward
        once: ``ServiceEstimator.wait``)."""
        free = free_credit(self.workers, self.levels, kind)
        slots = engine_slots(kind, self.workers.slots(kind), free, self.workers, self.jobs)
        wait_s, level = self.estimator.wait(self.queue.ahead(kind, priority), slots, now)
        return EnginePool(
            workers=len(self.workers.of_kind(kind)),
            slots=slots.slots,
            free=free,
            n_ctx=self.workers.min_n_ctx(kind),
            wait_s=wait_s,
            level=level,
        )
