"""Which engine answers: migration modes, the circuit breaker and the fallback.

Devices adopt a model beside their legacy rule engine in stages:

* ``shadow``: the rules answer; the model gets a copy only when it has free
  credit right now, so it can never delay an answer;
* ``dual``: the rules answer; the model always runs a copy; both are compared;
* ``degrade``: the model answers, and the rules take over when the breaker is
  open, no model worker is registered, or memory or the host's CPU is under
  pressure (the node's readings: ``broker.pressure``). When the
  model misses the latency budget to its first token (or is sure to, because
  it would have to queue), the rules are asked *as well* — a hedge: a rule
  that matches answers and the model's job is cancelled; a rule miss is
  dropped and the model answers (``usable_rules_answer``). A request the model
  could not finish by its deadline even idle goes to the rules alone, whatever
  they say (admission's ``deadline_unmeetable``), and one the model has not
  answered ``LATE_HEDGE_S`` before its deadline is hedged too;
* ``full``: the model only; typed errors when it cannot serve.

Only ``route: "auto"`` requests follow the mode; ``llm`` and ``rules`` are
explicit. The router is sans-I/O like the core: it decides, keeps the breaker's
books, and queues migration records (plain dicts) for the node to log in the
broker's outbox (``broker.outbox``), beside the breaker's transitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from broker.breaker import BreakerSettings, CircuitBreaker, Permit
from broker.client_request import ClientRequest
from broker.errors import ErrorCode
from broker.kinds import CopySkipReason, DegradeReason, EngineKind, RoutingMode
from broker.outbox import Outbox
from broker.records import Job
from broker.rounding import ms
from broker.service_time import RETRY_AFTER_MIN_MS
from broker.snapshot import PoolView

#: How much of a prompt a migration record keeps (chars).
PROMPT_CHARS = 500
#: s before a degrade-mode request's deadline at which the rules are asked if the
#: model has not answered yet (``Route.rules_if_late``; at most half its budget). The
#: rule worker answers in milliseconds; the rest is the way back to the client. A
#: first token within the latency budget asked nothing of the rules, and a model that
#: then ran to max_tokens answered 504: 25 of 30 requests of the README's 300 ms
#: defensive client on an idle node (break-it pass, session 19).
LATE_HEDGE_S = 0.05


@dataclass(frozen=True)
class RoutingSettings:
    """``mode`` (see above); ``ttft_budget_ms``: degrade mode's latency budget to
    the first token (the seed's example: 200 ms)."""

    mode: RoutingMode = "degrade"
    ttft_budget_ms: int = 200


@dataclass(frozen=True)
class Route:
    """A decision: the engine ``kind``, why it is a fallback (``degraded``, None
    if not), the breaker permit of a model call, whether the model also
    gets a ``copy`` (``shadow`` or ``dual``), and why a copy was not made
    (``copy_skipped``: ``no_credit``, ``no_model_worker``; None if none was due).
    ``ttft_budget_s``: arm the latency budget to the first token, this many s
    (None: not watched); ``hedge``: the model's wait already exceeds it, so ask
    the rules at once as well. ``rules_if_late``: degrade mode; if the model could
    not finish it by its deadline even alone (admission's ``deadline_unmeetable``),
    the rules answer it instead (``latency_budget``), as a busy model's hedge does;
    and if it has not answered ``LATE_HEDGE_S`` before its deadline, the rules are
    asked as at the latency budget (a hedge).
    ``circuit_open_ms``: only the model may serve it and its breaker is open (no
    permit): admission refuses it, retry after this many ms."""

    kind: EngineKind
    degraded: DegradeReason | None = None
    permit: Permit | None = None
    copy: Literal["shadow", "dual", ""] = ""
    ttft_budget_s: float | None = None
    copy_skipped: CopySkipReason | None = None
    hedge: bool = False
    circuit_open_ms: int | None = None
    rules_if_late: bool = False


class Router:
    """Applies the mode, owns the circuit breaker and the pairs awaiting comparison."""

    def __init__(
        self,
        settings: RoutingSettings | None = None,
        breaker: BreakerSettings | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.settings = settings or RoutingSettings()
        #: Where migration records and breaker transitions go (its own if not given).
        self.outbox = outbox if outbox is not None else Outbox()
        self.breaker = CircuitBreaker(breaker, self.outbox.transitions)
        self._pairs: dict[int, dict[str, Any]] = {}

    @property
    def mode(self) -> RoutingMode:
        """The configured migration stage (``routing.mode``)."""
        return self.settings.mode

    def route(self, req: ClientRequest, pool: PoolView, now: float) -> Route:
        """Decide where ``req`` goes (see the module docstring); whether it may wait
        there is admission's (``broker.admission``)."""
        if req.route == "rules":
            return Route("rules")
        mode = "full" if req.route == "llm" else self.mode
        if mode == "full" or (mode == "degrade" and pool.rules.workers == 0):
            return self._model_only(now)
        if mode in ("shadow", "dual"):
            if pool.llm.workers == 0:
                return Route("rules", copy_skipped="no_model_worker")
            if mode == "shadow" and pool.llm.free <= 0:
                return Route("rules", copy_skipped="no_credit")
            return Route("rules", copy=mode)
        reason = self._fallback_reason(pool)
        if reason:
            return Route("rules", degraded=reason)
        permit = self.breaker.allow(now)
        if permit is None:
            return Route("rules", degraded="circuit_open")
        budget = self.settings.ttft_budget_ms
        # A wait beyond the budget is a latency miss, not a failure: the model keeps the
        # request and the rules are only asked in parallel (a hedge), as at the budget.
        late = budget > 0 and pool.llm.wait_s * 1000 > budget
        watched = budget / 1000 if budget > 0 else None
        return Route("llm", permit=permit, ttft_budget_s=watched, hedge=late, rules_if_late=True)

    def _model_only(self, now: float) -> Route:
        permit = self.breaker.allow(now)
        if permit is None:
            # Half-open with every probe out says 0: still not "retry at once".
            retry_ms = max(RETRY_AFTER_MIN_MS, self.breaker.retry_after_ms(now))
            return Route("llm", circuit_open_ms=retry_ms)
        return Route("llm", permit=permit)

    def _fallback_reason(self, pool: PoolView) -> DegradeReason | None:
        if pool.llm.workers == 0:
            return "no_model_worker"
        if pool.pressure != "ok":
            return "memory_pressure"
        if pool.cpu_pressure != "ok":
            return "cpu_pressure"
        return None

    # ------------------------------------------------------------------ outcomes

    def worker_failed(self, now: float, reason: str) -> None:
        """A model worker was lost (crash, hang, stall): one pool failure, however many
        requests it held (the caller released the permits of those it ended)."""
        self.breaker.note_failure(now, reason)

    def release(self, job: Job, now: float) -> None:
        """The job stops being a model call without an outcome (rerouted, cancelled)."""
        if job.permit is not None:
            self.breaker.release(job.permit, now)
            job.permit = None

    def finished(self, job: Job, body: dict[str, Any], now: float) -> None:
        """``job`` ended with the final ``body`` (sent to its client, or a copy's result)."""
        self._settle_permit(job, body, now)
        if job.copy_of is not None:
            self._half(job.copy_of, "llm", job, body, now)
        elif job.rid in self._pairs:
            self._half(job.rid, "rules", job, body, now)
        elif job.degraded:
            record = {
                "event": "fallback",
                "mode": self.mode,
                "id": job.req.id,
                "reason": job.degraded,
                "latency_ms": ms(now - job.accepted_at),
            }
            if job.hedge_of is not None:
                record["hedge"] = "rules_won"
            self.outbox.records.append(record)
        elif job.kind == "llm":
            outcome = _outcome(job, body, now)
            del outcome["text"]  # latency is what the report needs, not every answer
            if job.hedged_by is not None:
                outcome["hedge"] = "model_kept"  # the rules were asked and had no answer
            self.outbox.records.append(
                {"event": "llm", "mode": self.mode, "id": job.req.id, **outcome}
            )

    def open_pair(self, primary: Job, mode: RoutingMode) -> None:
        """``primary`` (answered by the rules) will be compared with a model copy."""
        req = primary.req
        prompt = req.prompt if req.prompt is not None else (req.messages or (("", ""),))[-1][1]
        self._pairs[primary.rid] = {
            "event": "pair",
            "mode": mode,
            "id": req.id,
            "prompt": prompt[:PROMPT_CHARS],
            "schema": req.json_schema is not None,
            "rules": None,
            "llm": None,
        }

    def copy_skipped(self, job: Job, reason: CopySkipReason) -> None:
        """The model copy of ``job`` was not made (no free credit, queue full)."""
        self.outbox.records.append(
            {"event": "copy_skipped", "mode": self.mode, "id": job.req.id, "reason": reason}
        )

    def _half(self, rid: int, side: EngineKind, job: Job, body: dict[str, Any], now: float) -> None:
        pair = self._pairs.get(rid)
        if pair is None:
            return
        result = _outcome(job, body, now)
        if side == "rules":
            result |= {"confidence": body.get("confidence"), "rule": body.get("rule")}
        pair[side] = result
        if pair["rules"] is not None and pair["llm"] is not None:
            self.outbox.records.append(self._pairs.pop(rid))

    def _settle_permit(self, job: Job, body: dict[str, Any], now: float) -> None:
        if job.permit is None:
            return
        permit, job.permit = job.permit, None
        code = body.get("code")
        if body.get("status") == "ok":
            started = job.dispatched_at if job.dispatched_at is not None else now
            first = job.first_token_at if job.first_token_at is not None else now
            self.breaker.record(permit, now, ok=True, duration_s=first - started)
        elif code == ErrorCode.INTERNAL:
            # Only the pool's own failures: the broker's 503s (eviction, memory
            # pressure, shutdown) say nothing about the model's health, and a lost
            # worker counted once as it was lost (``worker_failed``), its requests'
            # permits released before their 503 worker_lost.
            self.breaker.record(permit, now, ok=False)
        elif code == ErrorCode.DEADLINE_EXCEEDED and job.dispatched_at is not None:
            elapsed = now - job.dispatched_at
            if elapsed > self.breaker.settings.slow_call_ms / 1000:
                self.breaker.record(permit, now, ok=True, duration_s=elapsed)
            else:
                self.breaker.release(permit, now)  # the budget was tight, not the pool slow
        else:
            self.breaker.release(permit, now)  # cancelled, too large: not the pool's fault

    def snapshot(self, now: float) -> dict[str, Any]:
        """For ``status``: the mode, the budget and the breaker."""
        return {
            "mode": self.mode,
            "ttft_budget_ms": self.settings.ttft_budget_ms,
            "breaker": self.breaker.snapshot(now),
            "pairs_pending": len(self._pairs),
        }


def usable_rules_answer(body: dict[str, Any]) -> bool:
    """Whether the rules' final reply ``body`` may answer a hedged model request.

    Usable means a rule matched: ``status`` ok and ``confidence`` > 0. The rule
    engine answers everything, a miss with confidence 0 ("no rule matched"), and a
    miss is no reason to drop a model that is merely late. The cut is not
    ``fallback.low_confidence``: that threshold only flags shadow/dual pairs for
    offline review, while a matched rule's answer below it is what the rules serve
    whenever the model fails, and the broker does not know the node's config.
    """
    confidence = body.get("confidence")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)):
        return False
    return body.get("status") == "ok" and confidence > 0


def _outcome(job: Job, body: dict[str, Any], now: float) -> dict[str, Any]:
    ttft = None if job.first_token_at is None else ms(job.first_token_at - job.accepted_at)
    return {
        "status": body.get("status"),
        "text": body.get("text", ""),
        "latency_ms": ms(now - job.accepted_at),
        "ttft_ms": ttft,
        "worker": body.get("worker"),
        "code": body.get("code"),
        # What tells the model's failures from the broker's refusals (node.migration.report).
        "reason": body.get("reason"),
        "dispatched": job.dispatched_at is not None,
    }
