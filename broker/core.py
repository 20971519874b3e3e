"""The sans-I/O broker: the client and worker message switches, and the timers.

``Broker`` never touches a socket or a clock. The I/O loop feeds it frames and
the current monotonic time, and drains what it wants done from ``outbox``
(``broker.outbox``): that is what lets deadlines, credit and liveness be tested
with a fake clock.

``Broker`` decides *when* a job ends and why: a client's message (accept,
refuse, cancel), a worker's message (partial, final, loss), a timer (deadline,
latency budget, cancel grace), the node's pressure readings. It builds its
parts and asks them, each of which owns its state and never calls back:

* ``broker.queue``: the requests waiting for a slot, and each client's open ones;
* ``broker.pressure``: the node's memory and CPU pressure levels, and what they shed;
* ``broker.snapshot``: the pool as one request finds it, for routing and admission;
* ``broker.admission``: whether a request may wait in the queue (the ordered checks);
* ``broker.service_time``: the service-time estimator (the rates of
  ``broker.service_model``, the batch levels of ``broker.batch_levels``, retry
  advice) that admission reads and the worker messages teach;
* ``broker.routing``: which engine answers (migration modes, circuit breaker);
* ``broker.dispatch``: credit, REQUESTs and CANCELs;
* ``broker.liveness``: heartbeats and the dead/stalled/hung verdicts;
* ``broker.lifecycle``: how a job ends (answer, hand over, drop) and what that
  causes, through ``broker.jobs``'s checked state transitions;
* ``broker.handover``: degrade mode's fallbacks and hedges to the rules;
* ``broker.exits``: why a worker is gone, and whether its request runs again.

Invariant: every accepted client request gets exactly one final reply
(``ok`` or ``error``), whatever happens to its worker. The path of one request
through these modules: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from broker import protocol as p
from broker.admission import DRAINING, AdmissionGate, Admit, Shed
from broker.breaker import BreakerSettings
from broker.client_request import ClientRequest, parse_client_request
from broker.delivery import Delivery, GoneCause, ReplyKind
from broker.dispatch import Dispatcher
from broker.errors import EdgeNodeError, ErrorCode, ProtocolError
from broker.exits import ExitCause, blames_its_request, not_retried
from broker.handover import Handover
from broker.jobs import JobTable
from broker.kinds import (
    PRESSURE_LEVELS,
    CpuLevel,
    EngineKind,
    FinalOutcome,
    RoutingMode,
    ShedReason,
)
from broker.lifecycle import Lifecycle
from broker.liveness import Liveness
from broker.observations import Ended, TokenGap
from broker.outbox import Outbox
from broker.pressure import PressureLevels
from broker.protocol import WorkerCommand
from broker.queue import ClientCounts, RequestQueue
from broker.records import BrokerSettings, Job, JobState, WorkerEvent
from broker.replies import ERROR_OUTCOMES, final_reply
from broker.reply_cache import ReplyCache, fingerprint
from broker.routing import LATE_HEDGE_S, Route, Router, RoutingSettings
from broker.service_time import ServiceEstimator
from broker.snapshot import PoolSnapshot, PoolView
from broker.stats import Stats
from broker.token_count import TokenCounter
from broker.workers import WorkerRegistry, WorkerState, parse_ready

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
        #: Everything the broker wants done, taken by the I/O loop.
        self.outbox = Outbox()
        self.workers = WorkerRegistry()
        self.stats = Stats()
        self.estimator = ServiceEstimator(
            settings.service_estimate == "size", settings.default_max_tokens
        )
        self.jobs = JobTable()
        self.reply_cache = ReplyCache(
            settings.retry_ttl_ms, settings.retry_cache_entries, settings.retry_cache_bytes
        )
        self.queue = RequestQueue(self.estimator)
        self.clients = ClientCounts()
        #: The node's pressure levels: set here, read by the snapshot, the gate and dispatch.
        self.pressure = PressureLevels()
        self.snapshot = PoolSnapshot(
            self.workers, self.jobs, self.queue, self.pressure, self.estimator
        )
        self.gate = AdmissionGate(
            settings,
            self.estimator,
            self.jobs,
            self.queue,
            self.clients,
            self.workers,
            self.pressure,
            count_tokens,
        )
        self.router = Router(routing, breaker, self.outbox)
        self.delivery = Delivery(settings.client_backlog, self.stats.counters)
        self.dispatcher = Dispatcher(
            settings,
            self.workers,
            self.jobs,
            self.queue,
            self.pressure,
            self.estimator,
            self.outbox,
        )
        self.liveness = Liveness(settings, self.workers, self.outbox)
        self.life = Lifecycle(
            self.jobs,
            self.queue,
            self.clients,
            self.router,
            self.dispatcher,
            self.stats,
            self.outbox,
            self.reply_cache,
        )
        self.handover = Handover(
            self.life, self.jobs, self.queue, self.router, self.stats, self.workers
        )
        self._status_hook = status_hook
        self.draining = False

    # ------------------------------------------------------------------ clients

    def handle_client(
        self, frames: list[bytes], now: float, principal: bytes | None = None
    ) -> None:
        """Handle one frontend message ``[identity, "", "EDGE/C1", body]``.

        ``principal``: the key the client's connection authenticated with (its
        CURVE public key, Z85, from the loop), None without CURVE. It, not the
        routing id, is what the per-client in-flight cap counts: two connections
        with one key share one cap. Replies still go to the routing id.
        """
        if not frames:
            return
        identity = frames[0]
        body = b""
        try:
            _, body = p.split_client_frames(frames)
            p.check_body_size(body, self.settings.max_body_bytes)
            req = parse_client_request(p.unpack_map(body))
        except EdgeNodeError as exc:
            self.stats.count("rejected_bad_request")
            # Bodies are bounded by ZMQ_MAXMSGSIZE, so salvaging even an oversized one is cheap.
            rid = p.salvage_id(body)
            self.outbox.client(identity, p.error_reply(rid, exc.code, exc.message))
            return
        if req.op == "ping":
            self.outbox.client(identity, p.ok_reply(req.id, pong=True, version=p.PROTOCOL_VERSION))
        elif req.op == "status":
            self.outbox.client(identity, p.ok_reply(req.id, node=self.status(now)))
        elif req.op == "cancel":
            self._cancel_by_client(identity, req, now)
        elif not (req.retry and self._answer_retry(identity, req, now)):
            self._accept(identity, req, now, principal)

    def _answer_retry(self, identity: bytes, req: ClientRequest, now: float) -> bool:
        """Safe retry (PROTOCOL §3.5): a resend of a request still running is
        attached to it (no reply of its own: the running request's one final
        answers the id), one answered within the TTL gets that final again with
        ``replayed: true``. False: nothing known of the id, or it was a different
        request (the gate's ``duplicate_id`` if it runs): admit it as new."""
        job = self.jobs.of_client(identity, req.id)
        if job is not None and not job.settled:
            if fingerprint(job.req) != fingerprint(req):
                return False
            self.stats.count("retry_attached")
            return True
        kept = self.reply_cache.find((identity, req.id), now)
        if kept is None:
            return False
        if kept.fingerprint != fingerprint(req):
            self.stats.count("rejected_bad_request")
            message = f"id {req.id!r} answered a different request (safe retry)"
            shed = Shed(ErrorCode.BAD_REQUEST, "duplicate_id", message)
            self._refuse(identity, req.id, shed, "rules" if req.route == "rules" else "llm")
            return True
        self.stats.count("retry_replayed")
        self.outbox.client(identity, {**kept.body, "replayed": True})
        return True

    def _accept(
        self, identity: bytes, req: ClientRequest, now: float, principal: bytes | None = None
    ) -> None:
        """Route, admit, queue and dispatch a new ``generate`` request (each module
        once on the way in: docs/ARCHITECTURE.md, "One generate request")."""
        pool = self.snapshot.view(req.priority, self.draining, now)
        route = self.router.route(req, pool, now)
        verdict = self._admit(identity, req, route, pool, now, principal)
        if isinstance(verdict, Shed):
            self._refuse(identity, req.id, verdict, route.kind)
            return
        route = verdict.route
        if verdict.evict is not None:  # a lower-priority request yields its place
            message = "evicted by a higher-priority request"
            self._shed_job(verdict.evict, message, "queue_full", now, verdict.evict_retry_ms)
        job = self.jobs.new(identity, req, now, verdict.deadline, route.kind, principal)
        job.degraded, job.permit = route.degraded, route.permit
        job.prompt_tokens = verdict.prompt_tokens
        self.jobs.bind(job)
        if route.ttft_budget_s is not None and not route.hedge:
            self.jobs.arm("ttft", job.rid, now + route.ttft_budget_s)
        if route.rules_if_late and not route.hedge:
            margin = min(LATE_HEDGE_S, (verdict.deadline - now) / 2)
            self.jobs.arm("late", job.rid, verdict.deadline - margin)
        self.clients.opened(job.owner)
        self.queue.push(job)
        if route.hedge:
            self.handover.hedge(job)
        if route.copy:
            self._copy_to_model(job, route.copy, now)
        elif route.copy_skipped:
            self.router.copy_skipped(job, route.copy_skipped)
        self.stats.count("admitted")
        if self.outbox.tracing:
            self.outbox.trace("admitted", job, detail=f"{job.kind} {req.priority}")
        self.dispatcher.dispatch(now)

    def _admit(
        self,
        identity: bytes,
        req: ClientRequest,
        route: Route,
        pool: PoolView,
        now: float,
        principal: bytes | None = None,
    ) -> Shed | Admit:
        """The admission gate's verdict on ``req`` as routed by ``route``; the breaker's
        permit goes back unless the model takes the request."""
        verdict = self.gate.check(identity, req, route, pool, now, principal)
        if route.permit is not None and (isinstance(verdict, Shed) or verdict.route is not route):
            self.router.breaker.release(route.permit, now)
        return verdict

    def _copy_to_model(self, primary: Job, mode: RoutingMode, now: float) -> None:
        """Give the model a copy of ``primary`` (answered by the rules) to compare."""
        if len(self.queue) > self.pressure.queue_bound(
            self.workers.total_slots(), self.settings.max_queue
        ):
            self.router.copy_skipped(primary, "queue_full")
            return
        permit = self.router.breaker.allow(now)
        if permit is None:
            self.router.copy_skipped(primary, "circuit_open")
            return
        req = replace(primary.req, stream=False, route="llm", priority="sheddable")
        copy = self.jobs.new(b"", req, now, primary.deadline, "llm")
        copy.permit, copy.copy_of = permit, primary.rid
        self.queue.push(copy)
        self.outbox.trace("admitted", copy, detail=f"llm {mode} copy")
        self.router.open_pair(primary, mode)

    def _refuse(self, identity: bytes, rid: str | int, shed: Shed, kind: EngineKind) -> None:
        self.stats.count(f"shed_{shed.reason}")
        body = p.error_reply(
            rid, shed.code, shed.message, retry_after_ms=shed.retry_after_ms, reason=shed.reason
        )
        self.outbox.client(identity, body)
        if self.outbox.observing:
            self.outbox.observations.append(
                Ended(kind, ERROR_OUTCOMES[shed.code], shed.reason, admitted=False)
            )

    def _shed_job(
        self, job: Job, message: str, reason: ShedReason, now: float, retry: int | None = None
    ) -> None:
        """Answer an admitted job 503 now (pressure, eviction) and cancel it if running;
        ``retry``: its ``retry_after_ms`` if admission gave it (an eviction), else asked."""
        self.stats.count(f"shed_{reason}")
        if retry is None:
            retry = self.gate.retry_after(self.workers.slots(job.kind), now, job.kind)
        self._finish_early(
            job, ErrorCode.UNAVAILABLE, message, now, reason=reason, retry_after_ms=retry
        )

    def set_pressure(self, level: str, now: float) -> None:
        """React to the node's memory pressure (``ok``, ``high`` or ``critical``).

        Rising pressure sheds queued work the level no longer admits and, at
        ``critical``, cancels sheddable requests in flight; the levels halve the
        queue and the credit used (``PressureLevels``). ``ok`` restores both.
        """
        if level not in PRESSURE_LEVELS or level == self.pressure.level:
            return
        self.pressure.level = level
        message = f"shed under memory pressure ({level})"
        for job in self.gate.shed_for_pressure():
            self._shed_job(job, message, "memory_pressure", now)
        if level == "critical":
            for job in self.jobs:
                sheddable = job.req.priority == "sheddable" and job.kind == "llm"
                if job.state is JobState.RUNNING and sheddable:
                    self._shed_job(job, message, "memory_pressure", now)
        self.dispatcher.dispatch(now)

    def set_cpu_pressure(self, level: CpuLevel, now: float) -> None:
        """React to the host's CPU pressure (``ok`` or ``high``, from the node's PSI reading).

        ``high``: queued sheddable model work is answered 503 ``cpu_pressure`` and
        new sheddable model work is refused (``AdmissionGate``); in degrade mode
        ``auto`` requests go to the rules (``Router``). ``ok`` restores both.
        """
        if level == self.pressure.cpu:
            return
        self.pressure.cpu = level
        for job in self.gate.shed_for_cpu():
            self._shed_job(job, "shed under CPU pressure", "cpu_pressure", now)
        self.dispatcher.dispatch(now)

    def _cancel_by_client(self, identity: bytes, req: ClientRequest, now: float) -> None:
        assert req.target is not None
        job = self.jobs.of_client(identity, req.target)
        if job is None or job.settled:
            self.outbox.client(
                identity,
                p.error_reply(req.id, ErrorCode.NOT_FOUND, f"no request {req.target!r} in flight"),
            )
            return
        self.stats.count("cancelled_by_client")
        self._finish_early(job, ErrorCode.CANCELLED, "cancelled by client", now)
        self.outbox.client(identity, p.ok_reply(req.id, cancelled=req.target))

    def client_gone(self, identity: bytes, cause: GoneCause, now: float) -> int:
        """The client ``identity`` is gone (``cause``): nothing more is sent to it.

        Its waiting finals are discarded (``Delivery.forget``). Each of its
        requests without a final reply ends with none, counted ``client_gone``
        (never ``ok``): a queued one leaves the queue, a running one is
        cancelled on its worker, whose credit returns with the ack. A rules
        hedge ends with the request it hedges. Returns how many requests ended.
        """
        self.delivery.forget(identity)
        self.reply_cache.forget_client(identity)
        ended = 0
        for job in self.jobs:
            if job.client != identity or job.settled or job.hedge_of is not None:
                continue
            self.stats.count("client_gone")
            message = f"client gone ({cause.value})"
            self._finish_early(job, ErrorCode.CANCELLED, message, now, deliver=False)
            ended += 1
        return ended

    # ------------------------------------------------------------------ workers

    def handle_worker(self, frames: list[bytes], now: float) -> None:
        """Handle one backend message ``[identity, "EDGE/W2 COMMAND", body]``."""
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
                    known,
                    ExitCause("protocol_error", detail=exc.message),
                    now,
                    notify=False,
                    failure=False,
                )
            else:
                self.outbox.worker(identity, WorkerCommand.DISCONNECT, {"reason": "protocol error"})
            return
        worker = self.workers.get(identity)
        if command is WorkerCommand.READY:
            self._register(identity, body, now)
            return
        if worker is None:
            # Unknown peer (e.g. the broker restarted): make it re-register.
            if command is not WorkerCommand.DISCONNECT:
                self.outbox.worker(identity, WorkerCommand.DISCONNECT, {"reason": "not registered"})
            return
        self.liveness.heard_from(worker, now)
        if command is WorkerCommand.HEARTBEAT:
            self.liveness.note_progress(worker, body.get("progress"), now)
            worker.note_started(body.get("started"))
            worker.note_compute_threads(body.get("compute_threads"))
        elif command is WorkerCommand.PARTIAL:
            self._on_partial(worker, body, now)
        elif command is WorkerCommand.FINAL:
            if "parts" in body:  # its request's last pieces of text (PROTOCOL §13.2)
                self._on_partial(worker, body, now)
            self._on_final(worker, body, now)
        elif command is WorkerCommand.CREDIT:
            slots = body.get("slots")
            if isinstance(slots, int) and not isinstance(slots, bool) and 0 <= slots <= 256:
                worker.slots = slots
                self.dispatcher.dispatch(now)
        elif command is WorkerCommand.DISCONNECT:
            self._lose_worker(worker, ExitCause("disconnected"), now, notify=False, failure=False)

    def _register(self, identity: bytes, body: dict[str, Any], now: float) -> None:
        if self.workers.get(identity) is not None:
            return  # a duplicate READY changes nothing: credit is not re-granted
        try:
            worker = parse_ready(identity, body, now)
        except ProtocolError as exc:
            self.stats.count("workers_refused")
            self.outbox.worker(identity, WorkerCommand.DISCONNECT, {"reason": exc.message})
            return
        stale = self.workers.by_worker_id(worker.worker_id)
        if stale is not None:
            self._lose_worker(stale, ExitCause("replaced"), now, notify=False, failure=False)
        self.workers.add(worker)
        self.outbox.events.append(WorkerEvent("ready", worker.worker_id, worker.info.get("pid")))
        self.dispatcher.dispatch(now)

    def _owned_job(self, worker: WorkerState, body: dict[str, Any]) -> Job | None:
        rid = body.get("rid")
        if not isinstance(rid, int) or rid not in worker.active:
            return None
        return self.jobs.get(rid)

    def _on_partial(self, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        """A PARTIAL: one piece ``{rid, text}``, or several in order ``{parts: [[rid,
        text], ...]}`` (a worker's pieces of one decode step, PROTOCOL §13.2); a piece
        that is malformed or not the worker's is ignored, the others still count."""
        if "progress" in body:
            self.liveness.note_progress(worker, body["progress"], now)
        else:
            worker.progress_at = now  # a token is progress even from a worker not counting
        parts = body.get("parts")
        if parts is None:
            self._partial_text(worker, body.get("rid"), body.get("text"), now)
        elif isinstance(parts, list):
            for part in parts:
                if isinstance(part, list) and len(part) == 2:
                    self._partial_text(worker, part[0], part[1], now)

    def _partial_text(self, worker: WorkerState, rid: Any, text: Any, now: float) -> None:
        """One piece of text of ``worker``'s request ``rid``: to its client if it streams."""
        if not isinstance(rid, int) or rid not in worker.active or not isinstance(text, str):
            return
        job = self.jobs.get(rid)
        if job is None or job.settled:
            return
        if job.first_token_at is None:
            job.first_token_at = now
            self.estimator.levels.first_token(worker.identity, job.rid, now)
        elif job.last_token_at is not None and job.copy_of is None and self.outbox.observing:
            self.outbox.observations.append(TokenGap(job.kind, now - job.last_token_at))
        job.last_token_at = now
        # A hedge's text is held back: it is the client's only if the rules win.
        if job.req.stream and job.hedge_of is None:
            partial = p.partial_reply(job.req.id, text, len(job.chunks))
            self.outbox.client(job.client, partial, ReplyKind.PARTIAL)
        job.chunks.append(text)

    def _on_final(self, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        """A worker's FINAL: each module once (docs/ARCHITECTURE.md, "One generate
        request"): the job table's lookup, the reply (a hedge's only if the rules
        win, ``Handover.take_hedge``), the job's end (``Lifecycle.finished``), the
        estimator (``ServiceEstimator.on_final``), then the freed slot's dispatch."""
        rid = body.get("rid")
        job = self._owned_job(worker, body)
        if isinstance(rid, int):
            worker.active.discard(rid)  # the credit returns with the ack, never earlier
        measured = None
        if job is not None:
            if self.outbox.tracing:
                status = str(body.get("status"))
                self.outbox.trace("worker_final", job, worker.worker_id, status)
            reply: dict[str, Any] | None = None
            outcome: FinalOutcome | None = None
            if not job.settled:
                reply, outcome = final_reply(job, worker.kind, worker.worker_id, body, now)
                if outcome == "ok" and job.dispatched_at is not None:
                    measured = job
                self.stats.count(outcome)
                if job.hedge_of is not None and not self.handover.take_hedge(job, reply, now):
                    reply = None  # dropped: the model keeps the request
            self.life.finished(job, reply, now, counted=outcome)
        self.estimator.on_final(worker.identity, worker.active, now, measured, body.get("usage"))
        self.dispatcher.dispatch(now)

    def worker_exited(self, worker_id: str, cause: ExitCause, now: float) -> None:
        """The supervisor reaped this worker's process (``cause``: how it ended):
        fail over without waiting."""
        worker = self.workers.by_worker_id(worker_id)
        if worker is not None:
            # A crash is the pool's failure; an exit while the node stops is not.
            self._lose_worker(worker, cause, now, notify=False, failure=not self.draining)

    def _lose_worker(
        self,
        worker: WorkerState,
        cause: ExitCause,
        now: float,
        *,
        notify: bool = True,
        failure: bool = True,
    ) -> None:
        """Unregister ``worker``; re-dispatch, hand over or answer its requests.

        ``cause``: why it is lost; whether its request is blamed reads its fields
        (``broker.exits.blames_its_request``), its words go to the worker's
        DISCONNECT, the breaker and the replies.
        ``notify``: tell the supervisor to kill it (the broker's own verdict).
        ``failure``: count it against the model pool's circuit breaker (not for
        a clean DISCONNECT or an incarnation replaced by a newer one).
        """
        reason = cause.describe()
        self.workers.remove(worker.identity)
        self.estimator.levels.running(worker.identity, (), now)
        self.stats.count("workers_lost")
        if notify:
            pid = worker.info.get("pid")
            self.outbox.events.append(WorkerEvent("lost", worker.worker_id, pid, cause))
        # If it is merely slow it must not keep the requests: make it re-register.
        self.outbox.worker(worker.identity, WorkerCommand.DISCONNECT, {"reason": reason})
        pool_failure = worker.kind == "llm" and failure
        blamed = blames_its_request(cause, len(worker.active), worker.kind, failure=failure)
        # The breaker counts the loss once, as the pool's failure, whatever the worker
        # held: one crash is one fault, however many slots it ended (a 4-slot crash is
        # not four failed calls; a half-open breaker reopens). A request run again
        # keeps its permit, and its own end decides its call (PROTOCOL §7.4).
        for rid in sorted(worker.active):
            job = self.jobs.get(rid)
            if job is None:
                continue
            self.jobs.disarm("ack", rid)
            # A stopping node starts no worker: a re-run would wait out the grace.
            rerun = _can_rerun(job, now, blamed) and not self.draining
            if not (pool_failure and rerun) or job.settled:
                self.router.release(job, now)
            if job.settled:
                self.life.forget(job)
            elif rerun:
                self.life.requeue(job)
                self.stats.count("requeued")
            elif not self.handover.fall_back(job, "worker_lost", now):
                self._give_up(job, cause, now, blamed, worker.kind)
        if pool_failure:
            self.router.worker_failed(now, reason)
        if worker.kind == "llm" and not self.workers.of_kind("llm"):
            for queued in list(self.queue):  # nobody left to run them: the rules answer
                self.handover.fall_back(queued, "no_model_worker", now)
        self.dispatcher.dispatch(now)

    def _give_up(
        self, job: Job, cause: ExitCause, now: float, blamed: bool, kind: EngineKind
    ) -> None:
        reason = cause.describe()
        if blamed:
            reason += f" ({not_retried(cause, kind)})"
        self.stats.count("worker_lost")
        body = p.error_reply(
            job.req.id,
            ErrorCode.UNAVAILABLE,
            f"worker lost: {reason}",
            text="".join(job.chunks),
            reason="worker_lost",
            retry_after_ms=1000,
        )
        self._end(job, body, now)
        self.life.forget(job)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> None:
        """Expire deadlines, check liveness and send heartbeats due at ``now``."""
        for timer, rid in self.jobs.expired(now):
            job = self.jobs.get(rid)
            if job is None:
                continue
            if timer == "job" and not job.settled:
                self.stats.count("deadline_exceeded")
                self._finish_early(job, ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded", now)
            elif timer in ("ttft", "late") and not job.settled:
                # ttft: no first token within the latency budget; late: no answer near
                # the deadline, where the rules' answer beats a 504.
                due = timer == "late" or job.first_token_at is None
                if due and job.hedged_by is None and self.handover.can_fall_back(job):
                    self.handover.hedge(job)
                    self.dispatcher.dispatch(now)
            elif timer == "ack":
                self._ack_overdue(job, now)
        for worker, verdict in self.liveness.verdicts(now):
            self._lose_worker(worker, ExitCause(verdict), now)
        self.liveness.heartbeats(now)

    def _ack_overdue(self, job: Job, now: float) -> None:
        """``job``'s worker did not ack its CANCEL within the grace: look again
        later if it still makes progress, else give up on it as hung."""
        worker = None if job.worker is None else self.workers.get(job.worker)
        if worker is None:
            return
        if job.ack_late_since is None:
            job.ack_late_since = now
        again = self.liveness.ack_overdue(worker, job.ack_late_since, now)
        if again is not None:
            self.jobs.arm("ack", job.rid, again)
            return
        self._lose_worker(worker, ExitCause("hung"), now)

    def next_wakeup(self, now: float) -> float:
        """Seconds until the next ``tick`` is due (the I/O loop's poll timeout)."""
        due = [self.liveness.next_heartbeat]
        deadline = self.jobs.next_timer()
        if deadline is not None:
            due.append(deadline)
        return max(0.0, min(due) - now)

    # ------------------------------------------------------------------ endings

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
        self._end(job, body, now, deliver=deliver)
        self.life.stop(job, now)

    def _end(
        self,
        job: Job,
        body: dict[str, Any],
        now: float,
        *,
        deliver: bool = True,
        counted: FinalOutcome | None = None,
    ) -> None:
        """``body`` is ``job``'s final: a hedge's answers the client only if the
        rules win (``Handover.take_hedge``, which otherwise drops it); any other
        job's is its answer (``Lifecycle.answer``)."""
        if job.hedge_of is not None and not self.handover.take_hedge(job, body, now):
            return
        self.life.answer(job, body, now, deliver=deliver, counted=counted)

    # ------------------------------------------------------------------ node

    def status(self, now: float) -> dict[str, Any]:
        """A msgpack-ready snapshot: workers, queue, in-flight, counters."""
        workers = [w.snapshot(now) for w in sorted(self.workers, key=lambda w: w.worker_id)]
        slots = self.workers.total_slots()
        node: dict[str, Any] = {
            "protocol": p.PROTOCOL_VERSION,
            "queue_depth": len(self.queue),
            "queue_bound": self.pressure.queue_bound(slots, self.settings.max_queue),
            "in_flight": self.jobs.running(),
            "credit": self.workers.total_credit(),
            "credit_limit": self.pressure.concurrency(self.workers.slots("llm")),
            "pressure": self.pressure.level,
            "cpu_pressure": self.pressure.cpu,
            "routing": self.router.snapshot(now),
            "draining": self.draining,
            "workers": workers,
            "counters": dict(self.stats.counters),
            "refused": self.stats.refusals(),
            "delivery": self.delivery.snapshot(),
            "retry_cache": self.reply_cache.snapshot(),
            "service": self.estimator.snapshot(),
        }
        if self._status_hook is not None:
            node.update(self._status_hook())
        return node

    def abort_all(self, message: str, now: float) -> None:
        """Answer every request still without a final reply with 503 (shutdown)."""
        for job in self.jobs:
            if not job.settled:
                body = p.error_reply(
                    job.req.id,
                    ErrorCode.UNAVAILABLE,
                    message,
                    text="".join(job.chunks),
                    reason="shutdown",
                )
                self._end(job, body, now)
            self.life.forget(job)

    def drain(self, now: float) -> None:
        """Begin a stop at ``now``: admit nothing new (503 ``draining``) and answer
        every queued request the same way at once. Running requests go on; the node
        gives them ``workers.stop_grace_ms``, then calls ``abort_all``. A queued
        request would otherwise wait that whole grace for a slot it could not get in
        time, then get 503 ``shutdown``."""
        self.draining = True
        for job in list(self.queue):
            self._shed_job(job, DRAINING.message, DRAINING.reason, now, DRAINING.retry_after_ms)

    def pending_jobs(self) -> int:
        """Accepted requests without a final reply yet (0 means drained)."""
        return self.jobs.pending()


def _can_rerun(job: Job, now: float, blamed: bool) -> bool:
    """Whether ``job``, lost with its worker at ``now``, may run again elsewhere: output
    the client never saw can be thrown away and made again, once, in time, unless the
    loss is blamed on the request itself (``broker.exits.blames_its_request``)."""
    return (
        not job.settled
        and (not job.req.stream or not job.chunks)
        and job.attempts == 0
        and job.deadline > now
        and not blamed
    )
