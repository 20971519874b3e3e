"""The broker's side of the worker conversation: dispatch, replies, liveness, loss.

``WorkerConversation`` speaks to the workers on the backend: it sends REQUESTs
while credit allows, reads READY, HEARTBEAT, PARTIAL, FINAL, CREDIT and
DISCONNECT, cancels running jobs (the credit returns only with the worker's
ack), sends heartbeats and gives up on dead, stalled or hung workers.

It owns no state of its own beyond the heartbeat schedule: the registry, the
job table, the queue, the router and the counters belong to ``broker.core.Broker``,
which hands them over as references. How a job *ends* (its one final reply,
a hand-over to the rules) is the broker's decision, and messages and supervisor
events go to the broker's outboxes (the I/O loop swaps those lists for empty
ones, so nobody may keep a reference to them): both go through ``Owner``.
"""

from __future__ import annotations

from typing import Any, Protocol

from broker import protocol as p
from broker.admission import AdmissionGate
from broker.delivery import ReplyKind
from broker.errors import ErrorCode, ProtocolError
from broker.jobs import JobTable
from broker.kinds import DegradeReason, EngineKind
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings, Job, WorkerEvent
from broker.replies import final_reply
from broker.routing import Router
from broker.service_time import ServiceEstimator
from broker.stats import Stats
from broker.workers import WorkerRegistry, WorkerState, parse_ready


class Owner(Protocol):
    """What the worker conversation asks of the broker: how jobs end, and sending."""

    @property
    def events(self) -> list[WorkerEvent]:
        """The supervisor events not yet taken by the I/O loop (appended to)."""
        ...

    @property
    def draining(self) -> bool:
        """Whether the node is stopping (a worker exiting then is no failure)."""
        ...

    def forget(self, job: Job) -> None:
        """Drop ``job`` from the ledger and the queue."""
        ...

    def answer(
        self,
        job: Job,
        body: dict[str, Any],
        now: float,
        deliver: bool = True,
        counted: str | None = None,
    ) -> None:
        """Send ``job``'s one final reply ``body`` to its client (``counted``: the
        outcome counter it was counted under)."""
        ...

    def fall_back(self, job: Job, reason: DegradeReason, now: float) -> bool:
        """Hand ``job`` to the rules if degrade mode allows; False if it does not."""
        ...

    def send_client(self, identity: bytes, body: dict[str, Any], kind: ReplyKind) -> None:
        """Queue ``body`` for the client ``identity`` (a streamed chunk: ``PARTIAL``)."""
        ...

    def send_worker(self, identity: bytes, command: WorkerCommand, body: dict[str, Any]) -> None:
        """Queue ``command`` with ``body`` for the worker ``identity``."""
        ...


class WorkerConversation:
    """Dispatch, worker messages, cancellation, heartbeats and liveness verdicts.

    Args:
        settings: the broker's knobs (heartbeats, stall and cancel timings).
        workers, jobs, gate, router, stats: the broker's registry, job table,
            queue, router and counters (references, not copies).
        owner: the broker, for the end of a job and for sending.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        *,
        workers: WorkerRegistry,
        jobs: JobTable,
        gate: AdmissionGate,
        router: Router,
        stats: Stats,
        estimator: ServiceEstimator,
        owner: Owner,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.jobs = jobs
        self.gate = gate
        self.router = router
        self.stats = stats
        self.estimator = estimator
        self.owner = owner
        self.next_heartbeat = 0.0
        #: rid -> when its CANCEL's grace first ran out while its worker still made
        #: progress (a slow step beside other slots, a starved process): ``hung``.
        self.late_acks: dict[int, float] = {}
        #: When ``tick`` last ran (monotonic s), to notice the broker's own pauses.
        self.last_tick: float | None = None

    # ------------------------------------------------------------------ messages

    def handle(self, frames: list[bytes], now: float) -> None:
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
                self.lose_worker(
                    known, f"protocol error: {exc.message}", now, notify=False, failure=False
                )
            else:
                self.send(identity, WorkerCommand.DISCONNECT, {"reason": "protocol error"})
            return
        worker = self.workers.get(identity)
        if command is WorkerCommand.READY:
            self._register(identity, body, now)
            return
        if worker is None:
            # Unknown peer (e.g. the broker restarted): make it re-register.
            if command is not WorkerCommand.DISCONNECT:
                self.send(identity, WorkerCommand.DISCONNECT, {"reason": "not registered"})
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
                self.dispatch(now)
        elif command is WorkerCommand.DISCONNECT:
            self.lose_worker(worker, "disconnected", now, notify=False, failure=False)

    def _register(self, identity: bytes, body: dict[str, Any], now: float) -> None:
        if self.workers.get(identity) is not None:
            return  # a duplicate READY changes nothing: credit is not re-granted
        try:
            worker = parse_ready(identity, body, now)
        except ProtocolError as exc:
            self.send(identity, WorkerCommand.DISCONNECT, {"reason": exc.message})
            return
        stale = self.workers.by_worker_id(worker.worker_id)
        if stale is not None:
            self.lose_worker(
                stale, "replaced by a new incarnation", now, notify=False, failure=False
            )
        self.workers.add(worker)
        self.owner.events.append(WorkerEvent("ready", worker.worker_id, worker.info.get("pid")))
        self.dispatch(now)

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
            self.estimator.levels.first_token(worker.identity, job.rid, now)
        # A hedge's text is held back: it is the client's only if the rules win.
        if job.req.stream and job.hedge_of is None:
            partial = p.partial_reply(job.req.id, text, len(job.chunks))
            self.owner.send_client(job.client, partial, ReplyKind.PARTIAL)
        job.chunks.append(text)

    def _on_final(self, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        rid = body.get("rid")
        job = self._owned_job(worker, body)
        if isinstance(rid, int):
            worker.active.discard(rid)  # the credit returns with the ack, never earlier
        if job is not None:
            self.jobs.disarm("ack", job.rid)
            self.late_acks.pop(job.rid, None)
            if not job.replied:
                self._reply_final(job, worker, body, now)  # learns its batch level first
            self.owner.forget(job)
        self.estimator.levels.running(worker.identity, worker.active, now)
        self.dispatch(now)

    def _reply_final(self, job: Job, worker: WorkerState, body: dict[str, Any], now: float) -> None:
        reply, outcome = final_reply(job, worker.kind, worker.worker_id, body, now)
        if outcome == "ok" and job.dispatched_at is not None:
            max_tokens = job.req.max_tokens or self.settings.default_max_tokens
            self.estimator.observe_final(job, body.get("usage"), now, max_tokens)
        self.stats.count(outcome)
        self.owner.answer(job, reply, now, counted=outcome)

    # ------------------------------------------------------------------ sending

    def free_credit(self, kind: str) -> int:
        """Credit of ``kind``'s workers the broker may still use; under memory
        pressure the gate withholds some of the model's (the rules need none)."""
        pool = self.workers.of_kind(kind)
        slots = sum(w.slots for w in pool)
        in_flight = sum(len(w.active) for w in pool)
        limit = self.gate.concurrency(slots) if kind == "llm" else slots
        return min(sum(w.credit for w in pool), limit - in_flight)

    def dispatch(self, now: float) -> None:
        """Send queued requests, by priority then age, while credit allows."""
        free = {"llm": self.free_credit("llm"), "rules": self.free_credit("rules")}
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
            self.estimator.levels.running(worker.identity, worker.active, now)
            if len(worker.active) == 1:
                worker.progress_at = now  # the stall clock starts when work starts
            worker.last_dispatch = now
            job.worker = worker.identity
            job.dispatched_at = now
            body = {"rid": job.rid, **job.req.engine_fields()}
            body.setdefault("max_tokens", self.settings.default_max_tokens)
            body["timeout_ms"] = max(1, int((job.deadline - now) * 1000))
            self.send(worker.identity, WorkerCommand.REQUEST, body)

    def cancel(self, job: Job, now: float) -> None:
        """Tell ``job``'s worker to stop it; the credit returns with the worker's
        ack (its FINAL), and no ack within ``cancel_grace_ms`` means it hangs."""
        assert job.worker is not None
        self.send(job.worker, WorkerCommand.CANCEL, {"rid": job.rid})
        self.jobs.arm("ack", job.rid, now + self.settings.cancel_grace_ms / 1000)

    def send(self, identity: bytes, command: WorkerCommand, body: dict[str, Any]) -> None:
        """Queue ``command`` with ``body`` for the worker ``identity``."""
        self.owner.send_worker(identity, command, body)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> None:
        """Give up on dead or stalled workers; send the heartbeats due at ``now``."""
        s = self.settings
        interval = s.heartbeat_interval_ms / 1000
        dead_after = interval * s.heartbeat_liveness
        if self.last_tick is not None and now - self.last_tick > dead_after:
            # The broker itself did not run for a whole liveness window (SIGSTOP,
            # a VM or swap stall): the workers' silence meanwhile is no evidence,
            # and those that gave up on it have re-registered under new identities
            # whose READYs are still unread. Judging them now killed every healthy
            # worker after a 5 s pause (break-it session); only the time beyond one
            # normal interval between ticks is forgiven.
            self.workers.excuse(now - self.last_tick - interval)
        self.last_tick = now
        for worker, reason in self.workers.verdicts(now, dead_after, s.stall_timeout_ms / 1000):
            self.lose_worker(worker, reason, now)
        if now >= self.next_heartbeat:
            self.next_heartbeat = now + s.heartbeat_interval_ms / 1000
            for worker in self.workers:
                self.send(worker.identity, WorkerCommand.HEARTBEAT, {})

    def hung(self, job: Job, now: float) -> None:
        """``job``'s worker did not ack a CANCEL within the grace: give up on it,
        unless its progress counter moved during the grace.

        A multi-slot worker acks a cancel after its current step, which under host
        CPU load (a nice-10 worker starved by nice-0 work) can outlast the grace
        while its other slots go on producing tokens: killing it cost all its slots
        (break-it session). Such a worker gets more graces, up to
        ``stall_timeout_ms`` in all; one whose progress stops is hung, as before.
        """
        worker = None if job.worker is None else self.workers.get(job.worker)
        if worker is None:
            return
        grace = self.settings.cancel_grace_ms / 1000
        late_since = self.late_acks.setdefault(job.rid, now)
        working = worker.progress_at > now - grace
        if working and now - late_since < self.settings.stall_timeout_ms / 1000:
            self.jobs.arm("ack", job.rid, now + grace)
            return
        self.late_acks.pop(job.rid, None)
        self.lose_worker(worker, "hung: no ack to CANCEL within the grace", now)

    # ------------------------------------------------------------------ loss

    def worker_exited(self, worker_id: str, reason: str, now: float) -> None:
        """The supervisor reaped this worker's process: fail over without waiting."""
        worker = self.workers.by_worker_id(worker_id)
        if worker is not None:
            # A crash is the pool's failure; an exit while the node stops is not.
            self.lose_worker(worker, reason, now, notify=False, failure=not self.owner.draining)

    def lose_worker(
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
        self.estimator.levels.running(worker.identity, (), now)
        self.stats.count("workers_lost")
        if notify:
            pid = worker.info.get("pid")
            self.owner.events.append(WorkerEvent("lost", worker.worker_id, pid, reason))
        # If it is merely slow it must not keep the requests: make it re-register.
        self.send(worker.identity, WorkerCommand.DISCONNECT, {"reason": reason})
        if worker.kind == "llm" and failure and not worker.active:
            self.router.worker_failed(None, now, reason)
        blamed = blames_its_request(reason, len(worker.active), worker.kind, failure=failure)
        for rid in sorted(worker.active):
            job = self.jobs.get(rid)
            if job is None:
                continue
            self.jobs.disarm("ack", rid)
            self.late_acks.pop(rid, None)
            if worker.kind == "llm" and failure:
                self.router.worker_failed(job, now, reason)
            else:
                # Not the pool's failure (replaced, disconnected, stopping): its
                # 503 worker_lost must not count against the breaker either.
                self.router.release(job, now)
            if job.replied:
                self.owner.forget(job)
            elif (
                (not job.req.stream or not job.chunks)
                and job.attempts == 0
                and job.deadline > now
                and not blamed
            ):
                # Output the client never saw can be thrown away and made again.
                job.attempts += 1
                job.worker = None
                job.chunks.clear()
                job.first_token_at = None
                self.gate.push(job, front=True)  # it waited longest
            elif not self.owner.fall_back(job, "worker_lost", now):
                self._give_up(job, reason, now, blamed, worker.kind)
        if worker.kind == "llm" and not self.workers.of_kind("llm"):
            for queued in list(self.gate):  # nobody left to run them: the rules answer
                self.owner.fall_back(queued, "no_model_worker", now)
        self.dispatch(now)

    def _give_up(self, job: Job, reason: str, now: float, blamed: bool, kind: EngineKind) -> None:
        if blamed and kind == "rules":
            reason += " (not retried: the rule engine failed running this request)"
        elif blamed and OOM_KILLED in reason:
            reason += " (not retried: the worker ran out of memory running this request)"
        elif blamed:
            reason += " (not retried: the worker crashed running this request)"
        self.stats.count("worker_lost")
        body = p.error_reply(
            job.req.id,
            ErrorCode.UNAVAILABLE,
            f"worker lost: {reason}",
            text="".join(job.chunks),
            reason="worker_lost",
            retry_after_ms=1000,
        )
        self.owner.answer(job, body, now)
        self.owner.forget(job)


#: Signals of a crash inside the worker's own (native) code, as the supervisor
#: words them ("killed by SIGSEGV", node.supervisor.describe_exit). The request
#: it was running is the likeliest cause (a grammar llama.cpp cannot parse
#: dereferenced a null pointer: found in a break-it session), so it is not
#: re-dispatched: a poison request would take every worker down in turn. A
#: plain SIGKILL (kill -9, our own verdicts) or a missed heartbeat says nothing
#: about the request, which is re-dispatched once as before.
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")

#: How the node words an OOM kill the worker's cgroup recorded (node.pool), in
#: place of the SIGKILL alone. A worker's cgroup holds that worker and its one
#: sequence, so what outgrew the limit is the running request's memory (its
#: KV, a json_schema's grammar): run again on an identical worker it was
#: OOM-killed there too (break-it session, memory_max 256M and a schema).
OOM_KILLED = "OOM-killed in its cgroup"


def crashed_running_it(reason: str) -> bool:
    """Whether a worker's exit ``reason`` blames what it was running: a native
    crash (``CRASH_SIGNALS``) or an OOM kill in its cgroup (``OOM_KILLED``)."""
    return OOM_KILLED in reason or any(f"killed by {name}" in reason for name in CRASH_SIGNALS)


def blames_its_request(
    reason: str, running: int, kind: EngineKind = "llm", *, failure: bool = True
) -> bool:
    """Whether a lost worker's request is the poison one, never to be run again.

    A crash or OOM kill (``crashed_running_it``) with one request in flight blames
    that request. With several (an S-slot worker) none can be told from the
    others, so none is blamed: each that streamed nothing is re-dispatched once,
    like any lost request, and a request is never re-dispatched twice. A poison
    request therefore takes down at most two workers: the one it shared, and
    the one it was retried on.

    A rule worker lost by a failure (dead, stalled, hung, exited; not a clean
    DISCONNECT, a replacement or the node stopping: ``failure``) with one request
    in flight blames it whatever the reason: the rule engine is deterministic and
    answers in microseconds, so what stopped it was that request, and the
    restarted rule worker would die of it too (issue 11: a catastrophic regex
    killed the rule worker twice). An operator's SIGSTOP during those
    microseconds is the only false verdict, and costs that one request.
    """
    if running != 1:
        return False
    if kind == "rules":
        return failure
    return crashed_running_it(reason)
