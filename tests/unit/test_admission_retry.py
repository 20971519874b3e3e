"""``retry_after_ms`` and the deadline check under a flood, on a fake clock.

The defect (break-it finding D2): a default node (one model worker, 4 slots)
first served four long ``json_schema`` prompts (7.4 s each), then got a flood
of short requests (``max_tokens`` 16, 20 s budget). Those long requests teach
the size model nothing (their grammar would mislead it), so the node
predicted by the mean, which was theirs: every flooded request was
predicted at 7.4 s, the queue at (32 / 4 + 1) x 7.4 = 67 s, so the refusals
carried the 30 s clamp and requests that would have finished in time were
refused ``deadline_unmeetable``, while the backlog cleared in about 14 s.
Constrained (``json_schema``) and plain requests now keep a mean each.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Any

import pytest

from broker.protocol import WorkerCommand
from brokerkit import FAST, W1, BrokerHarness, generate
from node.cli.status_view import render_status

REQUEST = WorkerCommand.REQUEST

SCHEMA = {"type": "object", "properties": {"status": {"type": "string"}}}
LONG_PROMPT = "Sensor 7 reads 42 units and is nominal. " * 190  # ~1900 tokens
LONG_S = 7.4  # each long json_schema request, four at once
#: A flooded request (an 8-token prompt, 16 tokens) beside three others.
SHORT_S = 1.5

#: The default layout's admission: 8 queued per slot, 16 in flight per connection;
#: heartbeats and stall checks out of the way (the fake workers send none).
DEFAULTS = replace(
    FAST,
    max_body_bytes=1 << 20,
    max_queue=0,
    max_in_flight_per_client=16,
    heartbeat_interval_ms=600_000,
    stall_timeout_ms=600_000,
)


class FourSlots:
    """One 4-slot model worker on the fake clock: each request takes the time its
    prompt says (long: ``LONG_S``, else ``SHORT_S``), with its first token at
    once; every client reply is collected with the time it was sent."""

    def __init__(self) -> None:
        self.h = BrokerHarness(DEFAULTS)
        self.h.ready(W1, 0.0, slots=4)
        self._due: list[tuple[float, int, bool]] = []
        self.replies: list[tuple[float, dict[str, Any]]] = []

    def send(self, body: dict[str, Any], now: float, client: bytes) -> None:
        self.h.send(body, now, client=client)
        self._pump(now)

    def _pump(self, now: float) -> None:
        for m in self.h.drain_workers():
            assert m.command is REQUEST
            long = "json_schema" in m.body
            self.h.partial(W1, m.body["rid"], "{", now)
            heapq.heappush(self._due, (now + (LONG_S if long else SHORT_S), m.body["rid"], long))
        self.replies += [(now, r) for r in self.h.replies() if r["status"] != "partial"]

    def run(self, until: float) -> None:
        """Finish requests as they come due until ``until`` (s), dispatching the next."""
        while self._due and self._due[0][0] <= until:
            when, rid, long = heapq.heappop(self._due)
            usage = {"prompt_tokens": 1900 if long else 9, "completion_tokens": 16}
            self.h.final(W1, rid, when, usage=usage)
            self._pump(when)


def long_prompts_then_a_flood(node: FourSlots) -> None:
    """Four long json_schema prompts at once, then at t=10 s 160 short requests
    from 10 connections (16 each, the per-connection cap), as the break-it script."""
    for i in range(4):
        body = generate(f"L{i}", LONG_PROMPT, max_tokens=32, json_schema=SCHEMA, timeout_ms=60_000)
        node.send(body, 0.0, b"long")
    node.run(9.0)
    assert [r["status"] for _, r in node.replies] == ["ok"] * 4
    for c in range(10):
        for i in range(16):
            body = generate(f"c{c}-{i}", f"Robot status report {c} {i}:", max_tokens=16)
            node.send({**body, "timeout_ms": 20_000}, 10.0, f"flood-{c}".encode())


def test_a_flood_after_long_schema_prompts_gets_advice_near_its_real_drain_time() -> None:
    node = FourSlots()
    long_prompts_then_a_flood(node)
    node.run(60.0)
    node.h.assert_each_answered_once()
    flood = [(t, r) for t, r in node.replies if r["id"].startswith("c")]
    served = [t for t, r in flood if r["status"] == "ok"]
    refused = [r for t, r in flood if r["status"] == "error"]
    # 4 slots + 32 queued were admitted and served: nothing waited past its budget.
    assert len(served) == 36 and len(refused) == 124
    assert {(r["code"], r["reason"]) for r in refused} == {(503, "queue_full")}
    # The last admitted request started 8 rounds of 1.5 s after the flood: 12 s.
    started_last = max(served) - SHORT_S - 10.0
    assert started_last == pytest.approx(12.0)
    for r in refused:
        assert started_last / 2 <= r["retry_after_ms"] / 1000 <= started_last * 2


def test_once_the_flood_taught_its_own_mean_the_advice_follows_it() -> None:
    node = FourSlots()
    long_prompts_then_a_flood(node)
    node.run(60.0)
    estimator = node.h.broker.estimator
    assert estimator.mean_s("llm") == pytest.approx(SHORT_S, rel=0.01)
    assert estimator.mean_s("llm", constrained=True) == pytest.approx(LONG_S)  # kept apart
    node.replies.clear()
    for c in range(3):  # a second flood: 48 requests, 36 admitted
        for i in range(16):
            body = generate(f"d{c}-{i}", "Robot status report", max_tokens=16, timeout_ms=20_000)
            node.send(body, 70.0, bytes([c]))
    refused = [r for _, r in node.replies if r["status"] == "error"]
    # (32 queued / 4 slots + 1) x 1.5 s: the drain the first flood showed. The flood
    # taught a decode rate too, so the broker predicts by size: within 1 % of it.
    assert {r["reason"] for r in refused} == {"queue_full"}
    for r in refused:
        assert r["retry_after_ms"] == pytest.approx(13_500, rel=0.01)
    node.run(200.0)
    node.h.assert_each_answered_once()


def test_status_shows_the_constrained_mean_apart() -> None:
    node = FourSlots()
    long_prompts_then_a_flood(node)
    node.run(60.0)
    llm = node.h.broker.status(60.0)["service"]["llm"]
    assert llm["mean_ms"] == pytest.approx(SHORT_S * 1000, rel=0.01)
    assert llm["samples"] == 36
    assert llm["json_schema"] == {"mean_ms": LONG_S * 1000, "samples": 4}
    bare = {"queue_depth": 0, "queue_bound": 1, "in_flight": 0, "credit": 1}
    line = render_status({**bare, "service": {"llm": llm}}).splitlines()[-1]
    assert (
        line.startswith("service: llm mean 1500") and "json_schema mean 7400 ms, 4 served" in line
    )
