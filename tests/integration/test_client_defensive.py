"""The defensive client (``fallback=``) when the node itself fails: stopped, or frozen
with SIGSTOP. Both client libraries, a real node (test engine) and the default rules
file as the local fallback.

The contract checked: every call returns within its ``timeout_ms`` (200 ms) plus a
margin (100 ms: scheduling on a loaded 2-core CI box, not a speed figure), answered
locally (``served_by: "local"``, ``degraded: true``, the rule's answer) while the node
cannot answer; once the client's breaker opens the node is not contacted (the node's
own request counters prove it after SIGCONT); after a probe succeeds the node
answers again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from clientkit import AnyClient

from broker.breaker import BreakerSettings, BreakerState
from broker.client import Reply
from broker.errors import NoReply
from fallback.engine import RuleEngine
from node.testing import NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]
Connect = Callable[..., AnyClient]

RULES = Path(__file__).resolve().parents[2] / "fallback" / "default_rules.toml"
BUDGET_MS = 200
BOUND_S = (BUDGET_MS + 100) / 1000
#: Trips after 3 calls at >= 50 % failures; probes once after 1 s.
BREAKER = BreakerSettings(
    window_ms=10_000,
    minimum_calls=3,
    failure_rate_pct=50.0,
    open_wait_ms=1000,
    half_open_probes=1,
    half_open_successes=1,
    half_open_max_wait_ms=10_000,
)
COMMAND = "turn on the kitchen lights"
RULE_ANSWER = '{"intent":"lights_on","room":"kitchen"}'
NODE_FAILED = ("node_timeout", "node_unreachable", "node_error")


def defensive(connect_client: Connect, node: NodeProcess) -> AnyClient:
    return connect_client(
        node.frontend,
        timeout_ms=BUDGET_MS,
        fallback=RuleEngine.from_file(RULES),
        breaker=BREAKER,
    )


def timed_call(client: AnyClient) -> Reply:
    """One control-loop call; asserts the time contract and returns the reply."""
    started = time.monotonic()
    reply = client.generate(COMMAND, max_tokens=10)
    took = time.monotonic() - started
    assert took <= BOUND_S, f"{took * 1000:.0f} ms for a {BUDGET_MS} ms budget: {reply}"
    return reply


def assert_local(reply: Reply) -> None:
    assert (reply.served_by, reply.degraded) == ("local", True)
    assert reply.text == RULE_ANSWER and reply.raw["rule"] == "lights_on"


def until_served_by_node(client: AnyClient, timeout: float = 20) -> list[Reply]:
    """Call until the node answers (each call within the contract); the replies, the
    node's last. A loaded machine may make the node miss a 200 ms budget now and then."""
    replies: list[Reply] = []

    def served_by_node() -> bool:
        replies.append(timed_call(client))
        return replies[-1].served_by == "llm"

    wait_for(served_by_node, timeout=timeout, every=0.05)
    last = replies[-1]
    assert (last.degraded, last.text) == (False, f"echo: {COMMAND}")
    for reply in replies[:-1]:
        assert_local(reply)
    return replies


def warm_defensive(connect_client: Connect, node: NodeProcess) -> AnyClient:
    """A defensive client with a fresh breaker, to a node that has answered one already
    within the budget (through a first client, whose breaker saw the warm-up)."""
    with defensive(connect_client, node) as first:
        until_served_by_node(first)
    return defensive(connect_client, node)


def failures_then_open(reasons: list[str | None]) -> int:
    """How many calls failed on the node before the breaker opened: ``minimum_calls``
    of a fresh breaker, all failures (100 %). Every call after is ``breaker_open``
    or a probe (``test_client_guard`` checks the breaker's steps one by one)."""
    opened = BREAKER.minimum_calls
    assert all(r in NODE_FAILED for r in reasons[:opened]), reasons
    assert reasons[opened] == "breaker_open", reasons
    return opened


def requests_received(node: NodeProcess) -> int:
    """Client requests the node took in: admitted, or refused at admission (``shed_*``)."""
    counters = node.status()["counters"]
    return sum(v for k, v in counters.items() if k == "admitted" or k.startswith("shed_"))


def test_a_stopped_node_is_answered_for_locally_and_then_not_waited_on(
    make_node: NodeFactory, connect_client: Connect
) -> None:
    node = make_node()
    with warm_defensive(connect_client, node) as c:
        node.stop()
        reasons = []
        for _ in range(8):
            reply = timed_call(c)
            assert_local(reply)
            reasons.append(reply.degrade_reason)
        opened = failures_then_open(reasons)
        # Open for 1 s: no probe yet, every later call answered at once.
        assert reasons[opened:] == ["breaker_open"] * (8 - opened), reasons
        assert c.guard is not None
        assert c.guard.breaker.state(time.monotonic()) is BreakerState.OPEN


def test_a_frozen_node_costs_no_more_than_the_budget_and_is_used_again_after_a_probe(
    make_node: NodeFactory, connect_client: Connect
) -> None:
    node = make_node()
    assert node.proc is not None
    with warm_defensive(connect_client, node) as c:
        before = requests_received(node)
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            reasons = []
            frozen_until = time.monotonic() + 2.5  # open_wait 1 s: at least one probe
            while time.monotonic() < frozen_until:
                reply = timed_call(c)
                assert_local(reply)
                reasons.append(reply.degrade_reason)
                # No reply of the node to report (it said node_error 503, reason None).
                assert "node_error" not in reply.raw, reply.raw
                time.sleep(0.02)  # a 50 Hz control loop
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        opened = failures_then_open(reasons)
        assert set(reasons[:opened]) == {"node_timeout"}, reasons  # frozen: no reply
        contacted = sum(r != "breaker_open" for r in reasons)
        # Open, the node is not contacted: only the probes (one per open_wait) went out.
        assert opened + 1 <= contacted <= opened + 3, reasons
        assert len(reasons) - contacted > 20  # answered "breaker_open", at once
        node.wait_ready(timeout=30)
        back = until_served_by_node(c)
        assert c.guard is not None
        moves = [(t.old, t.new) for t in c.guard.breaker.transitions]
        assert moves[-1] == (BreakerState.HALF_OPEN, BreakerState.CLOSED), moves
        # Every request the client sent reached the node, and no other: the calls
        # answered "breaker_open" never left the client.
        sent = contacted + sum(r.degrade_reason != "breaker_open" for r in back)
        assert requests_received(node) - before == sent


def test_ping_and_status_of_a_frozen_node_end_in_noreply_within_the_budget(
    make_node: NodeFactory, connect_client: Connect
) -> None:
    # A guarded client sends only on a live connection: one that connects to the frozen
    # node never completes its handshake, and its send must not wait past the budget.
    node = make_node()
    assert node.proc is not None
    with defensive(connect_client, node) as connected:
        assert connected.ping()["pong"] is True
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            with defensive(connect_client, node) as fresh:
                for client in (connected, fresh):
                    for call in (client.ping, client.status):
                        started = time.monotonic()
                        with pytest.raises(NoReply):
                            call()
                        took = time.monotonic() - started
                        assert took <= BOUND_S, f"{took * 1000:.0f} ms"
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
