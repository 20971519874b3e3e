"""The sans-I/O broker: routing, credit, deadlines and liveness.

``Broker`` never touches a socket or a clock. The I/O loop feeds it frames and
the current monotonic time, and drains what it wants sent from ``outbox``:
that is what lets deadlines, credit and liveness be tested with a fake clock.

Invariant: every accepted client request gets exactly one final reply
(``ok`` or ``error``), whatever happens to its worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from broker import protocol as p
from broker.admission import PRESSURE_LEVELS, AdmissionGate, Shed, TokenCounter
from broker.breaker import BreakerSettings
from broker.errors import EdgeNodeError, ErrorCode, ProtocolError
from broker.jobs import JobTable
from broker.protocol import ClientRequest, WorkerCommand
from broker.records import BrokerSettings, Job, WorkerEvent
from broker.replies import final_reply
from broker.routing import PoolView, Router, RoutingSettings
from broker.stats import Stats
from broker.workers import WorkerRegistry, WorkerState, parse_ready

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
        self.gate = AdmissionGate(settings, self.stats, count_tokens)
        self.router = Router(routing, breaker)
        self.to_clients: list[list[bytes]] = []
        self.to_workers: list[list[bytes]] = []
        self.events: list[WorkerEvent] = []
        self._status_hook = status_hook
        self.jobs = JobTable()
        self._next_heartbeat = 0.0
        self.draining = False

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
            self._send_client(identity, p.error_reply(rid, exc.code, exc.message))
            return
        if req.op == "ping":
            self._send_client(identity, p.ok_reply(req.id, pong=True, version=p.PROTOCOL_VERSION))
        elif req.op == "status":
            self._send_client(identity, p.ok_reply(req.id, node=self.status(now)))
        elif req.op == "cancel":
            self._cancel_by_client(identity, req, now)
        else:
            self._accept(identity, req, now)

    def _accept(self, identity: bytes, req: ClientRequest, now: float) -> None:
        key = (identity, req.id)
        if self.jobs.of_client(*key) is not None:
            message = f"id {req.id!r} is already in flight"
            self._refuse(identity, req.id, Shed(ErrorCode.BAD_REQUEST, "duplicate_id", message))
            return
        if self.draining:
            shed = Shed(ErrorCode.UNAVAILABLE, "draining", "node is shutting down", 1000)
            self._refuse(identity, req.id, shed)
            return
        timeout_ms = min(
            req.timeout_ms or self.settings.default_timeout_ms, self.settings.max_timeout_ms
        )
        route = self.router.route(req, self._pool_view(req), now)
        if isinstance(route, Shed):
            self._refuse(identity, req.id, route)
            return
        decision = self.gate.check(
            identity,
            req,
            self.workers.min_n_ctx(route.kind),
            self.workers.slots(route.kind),
            self._free_credit(route.kind),
            timeout_ms / 1000,
            route.kind,
        )
        if isinstance(decision, Shed):
            if route.permit is not None:
                self.router.breaker.release(route.permit, now)
            self._refuse(identity, req.id, decision)
            return
        if decision is not None:  # a lower-priority request yields its place
            self._shed_job(decision, "evicted by a higher-priority request", "queue_full", now)
        job = self._new_job(identity, req, now, now + timeout_ms / 1000, route.kind)
        job.degraded, job.permit = route.degraded, route.permit
        self.jobs.bind(job)
        self.gate.opened(identity)
        self.gate.push(job)
        if route.watch_ttft:
            budget_s = self.router.settings.ttft_budget_ms / 1000
            self.jobs.arm("ttft", job.rid, now + budget_s)
        if route.copy:
            self._copy_to_model(job, route.copy, now)
        elif route.copy_skipped:
            self.router.copy_skipped(job, route.copy_skipped)
        self.stats.count("admitted")
        self._dispatch(now)

    def _new_job(
        self, client: bytes, req: ClientRequest, now: float, deadline: float, kind: str
    ) -> Job:
        return self.jobs.new(client, req, now, deadline, kind)

    def _pool_view(self, req: ClientRequest) -> PoolView:
        llm = self.workers.of_kind("llm")
        slots = sum(w.slots for w in llm)
        free = self._free_credit("llm")
        return PoolView(
            llm_workers=len(llm),
            llm_free=free,
            rules_workers=len(self.workers.of_kind("rules")),
            llm_wait_s=self.gate.expected_wait_s(req.priority, slots, free),
            pressure=self.gate.pressure,
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

    def _reroute(self, job: Job, reason: str, now: float) -> None:
        """Hand an unanswered model request over to the rules (degrade mode).

        A new job takes the client's id; the old one is cancelled on its worker
        if it runs (its credit returns with the ack) and never answers itself.
        """
        self.router.release(job, now)
        new = self._new_job(job.client, job.req, job.accepted_at, job.deadline, "rules")
        new.degraded = reason
        self.jobs.bind(new)
        job.replied = True  # handed over, not answered: the client still waits
        self.gate.push(new, front=True)
        if job.worker is None:
            self._forget(job)
        else:
            self._send_worker(job.worker, WorkerCommand.CANCEL, {"rid": job.rid})
            self.jobs.arm("ack", job.rid, now + self.settings.cancel_grace_ms / 1000)
        self.stats.count(f"fallback_{reason}")

    def _can_fall_back(self, job: Job) -> bool:
        """Whether degrade mode may answer ``job`` from the rules now."""
        return (
            job.kind == "llm"
            and job.copy_of is None
            and job.req.route == "auto"
            and self.router.mode == "degrade"
            and not (job.req.stream and job.chunks)
            and bool(self.workers.of_kind("rules"))
        )

    def _refuse(self, identity: bytes, rid: str | int, shed: Shed) -> None:
        self.stats.count(f"shed_{shed.reason}")
        body = p.error_reply(
            rid, shed.code, shed.message, retry_after_ms=shed.retry_after_ms, reason=shed.reason
        )
        self._send_client(identity, body)

    def _shed_job(self, job: Job, message: str, reason: str, now: float) -> None:
        """Answer an admitted job 503 now (pressure, eviction) and cancel it if running."""
        self.stats.count(f"shed_{reason}")
        retry = self.gate.retry_after(self.workers.total_slots())
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
        self._dispatch(now)

    def _cancel_by_client(self, identity: bytes, req: ClientRequest, now: float) -> None:
        assert req.target is not None
        job = self.jobs.of_client(identity, req.target)
        if job is None or job.replied:
            self._send_client(
                identity,
                p.error_reply(req.id, ErrorCode.NOT_FOUND, f"no request {req.target!r} in flight"),
            )
            return
        self._finish_early(job, ErrorCode.CANCELLED, "cancelled by client", now)
        self._send_client(identity, p.ok_reply(req.id, cancelled=req.target))

    # ------------------------------------------------------------------ workers

    def handle_worker(self, frames: list[bytes], now: float) -> None:
        """Handle one backend message ``[identity, "", "EDGE/W1", command, body]``."""
        if len(frames) < 2:
            return
        identity = frames[0]
        try:
            command, body = p.parse_worker_frames(frames[1:])
        except ProtocolError as exc:
            self.stats.count("worker_protocol_errors")
            known = self.workers.get(identity)
            if known is not None:
                # It will re-register under a fresh identity: stop routing to this one.
                self._lose_worker(
                    known, f"protocol error: {exc.message}", now, notify=False, failure=False
                )
            else:
                self._send_worker(identity, WorkerCommand.DISCONNECT, {"reason": "protocol error"})
            return
        worker = self.workers.get(identity)
        if command is WorkerCommand.READY:
            self._register(identity, body, now)
            return
        if worker is None:
            # Unknown peer (e.g. the broker restarted): make it re-register.
            if command is not WorkerCommand.DISCONNECT:
                self._send_worker(identity, WorkerCommand.DISCONNECT, {"reason": "not registered"})
            return
        worker.last_seen = now
        if command is WorkerCommand.HEARTBEAT:
            self._note_progress(worker, body.get("progress"), now)
        elif command is WorkerCommand.PARTIAL:
            self._on_partial(worker, body, now)
        elif command is WorkerCommand.FINAL:
            self._on_final(worker, body, now)
        elif command is WorkerCommand.CREDIT:
            slots = body.get("slots")
            if isinstance(slots, int) and not isinstance(slots, bool) and 0 <= slots <= 256:
                worker.slots = slots
                self._dispatch(now)
        elif command is WorkerCommand.DISCONNECT:
            self._lose_worker(worker, "disconnected", now, notify=False, failure=False)

    def _register(self, identity: bytes, body: dict[str, Any], now: float) -> None:
        if self.workers.get(identity) is not None:
            return  # a duplicate READY changes nothing: credit is not re-granted
        try:
            worker = parse_ready(identity, body, now)
        except ProtocolError as exc:
            self._send_worker(identity, WorkerCommand.DISCONNECT, {"reason": exc.message})
            return
        stale = self.workers.by_worker_id(worker.worker_id)
        if stale is not None:
            self._lose_worker(
                stale, "replaced by a new incarnation", now, notify=False, failure=False
            )
        self.workers.add(worker)
        self.events.append(WorkerEvent("ready", worker.worker_id, worker.info.get("pid")))
        self._dispatch(now)

    def _note_progress(self, worker: WorkerState, progress: Any, now: float) -> None:
        if isinstance(progress, int) and progress != worker.progress:
            worker.progress = progress
            worker.progress_at = now

    def _owned_job(self, worker: WorkerState, body: dict[str, Any]) -> Job | None:
        rid = body.get("rid")
        if not isinstance(rid, int) or rid not in worker.active:
            return None
        return self.jobs.get(rid)

    def _on_partial(self, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        if "progress" in body:
            self._note_progress(worker, body["progress"], now)
        else:
            worker.progress_at = now  # a token is progress even from a worker not counting
        job = self._owned_job(worker, body)
        text = body.get("text")
        if job is None or job.replied or not isinstance(text, str):
            return
        if job.first_token_at is None:
            job.first_token_at = now
        if job.req.stream:
            self._send_client(job.client, p.partial_reply(job.req.id, text, len(job.chunks)))
        job.chunks.append(text)

    def _on_final(self, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        rid = body.get("rid")
        job = self._owned_job(worker, body)
        if isinstance(rid, int):
            worker.active.discard(rid)  # the credit returns with the ack, never earlier
        if job is not None:
            self.jobs.disarm("ack", job.rid)
            if not job.replied:
                self._reply_final(job, worker, body, now)
            self._forget(job)
        self._dispatch(now)

    def _reply_final(self, job: Job, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        reply, outcome = final_reply(job, worker.kind, worker.worker_id, body, now)
        if outcome == "ok" and job.dispatched_at is not None:
            self.stats.observe_service(now - job.dispatched_at, job.kind)
        self.stats.count(outcome)
        self._answer(job, reply, now)

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
                if self._can_fall_back(job):
                    self._reroute(job, "latency_budget", now)
                    self._dispatch(now)
            elif kind == "ack" and job.worker is not None:
                worker = self.workers.get(job.worker)
                if worker is not None:
                    self._lose_worker(worker, "hung: no ack to CANCEL within the grace", now)
        self._check_liveness(now)
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.settings.heartbeat_interval_ms / 1000
            for worker in self.workers:
                self._send_worker(worker.identity, WorkerCommand.HEARTBEAT, {})

    def next_wakeup(self, now: float) -> float:
        """Seconds until the next ``tick`` is due (the I/O loop's poll timeout)."""
        due = [self._next_heartbeat]
        deadline = self.jobs.next_timer()
        if deadline is not None:
            due.append(deadline)
        return max(0.0, min(due) - now)

    def _check_liveness(self, now: float) -> None:
        s = self.settings
        dead_after = s.heartbeat_interval_ms * s.heartbeat_liveness / 1000
        for worker, reason in self.workers.verdicts(now, dead_after, s.stall_timeout_ms / 1000):
            self._lose_worker(worker, reason, now)

    # ------------------------------------------------------------------ lifecycle

    def worker_exited(self, worker_id: str, reason: str, now: float) -> None:
        """The supervisor reaped this worker's process: fail over without waiting."""
        worker = self.workers.by_worker_id(worker_id)
        if worker is not None:
            # A crash is the pool's failure; an exit while the node stops is not.
            self._lose_worker(worker, reason, now, notify=False, failure=not self.draining)

    def _lose_worker(
        self,
        worker: WorkerState,
        reason: str,
        now: float,
        *,
        notify: bool = True,
        failure: bool = True,
    ) -> None:
        """Unregister ``worker``; re-dispatch, hand over or answer its requests.

        ``notify``: tell the supervisor to kill it (the broker's own verdict).
        ``failure``: count it against the model pool's circuit breaker (not for
        a clean DISCONNECT or an incarnation replaced by a newer one).
        """
        self.workers.remove(worker.identity)
        self.stats.count("workers_lost")
        if notify:
            pid = worker.info.get("pid")
            self.events.append(WorkerEvent("lost", worker.worker_id, pid, reason))
        # If it is merely slow it must not keep the requests: make it re-register.
        self._send_worker(worker.identity, WorkerCommand.DISCONNECT, {"reason": reason})
        if worker.kind == "llm" and failure and not worker.active:
            self.router.worker_failed(None, now, reason)
        for rid in sorted(worker.active):
            job = self.jobs.get(rid)
            if job is None:
                continue
            self.jobs.disarm("ack", rid)
            if worker.kind == "llm" and failure:
                self.router.worker_failed(job, now, reason)
            if job.replied:
                self._forget(job)
            elif (
                (not job.req.stream or not job.chunks) and job.attempts == 0 and job.deadline > now
            ):
                # Output the client never saw can be thrown away and made again.
                job.attempts += 1
                job.worker = None
                job.chunks.clear()
                job.first_token_at = None
                self.gate.push(job, front=True)  # it waited longest
            elif self._can_fall_back(job):
                self._reroute(job, "worker_lost", now)
            else:
                self._give_up(job, reason, now)
        if worker.kind == "llm" and not self.workers.of_kind("llm"):
            for queued in list(self.gate):  # nobody left to run them: the rules answer
                if self._can_fall_back(queued):
                    self._reroute(queued, "no_model_worker", now)
        self._dispatch(now)

    def _give_up(self, job: Job, reason: str, now: float) -> None:
        self.stats.count("worker_lost")
        body = p.error_reply(
            job.req.id,
            ErrorCode.UNAVAILABLE,
            f"worker lost: {reason}",
            text="".join(job.chunks),
            reason="worker_lost",
            retry_after_ms=1000,
        )
        self._answer(job, body, now)
        self._forget(job)

    def _finish_early(
        self, job: Job, code: ErrorCode, message: str, now: float, **extra: Any
    ) -> None:
        """Answer ``job`` now with ``code``; a running job is cancelled on its worker."""
        self._answer(
            job, p.error_reply(job.req.id, code, message, text="".join(job.chunks), **extra), now
        )
        if job.worker is None:
            self._forget(job)
            return
        self._send_worker(job.worker, WorkerCommand.CANCEL, {"rid": job.rid})
        self.jobs.arm("ack", job.rid, now + self.settings.cancel_grace_ms / 1000)

    def _answer(self, job: Job, body: dict[str, Any], now: float) -> None:
        """Send ``job``'s one final reply; the client may reuse its id at once.

        A model copy (shadow/dual) has no client: its result only goes to the router.
        """
        job.replied = True
        self.router.finished(job, body, now)
        if job.copy_of is not None:
            return
        self.jobs.release(job)
        self.gate.closed(job.client)
        self._send_client(job.client, body)

    def _forget(self, job: Job) -> None:
        self.jobs.forget(job)
        self.gate.remove(job)

    # ------------------------------------------------------------------ dispatch

    def _free_credit(self, kind: str) -> int:
        """Credit of ``kind``'s workers the broker may still use; under memory
        pressure the gate withholds some of the model's (the rules need none)."""
        pool = self.workers.of_kind(kind)
        slots = sum(w.slots for w in pool)
        in_flight = sum(len(w.active) for w in pool)
        limit = self.gate.concurrency(slots) if kind == "llm" else slots
        return min(sum(w.credit for w in pool), limit - in_flight)

    def _dispatch(self, now: float) -> None:
        """Send queued requests, by priority then age, while credit allows."""
        free = {"llm": self._free_credit("llm"), "rules": self._free_credit("rules")}
        for job in self.gate:
            if free[job.kind] <= 0:
                if not any(n > 0 for n in free.values()):
                    return
                continue
            worker = self.workers.pick(job.kind)
            if worker is None:
                continue  # another kind of worker may still take later requests
            self.gate.remove(job)
            free[job.kind] -= 1
            worker.active.add(job.rid)
            if len(worker.active) == 1:
                worker.progress_at = now  # the stall clock starts when work starts
            worker.last_dispatch = now
            job.worker = worker.identity
            job.dispatched_at = now
            body = {"rid": job.rid, **job.req.engine_fields()}
            body.setdefault("max_tokens", self.settings.default_max_tokens)
            body["timeout_ms"] = max(1, int((job.deadline - now) * 1000))
            self._send_worker(worker.identity, WorkerCommand.REQUEST, body)

    # ------------------------------------------------------------------ output

    def _send_client(self, identity: bytes, body: dict[str, Any]) -> None:
        self.to_clients.append(p.client_frames(identity, body))

    def _send_worker(self, identity: bytes, command: WorkerCommand, body: dict[str, Any]) -> None:
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
            "routing": self.router.snapshot(now),
            "draining": self.draining,
            "workers": workers,
            "counters": dict(self.stats.counters),
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
                self._answer(job, body, now)
            self._forget(job)

    def pending_jobs(self) -> int:
        """Accepted requests without a final reply yet (0 means drained)."""
        return self.jobs.pending()
