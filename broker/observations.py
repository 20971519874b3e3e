"""What the broker observed, as typed records for the node's metrics (``node.observe``).

The core does no I/O and knows nothing of Prometheus: it appends one record per
fact to ``Outbox.observations`` and the node turns them into histograms and
counters. Two facts are timed here, where the times are known:

* ``Ended``: a client request got its one final reply (or ended unanswered
  because its client left), or was refused at admission;
* ``TokenGap``: the time between two PARTIALs of one request (its inter-token
  latency: the workers send one PARTIAL per generated token).

Times are the broker's monotonic clock, in seconds, as the loop gave them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from broker.errors import ErrorCode
from broker.kinds import END_REASONS, DegradeReason, EndReason, EngineKind, FinalOutcome
from broker.records import Job
from broker.replies import ERROR_OUTCOMES


@dataclass(frozen=True)
class Ended:
    """One client request's end.

    Attributes:
        engine: the pool that answered it (``rules`` for a fallback), or the one it
            was routed to when refused.
        outcome: ``ok`` or ``error_<code>`` (``FinalOutcome``), as its reply says.
        reason: the shed, degrade or loss reason (``EndReason``), ``none`` if none.
        admitted: False for a request refused at admission (no times below).
        queue_s: acceptance to dispatch; None if it never ran.
        ttft_s: acceptance to its first token; None if none came.
        total_s: acceptance to its final reply; None if not admitted.
        overshoot_s: how late a ``deadline_exceeded`` answer went out past the
            deadline (the timer's granularity: the loop's turn); None otherwise.
        prompt_tokens, completion_tokens: the worker's ``usage`` of an ``ok`` reply
            (0 when it gave none).
        degraded: why the rules answered in the model's place (a fallback), or None.
    """

    engine: EngineKind
    outcome: FinalOutcome
    reason: EndReason
    admitted: bool = True
    queue_s: float | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    overshoot_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    degraded: DegradeReason | None = None


@dataclass(frozen=True)
class TokenGap:
    """Seconds between two consecutive PARTIALs of one request on ``engine``."""

    engine: EngineKind
    seconds: float


Observation = Ended | TokenGap


def outcome_of(body: dict[str, Any]) -> FinalOutcome:
    """The ``FinalOutcome`` a final reply ``body`` (built by the broker) stands for."""
    if body.get("status") == "ok":
        return "ok"
    code = body.get("code")
    if isinstance(code, int) and code in ErrorCode._value2member_map_:
        return ERROR_OUTCOMES[ErrorCode(code)]
    return "error_internal"


def ended(job: Job, body: dict[str, Any], now: float, *, delivered: bool) -> Ended:
    """The ``Ended`` record of ``job`` answered with ``body`` at ``now``;
    ``delivered=False``: its client is gone and nothing was sent."""
    outcome = outcome_of(body)
    reason: EndReason = "none"
    raw = body.get("reason")
    if not delivered:
        reason = "client_gone"
    elif isinstance(raw, str) and raw in END_REASONS:
        reason = raw
    elif outcome == "ok" and job.degraded is not None:
        reason = job.degraded
    usage = body.get("usage") if outcome == "ok" else None
    tokens = usage if isinstance(usage, dict) else {}
    return Ended(
        engine=job.kind,
        outcome=outcome,
        reason=reason,
        queue_s=None if job.dispatched_at is None else job.dispatched_at - job.accepted_at,
        ttft_s=None if job.first_token_at is None else job.first_token_at - job.accepted_at,
        total_s=now - job.accepted_at,
        overshoot_s=max(0.0, now - job.deadline) if outcome == "error_deadline_exceeded" else None,
        prompt_tokens=_count(tokens.get("prompt_tokens")),
        completion_tokens=_count(tokens.get("completion_tokens")),
        degraded=job.degraded,
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
