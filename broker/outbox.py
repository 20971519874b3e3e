"""The one way out of the sans-I/O broker: everything it wants done, in order.

Every effect of the broker core is appended to one ``Outbox``: replies for
clients, frames for workers, events for the supervisor, migration records for
the node's log, the circuit breaker's state transitions, the steps of each
request's path (``RequestTrace``, for the node's log) and the observations
for the node's metrics (``broker.observations``). The I/O loop
(``broker.loop.BrokerLoop.flush``) takes them all at once with ``take`` and
hands what is not a frame to the node.

``take`` empties the lists in place and never rebinds them, so a part of the
broker may keep one of them (the circuit breaker appends to ``transitions``);
``tests/unit/test_core.py::test_the_io_loop_may_take_the_outbox_at_any_time``
guards that.

Traces and observations are built only if the loop's owner consumes them
(``Consumed``, set with ``Outbox.consume``): a node with JSON logs at INFO and
metrics off reads neither, and building them cost about a tenth of the core's
instructions per request (docs/bench/figures.md, "Broker overhead").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker import protocol as p
from broker.breaker import Transition
from broker.delivery import Outgoing, ReplyKind
from broker.kinds import FinalOutcome
from broker.observations import Observation
from broker.protocol import WorkerCommand
from broker.records import Job, RequestTrace, TraceStep, WorkerEvent


@dataclass(frozen=True)
class Consumed:
    """Which optional records the loop's owner consumes, so the core builds them.

    Attributes:
        traces: ``RequestTrace`` steps (the node logs them at DEBUG).
        observations: ``broker.observations`` records (the node's metrics).
    """

    traces: bool = True
    observations: bool = True


@dataclass
class Effects:
    """What the broker queued between two ``Outbox.take`` calls, oldest first.

    Attributes:
        clients: replies for clients, sent through ``broker.delivery``.
        workers: multipart messages for the backend ROUTER (identity first).
        events: worker ``ready``/``lost`` events for the supervisor.
        records: migration records (plain dicts) for the node's migration log.
        transitions: the circuit breaker's state changes.
        traces: the steps of requests' paths, for the node's log.
        observations: requests ended and token gaps, for the node's metrics.
    """

    clients: list[Outgoing] = field(default_factory=list)
    workers: list[list[bytes]] = field(default_factory=list)
    events: list[WorkerEvent] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    traces: list[RequestTrace] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.clients
            or self.workers
            or self.events
            or self.records
            or self.transitions
            or self.traces
            or self.observations
        )


class Outbox(Effects):
    """The broker's effects not yet taken by the I/O loop (see the module doc).

    Attributes:
        tracing: ``trace`` keeps its steps; callers that format a detail check it first.
        observing: callers append to ``observations`` only if set.
    """

    tracing: bool = True
    observing: bool = True

    def consume(self, consumed: Consumed) -> None:
        """Build only the optional records ``consumed`` names (both by default)."""
        self.tracing = consumed.traces
        self.observing = consumed.observations

    def client(
        self,
        identity: bytes,
        body: dict[str, Any],
        kind: ReplyKind = ReplyKind.FINAL,
        counted: FinalOutcome | None = None,
    ) -> None:
        """Queue ``body`` for the client ``identity``; ``kind`` tells a streamed
        chunk (which may be dropped) from a final reply, ``counted`` is the
        outcome counter a final was counted under (``Outgoing``)."""
        self.clients.append(Outgoing(identity, body, kind, counted))

    def worker(self, identity: bytes, command: WorkerCommand, body: dict[str, Any]) -> None:
        """Queue ``command`` with ``body`` for the worker ``identity``."""
        self.workers.append(p.to_worker_frames(identity, command, body))

    def trace(self, step: TraceStep, job: Job, worker: str = "", detail: str = "") -> None:
        """Note that ``job`` took ``step`` (on ``worker``, the worker's id), if traced."""
        if not self.tracing:
            return
        self.traces.append(
            RequestTrace(step, job.rid, job.req.id, job.client, worker, detail, job.principal)
        )

    def take(self) -> Effects:
        """Everything queued so far; the outbox is empty afterwards (same lists)."""
        taken = Effects(
            list(self.clients),
            list(self.workers),
            list(self.events),
            list(self.records),
            list(self.transitions),
            list(self.traces),
            list(self.observations),
        )
        self.clients.clear()
        self.workers.clear()
        self.events.clear()
        self.records.clear()
        self.transitions.clear()
        self.traces.clear()
        self.observations.clear()
        return taken
