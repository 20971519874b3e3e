"""The final reply a client gets for a worker's FINAL: fields, timings, outcome."""

from __future__ import annotations

from typing import Any

from broker import protocol as p
from broker.errors import ErrorCode
from broker.records import Job


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, never negative."""
    return max(0, round(seconds * 1000))


def final_reply(
    job: Job, kind: str, worker_id: str, body: dict[str, Any], now: float
) -> tuple[dict[str, Any], str]:
    """Turn a worker's FINAL ``body`` for ``job`` into the client's reply.

    Timings (ms) count from acceptance: ``queue_ms`` until dispatch, ``ttft_ms``
    until the first token, ``total_ms`` until now. An unknown or malformed error
    code from a worker becomes 500.

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
            finish_reason=body.get("finish_reason", "stop"),
            usage=body.get("usage", {}),
            served_by=kind,
            worker=worker_id,
            degraded=bool(job.degraded),
            queue_ms=ms(started - job.accepted_at),
            ttft_ms=ms(first - job.accepted_at),
            total_ms=ms(now - job.accepted_at),
        )
        if job.degraded:
            reply["degrade_reason"] = job.degraded
        for key in ("confidence", "rule"):  # the rule engine says how sure it is
            if key in body:
                reply[key] = body[key]
        return reply, "ok"
    raw_code = body.get("code")
    code = ErrorCode.INTERNAL
    if isinstance(raw_code, int) and raw_code in ErrorCode._value2member_map_:
        code = ErrorCode(raw_code)
    message = str(body.get("message") or "worker reported an error")
    return p.error_reply(job.req.id, code, message, text=text or ""), f"error_{code.name.lower()}"
