"""The vocabularies that cross broker modules and processes, defined once.

Each is a ``Literal`` (values travel as plain strings on the wire and in
counters) with the tuple of its values beside it, in the order that matters.
"""

from __future__ import annotations

from typing import Literal, get_args

#: Which pool a request runs on: the model's workers or the rule engine's.
EngineKind = Literal["llm", "rules"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)

#: Which registered worker ``broker.workers.WorkerRegistry.pick`` prefers
#: (``broker.dispatch``): ``local_first`` fills this host's workers' free credit
#: before any remote host agent's (a remote slot costs a network hop each way and
#: shares a link that may be lost); ``credit`` takes the most free credit anywhere.
DispatchOrder = Literal["local_first", "credit"]
DISPATCH_ORDERS: tuple[DispatchOrder, ...] = get_args(DispatchOrder)

#: The migration stage ``routing.mode`` (``broker.routing``), in the order a device
#: adopts the model: ``shadow`` -> ``dual`` -> ``degrade`` -> ``full``.
RoutingMode = Literal["shadow", "dual", "degrade", "full"]
ROUTING_MODES: tuple[RoutingMode, ...] = get_args(RoutingMode)

#: Why a ``shadow``/``dual`` request's model copy was not made: a migration record's
#: ``reason`` (``event: copy_skipped``, ``broker.routing.Router.copy_skipped``).
CopySkipReason = Literal["no_model_worker", "no_credit", "queue_full", "circuit_open"]

#: A registered worker's state in ``status`` (``workers[].state``,
#: ``broker.workers.WorkerState.state``): ``busy`` while it holds any request, else
#: ``ready``; either can take work while it has credit.
RegisteredState = Literal["ready", "busy"]
REGISTERED_STATES: tuple[RegisteredState, ...] = get_args(RegisteredState)

#: What a worker says of itself in each HEARTBEAT's ``state`` (docs/PROTOCOL.md:
#: informational, the broker ignores it): ``busy`` while it runs any request.
HeartbeatState = Literal["idle", "busy"]

#: A request's class (``priority`` on the wire, docs/PROTOCOL.md §3).
Priority = Literal["critical", "normal", "sheddable"]
#: Dispatch order, highest first; eviction takes from the end.
PRIORITIES: tuple[Priority, ...] = get_args(Priority)

#: The node's memory pressure level (``node.pressure``), lowest first.
PressureLevel = Literal["ok", "high", "critical"]
PRESSURE_LEVELS: tuple[PressureLevel, ...] = get_args(PressureLevel)

#: The host's CPU pressure level (PSI, ``node.pressure.CpuPressure``).
CpuLevel = Literal["ok", "high"]

#: Why degrade mode's rules answer instead of the model: the reply's
#: ``degrade_reason`` and the ``fallback_<reason>`` counters (docs/PROTOCOL.md §7.3).
#: The model's failures (``worker_lost``, ``no_model_worker``, ``circuit_open``),
#: the host's pressure (``memory_pressure``, ``cpu_pressure``) and its lateness
#: (``latency_budget``).
DegradeReason = Literal[
    "no_model_worker",
    "memory_pressure",
    "cpu_pressure",
    "circuit_open",
    "latency_budget",
    "worker_lost",
]

#: Why a defensive client (``broker.client.Client(..., fallback=...)``) answered a
#: request itself, from its local fallback, instead of the node: its reply's
#: ``degrade_reason`` with ``served_by: "local"``. ``breaker_open``: the client's
#: circuit breaker over the node refused the call (the node was not contacted);
#: ``node_timeout``: no final reply within the request's ``timeout_ms``;
#: ``node_unreachable``: no connection to the node to send on within it;
#: ``node_error``: the node answered 500, 503 or 504.
LocalDegradeReason = Literal["breaker_open", "node_timeout", "node_unreachable", "node_error"]

#: How a final reply was counted (the ``Stats`` counter it added one to, moved
#: to ``client_gone`` if it never reaches its client: ``Outgoing.counted``):
#: ``ok``, or ``error_`` and the lowercased ``ErrorCode`` name
#: (``broker.replies.ERROR_OUTCOMES``).
FinalOutcome = Literal[
    "ok",
    "error_bad_request",
    "error_not_found",
    "error_too_large",
    "error_overloaded",
    "error_cancelled",
    "error_internal",
    "error_unavailable",
    "error_deadline_exceeded",
]
FINAL_OUTCOMES: tuple[FinalOutcome, ...] = get_args(FinalOutcome)

#: The broker's two ROUTER sockets: clients connect to the frontend, workers and
#: host agents to the backend.
Side = Literal["frontend", "backend"]
SIDES: tuple[Side, ...] = get_args(Side)

#: Why a CURVE handshake was refused (``status``'s ``refused`` counts, per side):
#: ``key_not_allowed``: the peer proved a key that is not in the allowlist (the
#: ZAP handler said 400); ``handshake_failed``: the handshake itself failed (the
#: peer used another server key, no CURVE at all, or sent garbage).
Refusal = Literal["key_not_allowed", "handshake_failed"]
REFUSALS: tuple[Refusal, ...] = get_args(Refusal)

#: Why a request is refused or shed with a 4xx/5xx: the error reply's ``reason``
#: and the ``shed_<reason>`` counters (``broker.admission.Shed``, ``Broker._shed_job``).
ShedReason = Literal[
    "duplicate_id",
    "draining",
    "circuit_open",
    "client_cap",
    "too_large",
    "memory_pressure",
    "cpu_pressure",
    "queue_full",
    "deadline_unmeetable",
]
SHED_REASONS: tuple[ShedReason, ...] = get_args(ShedReason)

#: Why a request ended as it did, beyond its ``FinalOutcome``: a shed's reason, the
#: degrade reason of a rules answer given in the model's place, ``worker_lost``
#: (its worker died and nothing could take over), ``shutdown`` (the node stopped),
#: ``client_gone`` (ended unanswered: its client left), ``none`` (nothing more to say).
EndReason = Literal[ShedReason, DegradeReason, "shutdown", "client_gone", "none"]
#: Nested Literals flatten and repeat values once (``circuit_open`` is both kinds).
END_REASONS: tuple[EndReason, ...] = get_args(EndReason)
