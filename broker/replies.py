"""The final reply a client gets for a worker's FINAL: fields, timings, outcome.

A worker may be anyone's process (PROTOCOL §13), so its FINAL fields are checked
here: the client gets only the types PROTOCOL §4.2 promises, whatever the worker sent.
"""

from __future__ import annotations

import math
from typing import Any

from broker import protocol as p
from broker.errors import ErrorCode
from broker.kinds import EngineKind, FinalOutcome
from broker.records import Job
from broker.rounding import ms

#: The ``finish_reason`` values of PROTOCOL §4.2; a worker's other values become "stop".
FINISH_REASONS = frozenset({"stop", "length"})
#: The ``usage`` counts of PROTOCOL §4.2; a worker's other keys are dropped.
#: ``cached_tokens``: prompt tokens a llama slot's KV cache held already (prefix reuse).
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")
#: Largest count a C client reading ``int64_t`` can hold.
MAX_COUNT = 2**63 - 1
#: The outcome an error reply is counted under, per wire code.
ERROR_OUTCOMES: dict[ErrorCode, FinalOutcome] = {
    ErrorCode.BAD_REQUEST: "error_bad_request",
    ErrorCode.NOT_FOUND: "error_not_found",
    ErrorCode.TOO_LARGE: "error_too_large",
    ErrorCode.OVERLOADED: "error_overloaded",
    ErrorCode.CANCELLED: "error_cancelled",
    ErrorCode.INTERNAL: "error_internal",
    ErrorCode.UNAVAILABLE: "error_unavailable",
    ErrorCode.DEADLINE_EXCEEDED: "error_deadline_exceeded",
}


def finish_reason(value: object) -> str:
    """A FINAL's ``finish_reason``: ``"stop"`` or ``"length"``; anything else,
    absence included, is ``"stop"`` (the documented default)."""
    return value if isinstance(value, str) and value in FINISH_REASONS else "stop"


def usage(value: object) -> dict[str, int]:
    """A FINAL's ``usage``: only ``USAGE_KEYS`` whose values are integers in
    0 … 2**63-1 (bools, floats, strings dropped); ``{}`` if not a map."""
    if not isinstance(value, dict):
        return {}
    return {
        key: count
        for key in USAGE_KEYS
        if isinstance(count := value.get(key), int)
        and not isinstance(count, bool)
        and 0 <= count <= MAX_COUNT
    }


def confidence(value: object) -> float:
    """A rule engine's ``confidence`` as a float in 0.0 … 1.0.

    Out of range is clamped, not zeroed, because the latency hedge
    (``broker.routing``) reads the worker's number as "a rule matched" when it is
    above 0; NaN and non-numbers (bools included) mean no match: 0.0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return 0.0
    return min(1.0, max(0.0, float(value)))


def final_reply(
    job: Job, kind: EngineKind, worker_id: str, body: dict[str, Any], now: float
) -> tuple[dict[str, Any], FinalOutcome]:
    """Turn a worker's FINAL ``body`` for ``job`` into the client's reply.

    Timings (ms) count from acceptance: ``queue_ms`` until dispatch, ``ttft_ms``
    until the first token, ``total_ms`` until now. The worker's fields are
    checked, never relayed as they are: a ``text`` that is not a str becomes the
    streamed text so far, ``finish_reason`` and ``usage`` go through
    ``finish_reason()``/``usage()``, ``confidence``/``rule`` are kept only from a
    rules worker (a float 0.0 … 1.0 and a str or None; both always present
    there), and an error's unknown code becomes 500, its non-str or empty
    ``message`` a generic one.

    Returns:
        (reply body, outcome counter name: ``ok`` or ``error_<code name>``).
    """
    text = body.get("text") if isinstance(body.get("text"), str) else "".join(job.chunks)
    if body.get("status") == "ok":
        started = now if job.dispatched_at is None else job.dispatched_at
        first = now if job.first_token_at is None else job.first_token_at
        reply = p.ok_reply(
            job.req.id,
            text=text,
            finish_reason=finish_reason(body.get("finish_reason")),
            usage=usage(body.get("usage")),
            served_by=kind,
            worker=worker_id,
            degraded=bool(job.degraded),
            queue_ms=ms(started - job.accepted_at),
            ttft_ms=ms(first - job.accepted_at),
            total_ms=ms(now - job.accepted_at),
        )
        if job.degraded:
            reply["degrade_reason"] = job.degraded
        if kind == "rules":  # the rule engine says how sure it is
            rule = body.get("rule")
            reply["confidence"] = confidence(body.get("confidence"))
            reply["rule"] = rule if isinstance(rule, str) else None
        return reply, "ok"
    raw_code = body.get("code")
    code = ErrorCode.INTERNAL
    if isinstance(raw_code, int) and raw_code in ErrorCode._value2member_map_:
        code = ErrorCode(raw_code)
    message = body.get("message")
    if not isinstance(message, str) or not message:
        message = "worker reported an error"
    return p.error_reply(job.req.id, code, message, text=text or ""), ERROR_OUTCOMES[code]
