"""What admission bounds: the requests waiting for a slot, and each client's open requests.

``RequestQueue`` holds the accepted requests not yet on a worker, one FIFO per
priority class; dispatch takes them by priority, then arrival, and a full
engine's queue makes room by evicting the newest job of a lower class.
``ClientCounts`` counts each client's accepted requests not yet answered (queued
or running). Both are state the broker's parts share by reference: the
admission gate (``broker.admission``) reads them to decide, the broker and its
lifecycle add and take out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from broker.kinds import PRIORITIES, EngineKind, Priority
from broker.records import Job
from broker.service_time import ServiceEstimator


class RequestQueue:
    """Queued jobs: one FIFO per priority class.

    Args:
        estimator: gives a job queued without ``prompt_tokens`` its estimate, if
            it has one.
    """

    def __init__(self, estimator: ServiceEstimator) -> None:
        self.estimator = estimator
        self._queues: dict[Priority, OrderedDict[int, Job]] = {p: OrderedDict() for p in PRIORITIES}

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        """Whether any job waits (without counting them)."""
        return any(self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        """Queued jobs in dispatch order: by priority, then arrival."""
        for priority in PRIORITIES:
            yield from list(self._queues[priority].values())

    def push(self, job: Job, *, front: bool = False) -> None:
        """Queue ``job``; ``front`` puts it first in its class (a re-dispatch). A job
        without ``prompt_tokens`` gets the estimator's estimate, if it has one."""
        if job.prompt_tokens is None:
            job.prompt_tokens = self.estimator.prompt_tokens(job.req, job.kind)
        queue = self._queues[job.req.priority]
        queue[job.rid] = job
        if front:
            queue.move_to_end(job.rid, last=False)

    def remove(self, job: Job) -> bool:
        """Take ``job`` out of the queue; False if it was not queued."""
        return self._queues[job.req.priority].pop(job.rid, None) is not None

    def queued(self, priority: Priority) -> list[Job]:
        """The queued jobs of one priority class, oldest first."""
        return list(self._queues[priority].values())

    def of_kind(self, kind: EngineKind) -> int:
        """How many ``kind`` jobs wait (each engine's queue has its own bound)."""
        return sum(j.kind == kind for q in self._queues.values() for j in q.values())

    def ahead(self, kind: EngineKind, priority: Priority) -> list[Job]:
        """The ``kind`` jobs a new request of ``priority`` would wait behind, in
        dispatch order: its class and those above."""
        rank = PRIORITIES.index(priority)
        return [
            j for p in PRIORITIES[: rank + 1] for j in self._queues[p].values() if j.kind == kind
        ]

    def eviction_victim(self, priority: Priority, kind: EngineKind) -> Job | None:
        """The newest queued ``kind`` job of a lower class than ``priority``, if any."""
        rank = PRIORITIES.index(priority)
        for p in reversed(PRIORITIES[rank + 1 :]):
            victim = next((j for j in reversed(self._queues[p].values()) if j.kind == kind), None)
            if victim is not None:
                return victim
        return None


class ClientCounts:
    """Each client's accepted requests not yet answered, by routing identity."""

    def __init__(self) -> None:
        self._open: dict[bytes, int] = {}

    def of(self, client: bytes) -> int:
        """How many of ``client``'s requests are open."""
        return self._open.get(client, 0)

    def opened(self, client: bytes) -> None:
        """A request of ``client`` was accepted."""
        self._open[client] = self._open.get(client, 0) + 1

    def closed(self, client: bytes) -> None:
        """A request of ``client`` was answered."""
        left = self._open.get(client, 0) - 1
        if left > 0:
            self._open[client] = left
        else:
            self._open.pop(client, None)
