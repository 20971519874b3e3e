"""Circuit breaker state machine with a fake clock (plain floats as ``now``).

Mirrors how Resilience4j tests its breaker (CircuitBreakerStateMachineTest: a mock clock,
still OPEN before the wait, HALF_OPEN after it, exactly N permits) and the pass figures of
isolation_resilience_anchors.md §8 item 8.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.breaker import BreakerSettings, BreakerState, CircuitBreaker, Permit
from broker.errors import ConfigError

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

#: Small numbers so every transition is a few lines: window 10 s, 4 calls minimum, trip at
#: 50 % failures or 75 % slow (> 1 s), wait 5 s, 2 probes that must both succeed.
S = BreakerSettings(
    window_ms=10_000,
    minimum_calls=4,
    failure_rate_pct=50.0,
    slow_call_rate_pct=75.0,
    slow_call_ms=1000,
    open_wait_ms=5000,
    half_open_probes=2,
    half_open_successes=2,
    half_open_max_wait_ms=60_000,
)


def calls(b: CircuitBreaker, now: float, outcomes: str, duration_s: float = 0.1) -> None:
    """Record one call per character at ``now``: ``o`` ok, ``x`` failed, ``s`` ok but slow."""
    for c in outcomes:
        permit = b.allow(now)
        assert permit is not None, f"refused at {now} while recording {outcomes!r}"
        slow = duration_s if c != "s" else 2.0
        b.record(permit, now, ok=c != "x", duration_s=slow)


def tripped(now: float = 0.0) -> CircuitBreaker:
    """A breaker that opened at ``now`` (4 failures of 4)."""
    b = CircuitBreaker(S)
    calls(b, now, "xxxx")
    assert b.state(now) is OPEN
    return b


def probing(opened_at: float = 0.0) -> tuple[CircuitBreaker, float]:
    """A breaker just turned half-open, and the time it did."""
    b = tripped(opened_at)
    at = opened_at + S.open_wait_ms / 1000
    assert b.state(at) is HALF_OPEN
    return b, at


# --------------------------------------------------------------------------- settings


def test_defaults_are_the_documented_edge_values() -> None:
    d = BreakerSettings()
    assert (d.window_ms, d.minimum_calls, d.failure_rate_pct, d.slow_call_rate_pct) == (
        30_000,
        5,
        50.0,
        80.0,
    )
    assert (d.slow_call_ms, d.open_wait_ms, d.half_open_probes, d.half_open_successes) == (
        5000,
        10_000,
        2,
        2,
    )


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"window_ms": 0}, "breaker.window_ms"),
        ({"minimum_calls": 0}, "breaker.minimum_calls"),
        ({"failure_rate_pct": 0.0}, "breaker.failure_rate_pct"),
        ({"slow_call_rate_pct": 101.0}, "breaker.slow_call_rate_pct"),
        ({"slow_call_ms": 0}, "breaker.slow_call_ms"),
        ({"open_wait_ms": -1}, "breaker.open_wait_ms"),
        ({"half_open_probes": 0}, "breaker.half_open_probes"),
        ({"half_open_successes": 3}, "breaker.half_open_successes"),
        ({"half_open_successes": 0}, "breaker.half_open_successes"),
        ({"half_open_max_wait_ms": -5}, "breaker.half_open_max_wait_ms"),
    ],
)
def test_settings_out_of_range_name_the_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(S, **change)


# --------------------------------------------------------------------------- closed -> open


def test_below_minimum_calls_never_opens() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "xxx")  # 100 % failures, but 3 < minimum_calls
    assert b.state(0.0) is CLOSED
    assert b.snapshot(0.0)["failure_rate_pct"] == 100.0
    calls(b, 0.0, "x")
    assert b.state(0.0) is OPEN


def test_anchor_figure_nine_of_nine_failures_with_ten_minimum_stays_closed() -> None:
    b = CircuitBreaker(dataclasses.replace(S, minimum_calls=10))
    calls(b, 0.0, "x" * 9)
    assert b.state(0.0) is CLOSED
    calls(b, 0.0, "x")
    assert b.state(0.0) is OPEN


def test_failure_rate_at_the_threshold_opens_below_it_does_not() -> None:
    below = CircuitBreaker(dataclasses.replace(S, minimum_calls=10))
    calls(below, 0.0, "ooooooxxxx")  # 40 %
    assert below.state(0.0) is CLOSED
    at = CircuitBreaker(dataclasses.replace(S, minimum_calls=10))
    calls(at, 0.0, "oooooxxxxx")  # 50 % >= 50 %
    assert at.state(0.0) is OPEN
    assert "failure rate 50% of 10 calls" in at.transitions[-1].reason


def test_slow_calls_count_towards_the_slow_call_rate() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "ssso")  # 75 % slow, 0 % failed
    assert b.state(0.0) is OPEN
    assert b.transitions[-1].reason.startswith("slow-call rate 75%")
    not_enough = CircuitBreaker(S)
    calls(not_enough, 0.0, "ssoo")  # 50 % slow
    assert not_enough.state(0.0) is CLOSED
    assert not_enough.snapshot(0.0)["slow_calls"] == 2


def test_slow_means_strictly_longer_than_slow_call_ms() -> None:
    b = CircuitBreaker(S)
    for _ in range(4):
        permit = b.allow(0.0)
        assert permit is not None
        b.record(permit, 1.0, ok=True, duration_s=1.0)  # exactly the threshold: not slow
    assert b.snapshot(1.0)["slow_calls"] == 0
    assert b.state(1.0) is CLOSED


def test_duration_defaults_to_the_time_since_allow() -> None:
    b = CircuitBreaker(S)
    permits = [b.allow(0.0) for _ in range(4)]
    for permit in permits:
        assert permit is not None
        b.record(permit, 1.5, ok=True)  # 1.5 s after allow: slow
    assert b.snapshot(1.5)["slow_calls"] == 4
    assert b.state(1.5) is OPEN


def test_the_window_slides_old_failures_expire() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "xxx")
    calls(b, 10.0, "x")  # the three at t=0 left the 10 s window exactly now
    assert b.state(10.0) is CLOSED
    assert b.snapshot(10.0)["calls"] == 1
    inside = CircuitBreaker(S)
    calls(inside, 0.0, "xxx")
    calls(inside, 9.999, "x")
    assert inside.state(9.999) is OPEN


def test_the_window_holds_at_most_4096_calls() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "o" * 5000)  # memory stays bounded whatever the request rate
    assert b.snapshot(0.0)["calls"] == 4096
    assert b.state(0.0) is CLOSED


def test_successes_dilute_failures_within_the_window() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "oooooo")
    calls(b, 1.0, "xxxxx")  # 5 of 11 = 45 %
    assert b.state(1.0) is CLOSED
    calls(b, 1.0, "x")  # 6 of 12 = 50 %
    assert b.state(1.0) is OPEN


# --------------------------------------------------------------------------- open


def test_open_refuses_and_turns_half_open_exactly_after_the_wait() -> None:
    b = tripped(100.0)
    assert b.allow(100.0) is None
    assert b.retry_after_ms(100.0) == 5000
    assert b.state(104.999) is OPEN
    assert b.allow(104.999) is None
    assert b.retry_after_ms(104.0) == 1000
    assert b.state(105.0) is HALF_OPEN
    assert b.retry_after_ms(105.0) == 0
    assert [(t.old, t.new) for t in b.transitions] == [(CLOSED, OPEN), (OPEN, HALF_OPEN)]


def test_results_of_calls_admitted_before_opening_are_ignored() -> None:
    b = CircuitBreaker(S)
    late = b.allow(0.0)
    assert late is not None
    calls(b, 0.0, "xxxx")
    b.record(late, 1.0, ok=True)  # finished while open: says nothing about the verdict
    assert b.snapshot(1.0)["calls"] == 4
    b2, at = probing()
    stale = Permit(id=999, epoch=0, probe=False, issued_at=0.0)
    b2.record(stale, at, ok=False)  # a closed-epoch failure arriving during half-open
    assert b2.state(at) is HALF_OPEN


def test_note_failure_counts_in_the_window_without_a_permit() -> None:
    b = CircuitBreaker(S)
    calls(b, 0.0, "oo")
    b.note_failure(0.0, "llm-0 died")
    b.note_failure(0.0, "llm-1 died")
    assert b.state(0.0) is OPEN  # 2 of 4


# --------------------------------------------------------------------------- half-open


def test_exactly_the_configured_probes_under_concurrent_requests() -> None:
    b, at = probing()
    permits = [b.allow(at) for _ in range(10)]  # ten requests arrive together
    granted = [p for p in permits if p is not None]
    assert len(granted) == S.half_open_probes
    assert all(p.probe for p in granted)
    assert b.snapshot(at)["probes_in_flight"] == 2
    b.record(granted[0], at + 0.1, ok=True)
    assert b.allow(at + 0.1) is None  # one success plus one in flight use both trials


def test_probes_all_succeeding_close_and_reset_the_window() -> None:
    b, at = probing()
    p1, p2 = b.allow(at), b.allow(at)
    assert p1 is not None and p2 is not None
    b.record(p1, at + 0.2, ok=True)
    assert b.state(at + 0.2) is HALF_OPEN
    b.record(p2, at + 0.3, ok=True)
    assert b.state(at + 0.3) is CLOSED
    snap = b.snapshot(at + 0.3)
    assert (snap["calls"], snap["failures"]) == (0, 0)  # the outage's failures are gone
    calls(b, at + 0.4, "xxx")  # fresh window: the minimum applies again
    assert b.state(at + 0.4) is CLOSED


def test_a_failed_probe_reopens_at_once_and_restarts_the_wait() -> None:
    b, at = probing()
    p1, p2 = b.allow(at), b.allow(at)
    assert p1 is not None and p2 is not None
    b.record(p1, at + 1.0, ok=False)
    assert b.state(at + 1.0) is OPEN
    assert b.snapshot(at + 1.0)["opened_at"] == at + 1.0
    b.record(p2, at + 1.5, ok=True)  # the other probe is from the previous half-open
    assert b.state(at + 5.999) is OPEN
    assert b.state(at + 6.0) is HALF_OPEN
    assert b.snapshot(at + 6.0)["times_opened"] == 2


def test_a_released_probe_frees_its_slot_without_a_verdict() -> None:
    b, at = probing()
    p1, p2 = b.allow(at), b.allow(at)
    assert p1 is not None and p2 is not None
    b.release(p1, at + 0.1)  # the client cancelled it
    assert b.state(at + 0.1) is HALF_OPEN
    p3 = b.allow(at + 0.1)
    assert p3 is not None and p3.probe
    b.record(p2, at + 0.2, ok=True)
    b.record(p3, at + 0.3, ok=True)
    assert b.state(at + 0.3) is CLOSED


def test_cancelled_probes_never_leave_half_open_stuck() -> None:
    b, at = probing()
    for step in range(5):  # every probe cancelled, again and again
        now = at + step
        granted = [b.allow(now), b.allow(now)]
        assert all(p is not None for p in granted)
        for p in granted:
            assert p is not None
            b.release(p, now)
    p1, p2 = b.allow(at + 9), b.allow(at + 9)
    assert p1 is not None and p2 is not None
    b.record(p1, at + 9, ok=True)
    b.record(p2, at + 9, ok=True)
    assert b.state(at + 9) is CLOSED


def test_release_and_record_are_idempotent() -> None:
    b, at = probing()
    p1 = b.allow(at)
    assert p1 is not None
    b.release(p1, at)
    b.release(p1, at)
    b.record(p1, at, ok=False)  # after release: no effect, not a failure
    assert b.state(at) is HALF_OPEN
    p2, p3 = b.allow(at), b.allow(at)
    assert p2 is not None and p3 is not None
    b.record(p2, at, ok=True)
    b.record(p2, at, ok=True)  # a second report does not count twice
    assert b.state(at) is HALF_OPEN


def test_leaked_probes_reopen_after_the_half_open_limit() -> None:
    b, at = probing()
    assert b.allow(at) is not None and b.allow(at) is not None  # never reported
    assert b.allow(at + 59.9) is None
    assert b.state(at + 60.0) is OPEN
    assert "no verdict" in b.transitions[-1].reason
    assert b.state(at + 65.0) is HALF_OPEN
    assert b.allow(at + 65.0) is not None  # fresh probes


def test_unlimited_half_open_when_the_limit_is_zero() -> None:
    b = CircuitBreaker(dataclasses.replace(S, half_open_max_wait_ms=0))
    calls(b, 0.0, "xxxx")
    assert b.allow(5.0) is not None
    assert b.state(10_000.0) is HALF_OPEN


def test_fewer_successes_than_probes_can_close() -> None:
    b = CircuitBreaker(dataclasses.replace(S, half_open_probes=3, half_open_successes=1))
    calls(b, 0.0, "xxxx")
    permits = [b.allow(5.0) for _ in range(4)]
    assert sum(p is not None for p in permits) == 3
    assert permits[0] is not None
    b.record(permits[0], 5.5, ok=True)
    assert b.state(5.5) is CLOSED


def test_slow_probes_reopen_like_slow_calls() -> None:
    b, at = probing()
    p1, p2 = b.allow(at), b.allow(at)
    assert p1 is not None and p2 is not None
    b.record(p1, at + 2, ok=True, duration_s=2.0)
    b.record(p2, at + 2, ok=True, duration_s=2.0)  # 100 % slow >= 75 %
    assert b.state(at + 2) is OPEN
    b2, at2 = probing()
    q1, q2 = b2.allow(at2), b2.allow(at2)
    assert q1 is not None and q2 is not None
    b2.record(q1, at2 + 2, ok=True, duration_s=2.0)
    b2.record(q2, at2 + 2, ok=True, duration_s=0.1)  # 50 % slow: healthy enough
    assert b2.state(at2 + 2) is CLOSED


def test_note_failure_while_half_open_reopens() -> None:
    b, at = probing()
    assert b.allow(at) is not None
    b.note_failure(at + 0.5, "llm-0 crashed")
    assert b.state(at + 0.5) is OPEN
    assert b.transitions[-1].reason == "half-open: llm-0 crashed"


# --------------------------------------------------------------------------- status


def test_snapshot_reports_rates_and_probes() -> None:
    b = CircuitBreaker(S)
    assert b.snapshot(0.0) == {
        "state": "closed",
        "calls": 0,
        "failures": 0,
        "slow_calls": 0,
        "failure_rate_pct": None,
        "slow_call_rate_pct": None,
        "minimum_calls": 4,
        "opened_at": None,
        "retry_after_ms": 0,
        "probes_in_flight": 0,
        "probe_successes": 0,
        "times_opened": 0,
        "last_reason": "",
    }
    calls(b, 1.0, "oxs")
    snap = b.snapshot(1.0)
    assert (snap["calls"], snap["failures"], snap["slow_calls"]) == (3, 1, 1)
    assert snap["failure_rate_pct"] == 33.3
    assert snap["slow_call_rate_pct"] == 33.3
    opened = tripped(7.0).snapshot(8.0)
    assert (opened["state"], opened["opened_at"], opened["retry_after_ms"]) == ("open", 7.0, 4000)


def test_state_values_are_plain_strings_for_status() -> None:
    assert isinstance(BreakerState.HALF_OPEN, str)
    assert BreakerState.HALF_OPEN.value == "half_open"
    assert CircuitBreaker(S).state(0.0) == "closed"
