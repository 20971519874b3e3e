"""The defensive client's decisions, sans I/O: ``NodeGuard`` (the breaker over the node
and the local fallback) and ``Call`` (one request's course), on a fake clock, with the
real rule engine and the default rules as the fallback."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest

from broker.breaker import BreakerSettings, BreakerState
from broker.client_call import Call
from broker.client_conversation import Conversation
from broker.client_guard import (
    CALL_WORK_MS,
    WAKE_UP_MS,
    NodeGuard,
    WarmFallback,
    make_guard,
    reserve_for,
)
from broker.errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EdgeNodeError,
    InternalError,
    NoReply,
    Overloaded,
    ProtocolError,
    Unavailable,
)
from fallback.engine import RuleEngine

RULES = Path(__file__).resolve().parents[2] / "fallback" / "default_rules.toml"
SETTINGS = BreakerSettings(
    window_ms=10_000, minimum_calls=2, open_wait_ms=1000, half_open_probes=1, half_open_successes=1
)
REQUEST = {"id": "r1", "op": "generate", "prompt": "turn on the kitchen lights", "timeout_ms": 200}


@pytest.fixture
def guard() -> NodeGuard:
    return NodeGuard(RuleEngine.from_file(RULES), SETTINGS)


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (NoReply("no reply"), "node_timeout"),
        (Unavailable("draining", reason="draining"), "node_error"),
        (DeadlineExceeded("deadline"), "node_error"),
        (InternalError("decode failed"), "node_error"),
        (ProtocolError("bad field"), None),
        (Overloaded("cap", reason="client_cap"), None),
        (Cancelled("cancelled by client"), None),
    ],
)
def test_a_node_failure_is_answered_locally_and_a_request_s_own_error_is_raised(
    guard: NodeGuard, exc: EdgeNodeError, reason: str | None
) -> None:
    permit = guard.admit(0.0)
    assert permit is not None
    assert guard.failed(permit, 0.1, exc) == reason
    window = guard.breaker.snapshot(0.1)
    # A failure of the node counts against it; a 4xx is an answer in time; a 499 is neither.
    assert (window["calls"], window["failures"]) == {
        "node_timeout": (1, 1),
        "node_error": (1, 1),
        None: (0, 0) if isinstance(exc, Cancelled) else (1, 0),
    }[reason]


def test_failures_open_the_breaker_then_one_probe_closes_it(guard: NodeGuard) -> None:
    for now in (0.0, 0.1):
        permit = guard.admit(now)
        assert permit is not None
        guard.failed(permit, now + 0.2, NoReply("no reply"))
    assert guard.admit(0.5) is None  # open: the node is not called
    probe = guard.admit(1.3)  # 1 s after opening: half-open
    assert probe is not None and probe.probe
    assert guard.admit(1.3) is None  # one probe at a time
    guard.succeeded(probe, 1.35)
    assert guard.breaker.state(1.35) is BreakerState.CLOSED


def test_a_failed_probe_reopens_and_the_wait_restarts(guard: NodeGuard) -> None:
    for now in (0.0, 0.1):
        permit = guard.admit(now)
        assert permit is not None
        assert guard.unreachable(permit, now) == "node_unreachable"
    probe = guard.admit(1.2)
    assert probe is not None
    guard.failed(probe, 1.4, NoReply("no reply"))
    assert guard.admit(2.3) is None  # reopened at 1.4: half-open only from 2.4
    assert guard.admit(2.4) is not None


def test_the_local_reply_is_the_rules_answer_marked_degraded(guard: NodeGuard) -> None:
    body = guard.local_reply(REQUEST, "node_error", 201, Unavailable("x", reason="draining"))
    assert body["id"] == "r1" and body["status"] == "ok"
    assert body["text"] == '{"intent":"lights_on","room":"kitchen"}'
    assert (body["rule"], body["confidence"]) == ("lights_on", 0.9)
    assert (body["served_by"], body["degraded"], body["degrade_reason"]) == (
        "local",
        True,
        "node_error",
    )
    assert body["total_ms"] == 201
    assert body["node_error"] == {"code": 503, "reason": "draining"}


def conversation() -> Conversation:
    return Conversation(timeout_ms=200, wait_ms=200, max_body_bytes=65536, slack_ms=0)


def test_a_stream_answered_locally_before_any_piece_gets_it_as_its_one_piece(
    guard: NodeGuard,
) -> None:
    conv = conversation()
    sent = conv.prepare({**REQUEST, "stream": True})
    call = Call(conv, sent, 10.0, guard, guard.admit(10.0))
    # One budget for all its replies, less the local answer's reserve.
    reserve_s = guard.reserve_ms / 1000
    assert call.deadline(10.05) == call.deadline(99.0) == pytest.approx(10.2 - reserve_s)
    out = call.timed_out(10.2, "ipc://x")
    assert [b["status"] for b in out] == ["partial", "ok"]
    assert out[0]["text"] == out[1]["text"] and out[1]["degrade_reason"] == "node_timeout"
    assert call.done


def test_a_stream_answered_locally_after_node_pieces_ends_with_the_local_final_only(
    guard: NodeGuard,
) -> None:
    conv = conversation()
    sent = conv.prepare({**REQUEST, "stream": True})
    call = Call(conv, sent, 10.0, guard, guard.admit(10.0))
    call.replied({"id": "r1", "status": "partial", "text": "echo:", "index": 0}, 10.05)
    out = call.failed(Unavailable("worker lost", reason="worker_lost"), 10.1)
    assert [b["status"] for b in out] == ["ok"] and out[0]["served_by"] == "local"


def test_without_a_guard_no_reply_raises_no_reply() -> None:
    conv = Conversation(timeout_ms=None, wait_ms=300, max_body_bytes=65536, slack_ms=2000)
    sent = conv.prepare({"op": "ping"})
    call = Call(conv, sent, 0.0)
    assert call.deadline(5.0) == pytest.approx(5.3)  # each reply gets its own wait
    with pytest.raises(NoReply, match="within 300 ms"):
        call.timed_out(5.3, "ipc://x")


def test_a_fallback_needs_a_budget_and_breaker_settings_need_a_fallback() -> None:
    engine = RuleEngine.from_file(RULES)
    with pytest.raises(ConfigError, match="timeout_ms"):
        make_guard(engine, None, None)
    with pytest.raises(ConfigError, match="fallback"):
        make_guard(None, SETTINGS, 200)
    assert make_guard(None, None, None) is None
    guard = make_guard(engine, None, 200)
    assert guard is not None and guard.breaker.settings.half_open_probes == 1


class SlowFallback:
    """A fallback whose first answer pays a one-off setup (as the rule engine's does)."""

    def __init__(self, setup_s: float) -> None:
        self.setup_s = setup_s
        self.answers = 0

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.answers == 0:
            time.sleep(self.setup_s)
        self.answers += 1
        return {"text": "local"}


def test_the_guard_warms_its_fallback_up_and_reserves_its_answer_time() -> None:
    fallback = SlowFallback(setup_s=0.05)
    guard = NodeGuard(fallback, SETTINGS)
    assert fallback.answers == 2  # the setup is paid at construction, not by a call
    assert guard.reserve_ms >= WAKE_UP_MS
    guard.local_reply(REQUEST, "node_timeout", 200)
    assert fallback.answers == 3
    conv = conversation()
    call = Call(conv, conv.prepare(REQUEST), 10.0, guard, guard.admit(10.0))
    assert call.deadline(10.0) == pytest.approx(10.2 - guard.reserve_ms / 1000)
    assert call.send_deadline() == call.deadline(10.0)
    unguarded = Call(conv, conv.prepare({"op": "ping"}), 10.0)
    assert unguarded.send_deadline() == pytest.approx(10.2)  # the whole wait: no local answer


class WarmableFallback(SlowFallback):
    """A fallback with a ``warm_up`` (``WarmFallback``), as the rule engine has."""

    def __init__(self) -> None:
        super().__init__(setup_s=0.0)
        self.warmed = 0

    def warm_up(self) -> None:
        self.warmed += 1


def test_the_guard_calls_a_fallback_s_warm_up_once() -> None:
    fallback = WarmableFallback()
    NodeGuard(fallback, SETTINGS)
    assert (fallback.warmed, fallback.answers) == (1, 2)
    assert isinstance(RuleEngine.from_file(RULES), WarmFallback)  # the rule engine has one


def test_the_reserve_grows_with_the_guarded_calls_in_flight() -> None:
    """Calls that reach one deadline are answered one after another: the k-th guarded
    call in flight keeps k answers' time, and an ended call gives its share back."""
    fallback = SlowFallback(setup_s=0.0)
    guard = NodeGuard(fallback, SETTINGS)
    conv = conversation()
    calls = [Call(conv, conv.prepare(REQUEST), 10.0, guard, guard.admit(10.0)) for _ in range(10)]
    reserves = [c.reserve_ms for c in calls]
    assert reserves[0] == guard.reserve_ms
    assert reserves == [reserve_for(k, guard.per_answer_ms) for k in range(1, 11)]
    assert reserves[-1] >= reserves[0] + math.floor(9 * CALL_WORK_MS)  # each answer's share
    # Started together, they give up on the node latest-started first, an answer apart.
    deadlines = [c.deadline(10.0) for c in calls]
    assert deadlines == sorted(deadlines, reverse=True) and deadlines[0] > deadlines[-1]
    assert guard.in_flight == 10
    for c in calls:
        c.end(10.1)
        c.end(10.1)  # ending twice gives back once
    assert guard.in_flight == 0
    again = Call(conv, conv.prepare(REQUEST), 11.0, guard, guard.admit(11.0))
    assert again.reserve_ms == guard.reserve_ms


def test_the_reserve_never_takes_more_than_half_the_budget() -> None:
    guard = NodeGuard(SlowFallback(setup_s=0.0), SETTINGS)
    conv = conversation()
    for _ in range(500):  # calls an app left open (never ended) still count
        guard.enter()
    call = Call(conv, conv.prepare(REQUEST), 10.0, guard, guard.admit(10.0))
    assert call.reserve_ms == 100  # half of wait_ms = 200
    assert call.deadline(10.0) == pytest.approx(10.1)


def test_a_deadline_unmeetable_shed_is_answered_locally_but_ignored_by_the_breaker(
    guard: NodeGuard,
) -> None:
    """A healthy node that says at once "not within your budget" is not a failing node
    (break2: counting it opened the breaker and kept 240 of 246 calls local)."""
    for k in range(10):
        permit = guard.admit(k * 0.1)
        assert permit is not None  # never opened
        shed = Unavailable("expected service", reason="deadline_unmeetable")
        assert guard.failed(permit, k * 0.1 + 0.001, shed) == "node_error"
    window = guard.breaker.snapshot(1.0)
    assert (window["calls"], window["failures"]) == (0, 0)
    assert guard.breaker.state(1.0) is BreakerState.CLOSED


def test_a_queue_full_shed_still_counts_as_a_failure(guard: NodeGuard) -> None:
    for now in (0.0, 0.1):
        permit = guard.admit(now)
        assert permit is not None
        guard.failed(permit, now + 0.001, Unavailable("queue is full", reason="queue_full"))
    assert guard.admit(0.2) is None  # open: the node cannot serve anyone now


def test_a_deadline_unmeetable_shed_frees_a_half_open_probe(guard: NodeGuard) -> None:
    for now in (0.0, 0.1):
        permit = guard.admit(now)
        assert permit is not None
        guard.failed(permit, now + 0.2, NoReply("no reply"))
    probe = guard.admit(1.4)
    assert probe is not None and probe.probe
    shed = Unavailable("expected service", reason="deadline_unmeetable")
    assert guard.failed(probe, 1.41, shed) == "node_error"
    assert guard.breaker.state(1.41) is BreakerState.HALF_OPEN  # neither closed nor reopened
    assert guard.admit(1.42) is not None  # the next call may probe
