"""The broker's records: its settings, an accepted request and its state, a worker event.

Plain data shared by the core, the admission gate and the I/O loop. A job's
state changes only through ``broker.jobs.JobTable``'s transitions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, get_args

from broker import protocol as p
from broker.breaker import Permit
from broker.client_request import ClientRequest
from broker.errors import ConfigError
from broker.exits import ExitCause
from broker.kinds import DISPATCH_ORDERS, DegradeReason, DispatchOrder, EngineKind

#: ``BrokerSettings.service_estimate``: how admission predicts a request's service
#: time, by its size (tokens) or by the mean of the recent ones.
ServiceEstimate = Literal["size", "mean"]
SERVICE_ESTIMATES: tuple[ServiceEstimate, ...] = get_args(ServiceEstimate)


@dataclass(frozen=True)
class BrokerSettings:
    """Broker knobs; times in milliseconds.

    ``heartbeat_interval_ms`` x ``heartbeat_liveness`` of silence marks a worker
    dead (Paranoid Pirate, zguide ch. 4: 1000 ms x 3). A busy worker whose
    progress counter has not moved for ``stall_timeout_ms`` is stalled.
    ``cancel_grace_ms`` is how long a cancelled worker has to ack before it is
    treated as hung. ``max_queue`` bounds waiting requests (0 = 8 per pool
    slot); ``max_in_flight_per_client`` caps one client's queued + running
    requests (429 above it). ``service_estimate`` is how admission predicts
    service times: ``size`` (each request from its prompt tokens and
    ``max_tokens``, ``broker.service_model``) or ``mean`` (one mean per engine, the
    estimator before it; kept for benchmarks that compare the two).
    ``client_backlog`` bounds the final replies that may wait for one client
    that is not reading (``broker.delivery``): one more and the client is
    treated as gone. 64: four times the default in-flight cap, so a client
    must keep sending while it does not read to reach it.
    ``retry_ttl_ms``, ``retry_cache_entries`` and ``retry_cache_bytes`` bound the
    final replies kept for safe retry (``broker.reply_cache``): 30 s covers a
    client's own timeout plus a resend or two; 1024 replies and 8 MiB cap the
    memory, about 32 replies at the 256 KiB body limit, far more at usual sizes.
    ``dispatch`` is which worker with free credit takes the next request
    (``broker.kinds.DispatchOrder``): ``local_first`` (this host's workers
    before remote host agents') or ``credit`` (the most free credit anywhere).
    """

    max_body_bytes: int = p.DEFAULT_MAX_BODY_BYTES
    max_queue: int = 64
    default_timeout_ms: int = 60_000
    max_timeout_ms: int = 600_000
    default_max_tokens: int = 128
    heartbeat_interval_ms: int = 500
    heartbeat_liveness: int = 3
    stall_timeout_ms: int = 15_000
    cancel_grace_ms: int = 2000
    max_in_flight_per_client: int = 16
    service_estimate: ServiceEstimate = "size"
    client_backlog: int = 64
    retry_ttl_ms: int = 30_000
    retry_cache_entries: int = 1024
    retry_cache_bytes: int = 8 * 1024 * 1024
    dispatch: DispatchOrder = "local_first"

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_ORDERS:
            raise ConfigError(
                f"broker.dispatch must be one of {', '.join(DISPATCH_ORDERS)}, "
                f"got {self.dispatch!r}"
            )
        if self.service_estimate not in SERVICE_ESTIMATES:
            raise ConfigError(
                f"broker.service_estimate must be one of {', '.join(SERVICE_ESTIMATES)}, "
                f"got {self.service_estimate!r}"
            )


class JobState(Enum):
    """Where a job is in its life (``broker.jobs.JobTable`` moves it).

    ``QUEUED`` -> ``RUNNING`` (dispatched) -> back to ``QUEUED`` once if its
    worker is lost (re-dispatched). A job is *settled* when nothing more of it
    reaches its client: ``ANSWERED`` (its one final reply is out, or was due to
    a client that is gone), ``HANDED_OVER`` (another job answers its client: a
    fallback or a winning hedge) or ``DROPPED`` (a hedge whose answer nobody
    takes; a running one finishes, its FINAL only frees the slot). A settled
    job still running is told to stop: ``CANCELLING`` until its worker acks.
    """

    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    ANSWERED = "answered"
    HANDED_OVER = "handed_over"
    DROPPED = "dropped"


#: The states of a job that still owes its client a final reply.
OPEN_STATES = frozenset({JobState.QUEUED, JobState.RUNNING})


@dataclass
class Job:
    """One accepted client request while the broker owns it.

    ``kind`` is the engine it is routed to (``llm`` or ``rules``); ``degraded``
    says why the rules answer instead of the model (None if they do not);
    ``permit`` is the circuit breaker's permit of a model call; ``copy_of`` marks
    an internal model copy of request ``copy_of`` (shadow/dual): it has no
    client and its result is only compared and logged. ``hedge_of`` marks the
    rules' hedge of the model request ``hedge_of`` (degrade mode's latency
    budget): it answers the client only if a rule matched; ``hedged_by`` is the
    model request's hedge (kept once it ended, so a request is hedged once).
    ``prompt_tokens`` is the admission gate's count (or estimate) of the
    prompt, for predicting its service time (``broker.service_time``): set at
    admission, None while there is neither.
    ``state`` is where it is in its life (``JobState``); ``worker`` the worker
    holding it (running or cancelling), ``attempts`` its re-dispatches.
    ``first_token_at``/``last_token_at``: when its first and latest PARTIAL came.
    ``ack_late_since``: when the grace for its worker's ack of its CANCEL first
    ran out (``broker.liveness.Liveness.ack_overdue``), None until it has.
    ``principal``: the key its client authenticated with (a CURVE public key,
    Z85), None on a frontend without CURVE; ``owner`` is who the per-client cap
    counts it against.
    """

    rid: int
    client: bytes
    req: ClientRequest
    accepted_at: float
    deadline: float
    worker: bytes | None = None
    dispatched_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    chunks: list[str] = field(default_factory=list)
    state: JobState = JobState.QUEUED
    attempts: int = 0
    kind: EngineKind = "llm"
    degraded: DegradeReason | None = None
    permit: Permit | None = None
    copy_of: int | None = None
    hedge_of: int | None = None
    hedged_by: int | None = None
    prompt_tokens: float | None = None
    ack_late_since: float | None = None
    principal: bytes | None = None

    @property
    def owner(self) -> bytes:
        """Who the per-client in-flight cap counts this job against: the client's
        authenticated key if it has one, else its routing id (one connection)."""
        return self.client if self.principal is None else self.principal

    @property
    def settled(self) -> bool:
        """Whether its client's final is decided: answered, handed over or dropped."""
        return self.state not in OPEN_STATES


@dataclass(frozen=True)
class WorkerEvent:
    """Something the supervisor must act on: ``kind`` is ``ready`` or ``lost``.

    A ``lost`` event's ``cause`` carries the broker's verdict (one of
    ``broker.exits.KILL_VERDICTS``): the supervisor kills the process.
    """

    kind: Literal["ready", "lost"]
    worker_id: str
    pid: int | None
    cause: ExitCause | None = None


#: A step of one request's path through the broker, as the node logs it
#: (``RequestTrace``): ``admitted`` (queued), ``dispatched`` (a REQUEST sent to
#: a worker), ``cancelling`` (a CANCEL sent: deadline, client, shed),
#: ``requeued`` (its worker was lost; it runs again) and ``worker_final`` (its
#: worker's FINAL came). Its reply is logged by the node from the outbox.
TraceStep = Literal["admitted", "dispatched", "cancelling", "requeued", "worker_final"]


@dataclass(frozen=True)
class RequestTrace:
    """One step of a request's path (``TraceStep``), for the node's log only:
    nothing in the broker reads it back.

    Attributes:
        step: the step.
        rid: the broker's request number.
        request_id: the client's ``id``.
        client: the client's routing id (b"" for a shadow/dual model copy).
        worker: the worker's id (``llm-0``) for the steps on a worker, else "".
        detail: the step's particulars in a word or two: the engine kind and
            priority (``admitted``), the attempt (``dispatched``), the worker's
            status (``worker_final``), the cause (``requeued``).
        principal: the client's CURVE key (Z85; ``Job.principal``), None without CURVE.
    """

    step: TraceStep
    rid: int
    request_id: str | int
    client: bytes
    worker: str = ""
    detail: str = ""
    principal: bytes | None = None
