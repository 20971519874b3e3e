"""A request that stopped the rule worker is not run on the restarted one (issue 11).

The rule engine is deterministic and answers in microseconds: a rule worker lost while
running one request was stopped by that request (a catastrophic regex froze it before
RE2), and re-dispatching it killed the restarted rule worker too. Before, a missed
heartbeat or a stall blamed nothing, so the request was run again."""

from __future__ import annotations

import pytest

from broker.exits import ExitCause
from broker.protocol import WorkerCommand
from broker.routing import RoutingSettings
from brokerkit import FAST, RULES, W1, BrokerHarness, bodies, generate

REQUEST = WorkerCommand.REQUEST
RULES_AGAIN = b"rules-ident-2"


@pytest.fixture
def h() -> BrokerHarness:
    h = BrokerHarness(FAST, routing=RoutingSettings("degrade"))
    h.ready(RULES, 0.0, engine="rules", worker_id="rules-0")
    h.send(generate("poison", prompt="aaaa!", route="rules"), 0.0)
    assert len(bodies(h.drain_workers(), RULES, REQUEST)) == 1
    return h


def _restarted(h: BrokerHarness, now: float) -> list[dict[str, object]]:
    """The rule worker's next incarnation registers: what is sent to it."""
    h.ready(RULES_AGAIN, now, engine="rules", worker_id="rules-0")
    return bodies(h.drain_workers(), RULES_AGAIN, REQUEST)


def test_a_rule_worker_dead_on_a_request_does_not_get_it_again(h: BrokerHarness) -> None:
    h.tick(0.5)  # 0.3 s of silence is death at FAST's heartbeats
    (reply,) = h.replies()
    assert (reply["code"], reply["reason"]) == (503, "worker_lost")
    assert reply["message"] == (
        "worker lost: dead: missed heartbeats "
        "(not retried: the rule engine failed running this request)"
    )
    assert [e.kind for e in h.drain_events()][-1] == "lost"  # the supervisor kills it
    assert _restarted(h, 0.6) == []
    h.assert_each_answered_once()


@pytest.mark.parametrize(
    ("cause", "reason"),
    [
        (ExitCause(code=1), "exit 1"),
        (ExitCause(signal="SIGKILL"), "killed by SIGKILL"),
        (ExitCause(signal="SIGSEGV"), "killed by SIGSEGV"),
    ],
)
def test_a_rule_worker_that_exits_on_a_request_does_not_get_it_again(
    h: BrokerHarness, cause: ExitCause, reason: str
) -> None:
    h.broker.worker_exited("rules-0", cause, 0.1)
    (reply,) = h.replies()
    assert reply["code"] == 503 and reply["message"].endswith(
        f"{reason} (not retried: the rule engine failed running this request)"
    )
    assert _restarted(h, 0.2) == []
    h.assert_each_answered_once()


def test_a_stalled_rule_worker_does_not_get_it_again(h: BrokerHarness) -> None:
    h.tick(1.2, keepalive=(RULES,))  # heartbeats, but no progress for 1 s: stalled
    (reply,) = h.replies()
    assert "stalled" in reply["message"] and "not retried" in reply["message"]
    assert _restarted(h, 1.3) == []
    h.assert_each_answered_once()


def test_a_rule_worker_stopped_with_the_node_blames_nothing() -> None:
    """A clean DISCONNECT (the worker stopping, not failing) says nothing about the request:
    it waits for the next rule worker, as before."""
    h = BrokerHarness(FAST, routing=RoutingSettings("degrade"))
    h.ready(RULES, 0.0, engine="rules", worker_id="rules-0")
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("innocent", route="rules"), 0.0)
    assert len(bodies(h.drain_workers(), RULES, REQUEST)) == 1
    h.worker_send(RULES, WorkerCommand.DISCONNECT, {}, 0.1)
    assert h.replies() == []
    (again,) = _restarted(h, 0.2)
    h.final(RULES_AGAIN, int(str(again["rid"])), 0.3, rule="r", confidence=1.0)
    assert h.replies()[0]["status"] == "ok"
    h.assert_each_answered_once()
