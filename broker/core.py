"""The sans-I/O broker: routing, credit, deadlines and liveness.

``Broker`` never touches a socket or a clock. The I/O loop feeds it frames and
the current monotonic time, and drains what it wants sent from ``to_clients``
and ``to_workers``: that is what lets deadlines, credit and liveness be tested
with a fake clock.

``Broker`` is the composition point: it owns the job table, the queue, the
router, the worker registry and the counters, speaks the client conversation,
runs the timers and decides how every job ends. The worker conversation
(dispatch, worker messages, cancellation, liveness) is
``broker.backend.WorkerConversation`` and degrade mode's hand-overs to the
rules are ``broker.handover.Handover``; both work on the same state by
reference.

Invariant: every accepted client request gets exactly one final reply
(``ok`` or ``error``), whatever happens to its worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from broker import protocol as p
from broker.admission import AdmissionGate, Admit, Shed
from broker.backend import WorkerConversation
from broker.breaker import BreakerSettings
from broker.delivery import Delivery, GoneCause, Outgoing, ReplyKind
from broker.errors import EdgeNodeError, ErrorCode
from broker.handover import Handover
from broker.jobs import JobTable
from broker.kinds import ENGINE_KINDS, PRESSURE_LEVELS, CpuLevel, DegradeReason, EngineKind
from broker.protocol import ClientRequest, WorkerCommand
from broker.records import BrokerSettings, Job, WorkerEvent
from broker.routing import PoolView, Route, Router, RoutingSettings
from broker.service_time import ServiceEstimator
from broker.stats import Stats
from broker.token_count import TokenCounter
from broker.workers import WorkerRegistry

__all__ = ["Broker", "BrokerSettings", "Job", "WorkerEvent"]


StatusHook = Callable[[], dict[str, Any]]


class Broker:
    """Routes client requests to workers with credit, deadlines and liveness.

    Args:
        settings: see ``BrokerSettings``.
        status_hook: returns extra fields merged into ``status`` (the
            supervisor's view of processes); the broker never imports it.
        count_tokens: prompt tokens of a request, for the 413 size check.
        routing, breaker: the migration mode and the circuit breaker's knobs.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        status_hook: StatusHook | None = None,
        count_tokens: TokenCounter | None = None,
        routing: RoutingSettings | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        self.settings = settings
        self.workers = WorkerRegistry()
        self.stats = Stats()
        self.estimator = ServiceEstimator(
            settings.service_estimate == "size", settings.default_max_tokens
        )
        self.jobs = JobTable()
        self.gate = AdmissionGate(settings, self.estimator, self.jobs, count_tokens, self.workers)
        self.router = Router(routing, breaker)
        #: Replies for the I/O loop, which sends them through ``delivery``.
        self.to_clients: list[Outgoing] = []
        self.to_workers: list[list[bytes]] = []
        self.events: list[WorkerEvent] = []
        self._status_hook = status_hook
        self.draining = False
        self.delivery = Delivery(settings.client_backlog, self.stats.counters)
        self.backend = WorkerConversation(
            settings,
            workers=self.workers,
            jobs=self.jobs,
            gate=self.gate,
            router=self.router,
            stats=self.stats,
            estimator=self.estimator,
            owner=self,
        )
        self.handover = Handover(
            jobs=self.jobs,
            gate=self.gate,
            router=self.router,
            stats=self.stats,
            workers=self.workers,
            cancel=self.backend.cancel,
            forget=self.forget,
        )

    # ------------------------------------------------------------------ clients

    def handle_client(self, frames: list[bytes], now: float) -> None:
        """Handle one frontend message ``[identity, "", "EDGE/C1", body]``."""
        if not frames:
            return
        identity = frames[0]
        body = b""
        try:
            _, body = p.split_client_frames(frames)
            p.check_body_size(body, self.settings.max_body_bytes)
            req = p.parse_client_request(p.unpack_map(body))
        except EdgeNodeError as exc:
            self.stats.count("rejected_bad_request")
            # Bodies are bounded by ZMQ_MAXMSGSIZE, so salvaging even an oversized one is cheap.
            rid = p.salvage_id(body)
            self.send_client(identity, p.error_reply(rid, exc.code, exc.message))
            return
        if req.op == "ping":
            self.send_client(identity, p.ok_reply(req.id, pong=True, version=p.PROTOCOL_VERSION))
        elif req.op == "status":
            self.send_client(identity, p.ok_reply(req.id, node=self.status(now)))
        elif req.op == "cancel":
            self._cancel_by_client(identity, req, now)
        else:
            self._accept(identity, req, now)

    def _accept(self, identity: bytes, req: ClientRequest, now: float) -> None:
        pool = self._pool_view(req, now)
        route = self.router.route(req, pool, now)
        verdict = self._admit(identity, req, route, pool, now)
        if isinstance(verdict, Shed):
            self._refuse(identity, req.id, verdict)
            return
        route = verdict.route
        if verdict.evict is not None:  # a lower-priority request yields its place
            self._shed_job(verdict.evict, "evicted by a higher-priority request", "queue_full", now)
        deadline = now + self.gate.timeout_s(req)
        job = self._new_job(identity, req, now, deadline, route.kind)
        job.degraded, job.permit = route.degraded, route.permit
        job.prompt_tokens = verdict.prompt_tokens
        self.jobs.bind(job)
        self.gate.opened(identity)
        self.gate.push(job)
        if route.hedge:
            self.handover.hedge(job)
        elif route.watch_ttft:
            budget_s = self.router.settings.ttft_budget_ms / 1000
            self.jobs.arm("ttft", job.rid, now + budget_s)
        if route.copy:
            self._copy_to_model(job, route.copy, now)
        elif route.copy_skipped:
            self.router.copy_skipped(job, route.copy_skipped)
        self.stats.count("admitted")
        self.backend.dispatch(now)

    def _admit(
        self, identity: bytes, req: ClientRequest, route: Route, pool: PoolView, now: float
    ) -> Shed | Admit:
        """The admission gate's verdict on ``req`` as routed by ``route``; the breaker's
        permit goes back unless the model takes the request."""
        verdict = self.gate.check(identity, req, route, pool, now)
        if route.permit is not None and (isinstance(verdict, Shed) or verdict.route is not route):
            self.router.breaker.release(route.permit, now)
        return verdict

    def _new_job(
        self, client: bytes, req: ClientRequest, now: float, deadline: float, kind: EngineKind
    ) -> Job:
        return self.jobs.new(client, req, now, deadline, kind)

    def _pool_view(self, req: ClientRequest, now: float) -> PoolView:
        """The pool as ``req`` finds it: one snapshot, for routing and admission."""
        llm, rules = (
            self.gate.engine_pool(kind, req.priority, self.backend.free_credit(kind), now)
            for kind in ENGINE_KINDS
        )
        return PoolView(
            llm=llm,
            rules=rules,
            pressure=self.gate.pressure,
            cpu_pressure=self.gate.cpu,
            draining=self.draining,
        )

    def _copy_to_model(self, primary: Job, mode: str, now: float) -> None:
        """Give the model a copy of ``primary`` (answered by the rules) to compare."""
        if len(self.gate) > self.gate.queue_bound(self.workers.total_slots()):
            self.router.copy_skipped(primary, "queue_full")
            return
        permit = self.router.breaker.allow(now)
        if permit is None:
            self.router.copy_skipped(primary, "circuit_open")
            return
        req = replace(primary.req, stream=False, route="llm", priority="sheddable")
        copy = self._new_job(b"", req, now, primary.deadline, "llm")
        copy.permit, copy.copy_of = permit, primary.rid
        self.gate.push(copy)
        self.router.open_pair(primary, mode)

    def fall_back(self, job: Job, reason: DegradeReason, now: float) -> bool:
        """Hand ``job`` to the rules if degrade mode allows it now; False if not."""
        return self.handover.fall_back(job, reason, now)

    def _refuse(self, identity: bytes, rid: str | int, shed: Shed) -> None:
        self.stats.count(f"shed_{shed.reason}")
        body = p.error_reply(
            rid, shed.code, shed.message, retry_after_ms=shed.retry_after_ms, reason=shed.reason
        )
        self.send_client(identity, body)

    def _shed_job(self, job: Job, message: str, reason: str, now: float) -> None:
        """Answer an admitted job 503 now (pressure, eviction) and cancel it if running."""
        self.stats.count(f"shed_{reason}")
        retry = self.gate.retry_after(self.workers.slots(job.kind), now, job.kind)
        self._finish_early(
            job, ErrorCode.UNAVAILABLE, message, now, reason=reason, retry_after_ms=retry
        )

    def set_pressure(self, level: str, now: float) -> None:
        """React to the node's memory pressure (``ok``, ``high`` or ``critical``).

        Rising pressure sheds queued work the level no longer admits and, at
        ``critical``, cancels sheddable requests in flight; the gate halves the
        queue and the credit used. ``ok`` restores both.
        """
        if level not in PRESSURE_LEVELS or level == self.gate.pressure:
            return
        self.gate.pressure = level
        message = f"shed under memory pressure ({level})"
        for job in self.gate.shed_for_pressure():
            self._shed_job(job, message, "memory_pressure", now)
        if level == "critical":
            for job in self.jobs:
                sheddable = job.req.priority == "sheddable" and job.kind == "llm"
                if job.worker and not job.replied and sheddable:
                    self._shed_job(job, message, "memory_pressure", now)
        self.backend.dispatch(now)

    def set_cpu_pressure(self, level: CpuLevel, now: float) -> None:
        """React to the host's CPU pressure (``ok`` or ``high``, from the node's PSI reading).

        ``high``: queued sheddable model work is answered 503 ``cpu_pressure`` and
        new sheddable model work is refused (``AdmissionGate``); in degrade mode
        ``auto`` requests go to the rules (``Router``). ``ok`` restores both.
        """
        if level == self.gate.cpu:
            return
        self.gate.cpu = level
        for job in self.gate.shed_for_cpu():
            self._shed_job(job, "shed under CPU pressure", "cpu_pressure", now)
        self.backend.dispatch(now)

    def _cancel_by_client(self, identity: bytes, req: ClientRequest, now: float) -> None:
        assert req.target is not None
        job = self.jobs.of_client(identity, req.target)
        if job is None or job.replied:
            self.send_client(
                identity,
                p.error_reply(req.id, ErrorCode.NOT_FOUND, f"no request {req.target!r} in flight"),
            )
            return
        self._finish_early(job, ErrorCode.CANCELLED, "cancelled by client", now)
        self.send_client(identity, p.ok_reply(req.id, cancelled=req.target))

    def client_gone(self, identity: bytes, cause: GoneCause, now: float) -> int:
        """The client ``identity`` is gone (``cause``): nothing more is sent to it.

        Its waiting finals are discarded (``Delivery.forget``). Each of its
        requests without a final reply ends with none, counted ``client_gone``
        (never ``ok``): a queued one leaves the queue, a running one is
        cancelled on its worker, whose credit returns with the ack. A rules
        hedge ends with the request it hedges. Returns how many requests ended.
        """
        self.delivery.forget(identity)
        ended = 0
        for job in self.jobs:
            if job.client != identity or job.replied or job.hedge_of is not None:
                continue
            self.stats.count("client_gone")
            message = f"client gone ({cause.value})"
            self._finish_early(job, ErrorCode.CANCELLED, message, now, deliver=False)
            ended += 1
        return ended

    # ------------------------------------------------------------------ workers

    def handle_worker(self, frames: list[bytes], now: float) -> None:
        """Handle one backend message ``[identity, "", "EDGE/W1", command, body]``."""
        self.backend.handle(frames, now)

    def worker_exited(self, worker_id: str, reason: str, now: float) -> None:
        """The supervisor reaped this worker's process: fail over without waiting."""
        self.backend.worker_exited(worker_id, reason, now)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> None:
        """Expire deadlines, check liveness and send heartbeats due at ``now``."""
        for kind, rid in self.jobs.expired(now):
            job = self.jobs.get(rid)
            if job is None:
                continue
            if kind == "job" and not job.replied:
                self.stats.count("deadline_exceeded")
                self._finish_early(job, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", now)
            elif kind == "ttft" and not job.replied and job.first_token_at is None:
                if job.hedged_by is None and self.handover.can_fall_back(job):
                    self.handover.hedge(job)
                    self.backend.dispatch(now)
            elif kind == "ack":
                self.backend.hung(job, now)
        self.backend.tick(now)

    def next_wakeup(self, now: float) -> float:
        """Seconds until the next ``tick`` is due (the I/O loop's poll timeout)."""
        due = [self.backend.next_heartbeat]
        deadline = self.jobs.next_timer()
        if deadline is not None:
            due.append(deadline)
        return max(0.0, min(due) - now)

    def _finish_early(
        self,
        job: Job,
        code: ErrorCode,
        message: str,
        now: float,
        deliver: bool = True,
        **extra: Any,
    ) -> None:
        """Answer ``job`` now with ``code``; a running job is cancelled on its worker.
        ``deliver=False``: its client is gone, so the answer is not sent."""
        body = p.error_reply(job.req.id, code, message, text="".join(job.chunks), **extra)
        self.answer(job, body, now, deliver)
        if job.worker is None:
            self.forget(job)
            return
        self.backend.cancel(job, now)

    def answer(
        self,
        job: Job,
        body: dict[str, Any],
        now: float,
        deliver: bool = True,
        counted: str | None = None,
    ) -> None:
        """Send ``job``'s one final reply; the client may reuse its id at once.

        ``deliver=False``: end it the same way but send nothing (its client is gone).
        ``counted``: the outcome counter the reply was counted under, moved to
        ``client_gone`` if the reply never reaches its client (``Outgoing``).
        A model copy (shadow/dual) has no client: its result only goes to the router.
        A hedge answers only if a rule matched (``Handover.take_hedge``); else
        it is dropped. A request that is answered drops its hedge if still out.
        """
        if job.hedge_of is not None:
            if not self.handover.take_hedge(job, body, now):
                job.replied = True
                return
            if job.req.stream:  # the held-back text, as the stream it would have been
                for index, text in enumerate(job.chunks):
                    partial = p.partial_reply(job.req.id, text, index)
                    self.send_client(job.client, partial, ReplyKind.PARTIAL)
        job.replied = True
        self.handover.drop_hedge(job)
        self.router.finished(job, body, now)
        if job.copy_of is not None:
            return
        self.jobs.release(job)
        self.gate.closed(job.client)
        if deliver:
            self.to_clients.append(Outgoing(job.client, body, ReplyKind.FINAL, counted))

    def forget(self, job: Job) -> None:
        """Drop ``job`` from the ledger and the queue (answered or handed over)."""
        self.jobs.forget(job)
        self.gate.remove(job)

    # ------------------------------------------------------------------ output

    def send_client(
        self, identity: bytes, body: dict[str, Any], kind: ReplyKind = ReplyKind.FINAL
    ) -> None:
        """Queue ``body`` for the client ``identity`` (drained by the I/O loop);
        ``kind`` tells a streamed chunk, which may be dropped, from a final reply."""
        self.to_clients.append(Outgoing(identity, body, kind))

    def send_worker(self, identity: bytes, command: WorkerCommand, body: dict[str, Any]) -> None:
        """Queue ``command`` with ``body`` for the worker ``identity`` (drained by the I/O loop)."""
        self.to_workers.append(p.to_worker_frames(identity, command, body))

    def status(self, now: float) -> dict[str, Any]:
        """A msgpack-ready snapshot: workers, queue, in-flight, counters."""
        workers = [w.snapshot(now) for w in sorted(self.workers, key=lambda w: w.worker_id)]
        slots = self.workers.total_slots()
        node: dict[str, Any] = {
            "protocol": p.PROTOCOL_VERSION,
            "queue_depth": len(self.gate),
            "queue_bound": self.gate.queue_bound(slots),
            "in_flight": self.jobs.running(),
            "credit": self.workers.total_credit(),
            "credit_limit": self.gate.concurrency(self.workers.slots("llm")),
            "pressure": self.gate.pressure,
            "cpu_pressure": self.gate.cpu,
            "routing": self.router.snapshot(now),
            "draining": self.draining,
            "workers": workers,
            "counters": dict(self.stats.counters),
            "delivery": self.delivery.snapshot(),
            "service": self.estimator.snapshot(),
        }
        if self._status_hook is not None:
            node.update(self._status_hook())
        return node

    def abort_all(self, message: str, now: float) -> None:
        """Answer every request still without a final reply with 503 (shutdown)."""
        for job in self.jobs:
            if not job.replied:
                body = p.error_reply(
                    job.req.id,
                    ErrorCode.UNAVAILABLE,
                    message,
                    text="".join(job.chunks),
                    reason="shutdown",
                )
                self.answer(job, body, now)
            self.forget(job)

    def pending_jobs(self) -> int:
        """Accepted requests without a final reply yet (0 means drained)."""
        return self.jobs.pending()
