"""The defensive client's guard over the node: a circuit breaker and a local fallback, sans I/O.

A node protects apps from a failing model (its own breaker, its rule worker), but not from
itself being stopped, hung (SIGSTOP) or unreachable. A client given a ``fallback`` keeps a
``NodeGuard``: the same ``broker.breaker.CircuitBreaker`` the node runs over its model pool,
here over the node as seen from the app (failure rate and timeouts in a window, then open,
then bounded half-open probes), and the fallback that answers in the node's place.

The seam to the rule engine is ``LocalFallback``, a Protocol: ``broker`` never imports
``fallback``, and ``fallback.engine.RuleEngine`` fits it as it is (its ``answer`` takes a
request body and returns the final fields). The app builds the fallback and passes it in::

    from broker.client import Client
    from fallback.engine import RuleEngine
    node = Client(endpoint, timeout_ms=200, fallback=RuleEngine.from_file("etc/rules.toml"))

Times: ``now`` arguments are seconds on the caller's monotonic clock (as the breaker's).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol, runtime_checkable

from broker.breaker import BreakerSettings, CircuitBreaker, Permit
from broker.errors import Cancelled, ConfigError, EdgeNodeError, ErrorCode, NoReply
from broker.kinds import LocalDegradeReason, ShedReason

#: The breaker a defensive client keeps by default. Sized for a control loop that calls
#: a few times a second with a ~200 ms budget: decide over the last 10 s once 4 calls are
#: in (a 30 s window would keep a recovered node's failures in view for too long), trip
#: at 50 % failures (Resilience4j's default; a timeout is a failure) or when 80 % of calls
#: take over 1 s, probe after 5 s with 1 request that must succeed. Apps pass their own
#: ``BreakerSettings`` to ``Client(..., breaker=...)``.
CLIENT_BREAKER = BreakerSettings(
    window_ms=10_000,
    minimum_calls=4,
    failure_rate_pct=50.0,
    slow_call_rate_pct=80.0,
    slow_call_ms=1000,
    open_wait_ms=5000,
    half_open_probes=1,
    half_open_successes=1,
    half_open_max_wait_ms=60_000,
)

#: Node error replies that mean the node could not serve (answered locally, counted as
#: failures): 500, 503, 504. Every other error is the request's own (400, 404, 413, 429)
#: or its client's doing (499) and is raised to the caller.
NODE_FAILURES = frozenset({ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED})

#: 503 reasons answered locally but *ignored* by the breaker (neither failure nor success,
#: as Resilience4j's ``ignoreExceptions`` beside ``recordExceptions``): ``deadline_unmeetable``
#: is a healthy node answering at once that *this* budget is too short for its estimate,
#: a verdict on the request, not on the node; counting it opened the breaker against a
#: healthy node and kept every later call local (break2 report). The other 503s
#: (``queue_full``, memory/CPU pressure, ``circuit_open``, ``draining``, ``worker_lost``)
#: say the node cannot serve anyone now: failures, and backing off relieves it.
IGNORED_SHEDS: frozenset[ShedReason] = frozenset({"deadline_unmeetable"})


class LocalFallback(Protocol):
    """What answers a request in the node's place, in-process.

    ``fallback.engine.RuleEngine`` is one (``RuleEngine.from_file(rules_path)``, the same
    rules file the node's rule worker loads).
    """

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a ``generate`` or ``chat`` request body (the wire's fields).

        Returns at least ``text``; ``finish_reason``, ``usage``, ``confidence`` and
        ``rule`` are passed on when present. Must not block: it runs within the
        request's ``timeout_ms``. Called twice when the client is made, with
        ``WARM_UP_REQUEST``, to pay any one-off setup then and time an answer.
        """
        ...


@runtime_checkable
class WarmFallback(Protocol):
    """A ``LocalFallback`` that can do its one-off setup on request
    (``fallback.engine.RuleEngine.warm_up`` builds its patterns' automata)."""

    def warm_up(self) -> None:
        """Do now what the first answers would otherwise pay for."""
        ...


#: What a call waiting for the node needs to be running again at its deadline (ms): the
#: timers' 1 ms granularity (epoll) plus the wake-up of the waiting thread or task;
#: measured 1-2 ms late on an idle 2-core box with 10 asyncio calls at one deadline.
WAKE_UP_MS = 2

#: The client's own work per call answered locally, besides the fallback's answer (ms):
#: the reply body and ``Reply``, the waiting task's or thread's turn. Measured as the
#: spread of 10 asyncio calls answered at one deadline on an idle 2-core box, 0.1-0.35 ms
#: per call (the rule engine's answer itself: 0.06-0.09 ms); rounded up for a busier box.
CALL_WORK_MS = 0.5

#: The request a guard answers at construction to warm its fallback up and to measure
#: the time a local answer takes.
WARM_UP_REQUEST: dict[str, Any] = {"id": "warm-up", "op": "generate", "prompt": "warm-up"}


def answer_ms(fallback: LocalFallback) -> float:
    """The ms one local answer is given: twice the fallback's measured answer (slack for
    a busier moment) plus ``CALL_WORK_MS``.

    Calls ``fallback.warm_up()`` if it has one (``WarmFallback``), then answers
    ``WARM_UP_REQUEST`` twice: the first pays any other one-off setup (lazy imports),
    the second is timed.

    Raises:
        Whatever ``fallback.answer`` raises for a plain ``generate``: such a fallback
        could not stand in for the node.
    """
    if isinstance(fallback, WarmFallback):
        fallback.warm_up()
    fallback.answer(dict(WARM_UP_REQUEST))
    started = time.perf_counter()
    fallback.answer(dict(WARM_UP_REQUEST))
    return 2 * (time.perf_counter() - started) * 1000 + CALL_WORK_MS


def reserve_for(calls: int, per_answer_ms: float) -> int:
    """The ms a guarded call keeps at the end of its budget when it is the ``calls``-th
    guarded call in flight (itself included): ``WAKE_UP_MS`` plus ``calls`` local answers
    of ``per_answer_ms`` each, rounded up to whole ms.

    Calls that reach their deadlines together are answered one after another on the
    client's thread or event loop: the k-th of them waits for the k-1 answers before
    its own. Calls started together thus give up on the node one answer apart, the
    latest-started first, and the last answered still ends within its budget.
    """
    return WAKE_UP_MS + math.ceil(calls * per_answer_ms)


class NodeGuard:
    """The breaker over the node and the fallback that stands in for it.

    Usage by a client, per ``generate``/``chat`` call::

        permit = guard.admit(now)                  # None: answer locally, "breaker_open"
        ...send, wait until the request's deadline...
        guard.succeeded(permit, now)               # a final reply came in time
        reason = guard.failed(permit, now, exc)    # None: raise exc; else answer locally
        guard.released(permit, now)                # ended without a verdict (cancelled)
        body = guard.local_reply(request, reason, total_ms)

    Each guarded call takes its reserve with ``enter()`` when it starts and gives it
    back with ``leave()`` when it ends.

    Args:
        fallback: answers in the node's place; warmed up here (``answer_ms``).
        settings: the breaker's knobs (``CLIENT_BREAKER`` if None).

    Attributes:
        per_answer_ms: the time given to one local answer (ms, ``answer_ms``).
        reserve_ms: the end of a guarded call's budget kept for the local answer when it
            is the only guarded call in flight (ms, ``reserve_for(1, ...)``): the client
            gives up on the node that much before ``timeout_ms``, so the local answer is
            ready within ``timeout_ms``. With more calls in flight, more (``enter``).
        in_flight: guarded calls entered and not left yet.
    """

    def __init__(self, fallback: LocalFallback, settings: BreakerSettings | None = None) -> None:
        self.fallback = fallback
        self.breaker = CircuitBreaker(settings or CLIENT_BREAKER)
        self.per_answer_ms = answer_ms(fallback)
        self.reserve_ms = reserve_for(1, self.per_answer_ms)
        self.in_flight = 0

    def enter(self) -> int:
        """Count a guarded call in; its reserve (ms): ``reserve_for`` the calls now in
        flight, itself included."""
        self.in_flight += 1
        return reserve_for(self.in_flight, self.per_answer_ms)

    def leave(self) -> None:
        """Count a guarded call out (once per ``enter``)."""
        self.in_flight = max(0, self.in_flight - 1)

    def admit(self, now: float) -> Permit | None:
        """A permit to call the node at ``now``; None while the breaker is open (or
        half-open with its probes out): the node is not contacted."""
        return self.breaker.allow(now)

    def succeeded(self, permit: Permit, now: float) -> None:
        """The node answered in time (an ``ok``, or an error that is the request's own)."""
        self.breaker.record(permit, now, ok=True)

    def released(self, permit: Permit, now: float) -> None:
        """The call ended without telling anything about the node (a task cancelled,
        a stream abandoned)."""
        self.breaker.release(permit, now)

    def failed(self, permit: Permit, now: float, exc: EdgeNodeError) -> LocalDegradeReason | None:
        """Judge an error the call ended with, and record it.

        Returns:
            Why the request is answered locally (``node_timeout`` for ``NoReply``,
            ``node_error`` for a node's 500/503/504; both failures of the node, except a
            503 of ``IGNORED_SHEDS``: released, not recorded), or None when ``exc`` is the
            request's own (4xx: recorded as an answer in time, or 499: released) and must
            be raised to the caller.
        """
        if isinstance(exc, NoReply):
            self.breaker.record(permit, now, ok=False)
            return "node_timeout"
        if exc.code == ErrorCode.UNAVAILABLE and exc.reason in IGNORED_SHEDS:
            self.released(permit, now)
            return "node_error"
        if exc.code in NODE_FAILURES:
            self.breaker.record(permit, now, ok=False)
            return "node_error"
        if isinstance(exc, Cancelled):
            self.released(permit, now)
        else:
            self.succeeded(permit, now)
        return None

    def unreachable(self, permit: Permit, now: float) -> LocalDegradeReason:
        """No connection to the node to send on in time: a failure of the node."""
        self.breaker.record(permit, now, ok=False)
        return "node_unreachable"

    def local_reply(
        self,
        request: dict[str, Any],
        reason: LocalDegradeReason,
        total_ms: int,
        node_error: EdgeNodeError | None = None,
    ) -> dict[str, Any]:
        """The fallback's answer to ``request`` as an ``ok`` reply body, as the node's
        degraded replies are (PROTOCOL §4.2), with ``served_by: "local"``,
        ``degraded: true``, ``degrade_reason`` and, after a node's error reply,
        ``node_error: {code, reason}``.

        Args:
            request: the body as it was (or would have been) sent.
            reason: why the node did not answer.
            total_ms: ms since the call began.
            node_error: the node's error reply, when that was the reason.
        """
        answer = self.fallback.answer(request)
        body: dict[str, Any] = {
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 0, "completion_tokens": 0},
            **answer,
            "id": request["id"],
            "status": "ok",
            "served_by": "local",
            "degraded": True,
            "degrade_reason": reason,
            "queue_ms": 0,
            "ttft_ms": total_ms,
            "total_ms": total_ms,
        }
        if node_error is not None:
            body["node_error"] = {"code": int(node_error.code), "reason": node_error.reason}
        return body


def make_guard(
    fallback: LocalFallback | None, breaker: BreakerSettings | None, timeout_ms: int | None
) -> NodeGuard | None:
    """The defensive client's guard, or None without a fallback.

    Raises:
        ConfigError: a fallback without a default ``timeout_ms`` (the budget it answers
            within), or ``breaker`` settings without a fallback.
    """
    if fallback is None:
        if breaker is not None:
            raise ConfigError("breaker settings need a fallback to answer while it is open")
        return None
    if timeout_ms is None:
        raise ConfigError("a client with a fallback needs timeout_ms (ms), e.g. 200")
    return NodeGuard(fallback, breaker)
