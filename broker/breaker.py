"""Circuit breaker over the model pool, sans-I/O (time comes in as ``now``).

The one breaker of edgenode: the broker core keeps one over its model pool, and the
defensive client (``broker.client_guard.NodeGuard``) one over the node as its app sees it.

The model follows Resilience4j's ``CircuitBreaker`` (resilience4j/resilience4j@af9e7c9,
``CircuitBreakerConfig.java``),
because the Python breakers (pybreaker, circuitbreaker, purgatory) only count consecutive
failures and have neither a rate window nor a slow-call rate::

    CLOSED --(calls in window >= minimum_calls AND
              (failure rate >= threshold OR slow-call rate >= threshold))--> OPEN
    OPEN --(open_wait_ms elapsed)--> HALF_OPEN
    HALF_OPEN --(half_open_successes probe successes, slow-probe rate below threshold)--> CLOSED
    HALF_OPEN --(any probe fails, or too many slow probes)--> OPEN (the wait restarts)
    HALF_OPEN --(no verdict within half_open_max_wait_ms)--> OPEN

Resilience4j names -> ours: slidingWindowType TIME_BASED + slidingWindowSize -> ``window_ms``;
minimumNumberOfCalls -> ``minimum_calls``; failureRateThreshold -> ``failure_rate_pct``;
slowCallRateThreshold -> ``slow_call_rate_pct``; slowCallDurationThreshold ->
``slow_call_ms``; waitDurationInOpenState -> ``open_wait_ms``;
permittedNumberOfCallsInHalfOpenState -> ``half_open_probes``;
maxWaitDurationInHalfOpenState -> ``half_open_max_wait_ms``.

Deliberate differences from Resilience4j:

* Half-open is stricter on failures: one failed probe reopens at once (Resilience4j waits for
  all permitted calls and compares the rate). With 2 probes and a 50 % threshold the verdicts
  are the same; reopening early stops sending work to a pool that still fails.
* ``release`` hands a permit back without an outcome (a client cancelled, the deadline passed
  before dispatch): a cancelled probe frees its slot instead of leaving half-open waiting for
  a verdict that never comes.
* Results of calls admitted in an earlier state are kept out of the verdicts of a later one
  (a slow call started while closed says nothing about the pool's health after a restart).
* No jitter on ``open_wait_ms``: there is one breaker per node, so no herd to spread out.

Times in settings are milliseconds (like every other ``[broker]`` key); ``now`` and durations
passed to the methods are seconds on the caller's monotonic clock, like ``broker.core``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from broker.errors import ConfigError
from broker.rounding import percent


class BreakerState(str, Enum):
    """The three states; the values are what ``status`` shows."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerSettings:
    """Breaker knobs (times in ms, rates in percent).

    Defaults are sized for an edge node, where a few requests per second is a busy day: a
    30 s window with at least 5 calls (Resilience4j's 100 would never be reached), trip at
    50 % failures (Resilience4j's default) or 80 % of calls slower than 5 s, wait 10 s before
    probing, 2 probes that must both succeed. ``half_open_max_wait_ms`` (0 = unlimited, like
    Resilience4j) reopens a half-open breaker whose probes never report: twice the node's
    default 60 s request timeout.

    Raises:
        ConfigError: a value out of range; the message names the ``breaker.<key>``.
    """

    window_ms: int = 30_000
    minimum_calls: int = 5
    failure_rate_pct: float = 50.0
    slow_call_rate_pct: float = 80.0
    slow_call_ms: int = 5000
    open_wait_ms: int = 10_000
    half_open_probes: int = 2
    half_open_successes: int = 2
    half_open_max_wait_ms: int = 120_000

    def __post_init__(self) -> None:
        _at_least("window_ms", self.window_ms, 1)
        _at_least("minimum_calls", self.minimum_calls, 1)
        _at_least("slow_call_ms", self.slow_call_ms, 1)
        _at_least("open_wait_ms", self.open_wait_ms, 0)
        _at_least("half_open_probes", self.half_open_probes, 1)
        _at_least("half_open_max_wait_ms", self.half_open_max_wait_ms, 0)
        if not 1 <= self.half_open_successes <= self.half_open_probes:
            raise ConfigError(
                "breaker.half_open_successes must be in [1, breaker.half_open_probes], "
                f"got {self.half_open_successes}"
            )
        for name in ("failure_rate_pct", "slow_call_rate_pct"):
            value = getattr(self, name)
            if not 0 < value <= 100:
                raise ConfigError(f"breaker.{name} must be in (0, 100], got {value}")


def _at_least(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"breaker.{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class Permit:
    """Leave to make one call to the model pool.

    Hand it back exactly once: ``record`` when the call ended with an outcome, ``release``
    when it ended without one (cancelled, never dispatched).

    Attributes:
        id: unique per breaker.
        epoch: the breaker's state generation when issued (results from older epochs are
            kept out of newer verdicts).
        probe: issued in half-open (it counts against ``half_open_probes``).
        issued_at: ``now`` at ``allow``, seconds; the default start of the call's duration.
    """

    id: int
    epoch: int
    probe: bool
    issued_at: float


@dataclass(frozen=True)
class Transition:
    """A state change, for the node's log: ``at`` in seconds, ``reason`` human-readable.

    Timed transitions are applied lazily, so OPEN -> HALF_OPEN carries the time of the first
    query at or after it fell due.
    """

    at: float
    old: BreakerState
    new: BreakerState
    reason: str


@dataclass
class _Window:
    """Time-based sliding window of call outcomes, exact to the call (no buckets).

    Entries are ``(recorded_at, failed, slow)``; a call counts while
    ``now - recorded_at < span``. Memory is bounded by ``max_entries`` (oldest dropped):
    at an edge node's request rates a 30 s window holds far fewer.
    """

    span: float
    max_entries: int = 4096
    calls: deque[tuple[float, bool, bool]] = field(default_factory=deque)
    failures: int = 0
    slow: int = 0

    def add(self, now: float, failed: bool, slow: bool) -> None:
        if len(self.calls) >= self.max_entries:
            self._drop_oldest()
        self.calls.append((now, failed, slow))
        self.failures += failed
        self.slow += slow

    def expire(self, now: float) -> None:
        while self.calls and now - self.calls[0][0] >= self.span:
            self._drop_oldest()

    def clear(self) -> None:
        self.calls.clear()
        self.failures = self.slow = 0

    def _drop_oldest(self) -> None:
        _, failed, slow = self.calls.popleft()
        self.failures -= failed
        self.slow -= slow


class CircuitBreaker:
    """Decides whether the next call may go to the model pool.

    Usage by the broker core (all times from the same monotonic clock)::

        permit = breaker.allow(now)          # None: open, or half-open probes all taken
        ...                                  # route to the model, or to the rules if None
        breaker.record(permit, now, ok=True, duration_s=service_time)
        # or, if the call ended without an outcome (client cancel before dispatch):
        breaker.release(permit, now)

    Args:
        settings: the knobs above.
    """

    def __init__(
        self, settings: BreakerSettings | None = None, transitions: list[Transition] | None = None
    ) -> None:
        self.settings = settings or BreakerSettings()
        self._window = _Window(self.settings.window_ms / 1000)
        self._state = BreakerState.CLOSED
        self._epoch = 0
        self._next_id = 1
        self._opened_at: float | None = None
        self._half_open_at: float | None = None
        self._probes: set[int] = set()  # probe permits of this epoch still out
        self._probe_successes = 0
        self._probe_slow = 0
        self._times_opened = 0
        self._last_reason = ""
        #: Where state changes are appended (the broker's ``Outbox.transitions``,
        #: drained by the I/O loop; a list of its own if not given).
        self.transitions: list[Transition] = transitions if transitions is not None else []

    # ------------------------------------------------------------------ queries

    def state(self, now: float) -> BreakerState:
        """The state at ``now`` (applies the timed transitions first)."""
        self._advance(now)
        return self._state

    def retry_after_ms(self, now: float) -> int:
        """Milliseconds until an open breaker starts probing (0 unless open).

        Fits the ``retry_after_ms`` of a 503 for ``route: llm`` requests while open.
        """
        self._advance(now)
        if self._state is not BreakerState.OPEN or self._opened_at is None:
            return 0
        due = self._opened_at + self.settings.open_wait_ms / 1000
        return max(0, round((due - now) * 1000))

    def snapshot(self, now: float) -> dict[str, Any]:
        """A msgpack-ready view for ``status``: rates in percent, times in seconds (``now``'s
        clock), ``None`` where not applicable."""
        self._advance(now)
        w = self._window
        calls = len(w.calls)
        return {
            "state": self._state.value,
            "calls": calls,
            "failures": w.failures,
            "slow_calls": w.slow,
            "failure_rate_pct": percent(w.failures, calls, 1),
            "slow_call_rate_pct": percent(w.slow, calls, 1),
            "minimum_calls": self.settings.minimum_calls,
            "opened_at": self._opened_at,
            "retry_after_ms": self.retry_after_ms(now),
            "probes_in_flight": len(self._probes),
            "probe_successes": self._probe_successes,
            "times_opened": self._times_opened,
            "last_reason": self._last_reason,
        }

    # ------------------------------------------------------------------ calls

    def allow(self, now: float) -> Permit | None:
        """A permit for one call at ``now``, or None when the pool must not be called.

        Closed: always a permit. Open: None. Half-open: a probe permit while fewer than
        ``half_open_probes`` are out, else None (concurrent requests beyond the probes are
        refused until a probe reports or is released).
        """
        self._advance(now)
        if self._state is BreakerState.OPEN:
            return None
        probe = self._state is BreakerState.HALF_OPEN
        if probe and len(self._probes) + self._probe_successes >= self.settings.half_open_probes:
            return None
        permit = Permit(self._next_id, self._epoch, probe, now)
        self._next_id += 1
        if probe:
            self._probes.add(permit.id)
        return permit

    def release(self, permit: Permit, now: float) -> None:
        """Hand back a permit whose call ended without an outcome (neither success nor failure).

        A released probe frees its slot for the next request; a closed-state permit needs no
        bookkeeping. Releasing twice, or after ``record``, does nothing.
        """
        self._advance(now)
        if permit.probe and permit.epoch == self._epoch:
            self._probes.discard(permit.id)

    def record(
        self, permit: Permit, now: float, *, ok: bool, duration_s: float | None = None
    ) -> None:
        """Report how the call under ``permit`` ended.

        Args:
            permit: from ``allow``.
            now: seconds, when the call ended.
            ok: False for failures: worker crash, stall, hang, internal (500) error. A
                client cancel is not the pool's fault: ``release`` it. A deadline hit while
                running: ``ok=True`` with the elapsed time if that exceeds ``slow_call_ms``
                (a slow call), else ``release`` (the budget was tight, not the pool slow).
            duration_s: the call's service time; slow when it exceeds ``slow_call_ms``
                (strictly, as in Resilience4j). Default ``now - permit.issued_at``.
        """
        self._advance(now)
        duration = now - permit.issued_at if duration_s is None else duration_s
        slow = duration > self.settings.slow_call_ms / 1000
        if permit.epoch != self._epoch:
            return  # admitted under an earlier state: no say in this one's verdict
        if permit.probe:
            self._record_probe(permit, now, ok, slow)
        elif self._state is BreakerState.CLOSED:
            self._window.add(now, not ok, slow)
            self._check_rates(now)

    def note_failure(self, now: float, reason: str = "worker failure") -> None:
        """Count a pool failure that belongs to no call (e.g. an idle worker died).

        Closed: one failed call in the window. Half-open: the pool is not healthy yet, so it
        reopens. Open: nothing.
        """
        self._advance(now)
        if self._state is BreakerState.CLOSED:
            self._window.add(now, True, False)
            self._check_rates(now)
        elif self._state is BreakerState.HALF_OPEN:
            self._open(now, f"half-open: {reason}")

    # ------------------------------------------------------------------ transitions

    def _advance(self, now: float) -> None:
        """Apply the transitions that only depend on time."""
        s = self.settings
        self._window.expire(now)  # every state, so that status shows the live window
        if self._state is BreakerState.OPEN:
            assert self._opened_at is not None
            if now >= self._opened_at + s.open_wait_ms / 1000:
                self._move(BreakerState.HALF_OPEN, now, f"waited {s.open_wait_ms} ms")
                self._half_open_at = now
        elif self._half_open_expired(now):
            self._open(now, f"half-open: no verdict within {s.half_open_max_wait_ms} ms")

    def _half_open_expired(self, now: float) -> bool:
        limit_ms = self.settings.half_open_max_wait_ms
        if not limit_ms or self._half_open_at is None:
            return False  # 0 = no limit, as Resilience4j's maxWaitDurationInHalfOpenState
        return now >= self._half_open_at + limit_ms / 1000

    def _check_rates(self, now: float) -> None:
        s, w = self.settings, self._window
        calls = len(w.calls)
        if calls < s.minimum_calls:
            return
        failure_pct = 100 * w.failures / calls
        slow_pct = 100 * w.slow / calls
        if failure_pct >= s.failure_rate_pct:
            self._open(now, f"failure rate {failure_pct:.0f}% of {calls} calls")
        elif slow_pct >= s.slow_call_rate_pct:
            self._open(now, f"slow-call rate {slow_pct:.0f}% of {calls} calls")

    def _record_probe(self, permit: Permit, now: float, ok: bool, slow: bool) -> None:
        if permit.id not in self._probes:
            return  # released already, or a second report
        self._probes.discard(permit.id)
        if not ok:
            self._open(now, "half-open probe failed")
            return
        self._probe_successes += 1
        self._probe_slow += slow
        s = self.settings
        if self._probe_successes < s.half_open_successes:
            return
        slow_pct = 100 * self._probe_slow / self._probe_successes
        if slow_pct >= s.slow_call_rate_pct:
            self._open(now, f"half-open: {self._probe_slow} of {self._probe_successes} probes slow")
        else:
            self._window.clear()  # a fresh start: old failures belong to the outage
            self._move(BreakerState.CLOSED, now, f"{self._probe_successes} probes succeeded")

    def _open(self, now: float, reason: str) -> None:
        self._opened_at = now
        self._times_opened += 1
        self._move(BreakerState.OPEN, now, reason)

    def _move(self, new: BreakerState, now: float, reason: str) -> None:
        old = self._state
        self._state = new
        self._epoch += 1  # outstanding permits now belong to the past
        self._probes.clear()
        self._probe_successes = self._probe_slow = 0
        self._half_open_at = None
        self._last_reason = reason
        self.transitions.append(Transition(now, old, new, reason))
