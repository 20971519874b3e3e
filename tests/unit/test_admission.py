"""The admission gate with a fake clock: order of checks, shedding, pressure, retry-after."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from broker.client_request import ClientRequest
from broker.protocol import WorkerCommand
from brokerkit import (
    CLIENT,
    FAST,
    OTHER_CLIENT,
    RULES,
    W1,
    W2,
    BrokerHarness,
    Exact,
    bodies,
    generate,
)

REQUEST = WorkerCommand.REQUEST
CANCEL = WorkerCommand.CANCEL


def chars(req: ClientRequest) -> int:
    """A stand-in tokenizer: one token per character."""
    return len(req.prompt or "")


def harness(**settings: Any) -> BrokerHarness:
    h = BrokerHarness(replace(FAST, **settings))
    h.broker.gate.count_tokens = Exact(chars)
    return h


def errors(h: BrokerHarness) -> list[tuple[Any, int, str]]:
    return [
        (r["id"], r["code"], r.get("reason", "")) for r in h.replies() if r["status"] == "error"
    ]


def fill(h: BrokerHarness, n: int, now: float, **fields: Any) -> list[str]:
    ids = [f"q{i}" for i in range(n)]
    for rid in ids:
        h.send(generate(rid, **fields), now)
    return ids


def test_size_check_gives_413_with_the_numbers() -> None:
    h = harness()
    h.ready(W1, 0.0)  # n_ctx 2048
    h.send(generate("big", prompt="w" * 2000, max_tokens=100), 0.0)
    (reply,) = h.replies()
    assert (reply["code"], reply["reason"]) == (413, "too_large")
    assert "2000 tokens + max_tokens 100 = 2100" in reply["message"] and "2048" in reply["message"]
    h.send(generate("fits", prompt="w" * 2000, max_tokens=48), 0.0)
    assert h.replies() == [] and len(bodies(h.drain_workers(), W1, REQUEST)) == 1


def test_order_size_before_pressure_before_queue_before_client_cap() -> None:
    h = harness(max_queue=1, max_in_flight_per_client=1)
    h.ready(W1, 0.0)
    h.send(generate("run"), 0.0)  # runs: the client's one in-flight request
    h.broker.set_pressure("critical", 0.0)
    h.drain_replies()
    # Everything wrong at once: too large wins.
    h.send(generate("a", prompt="w" * 3000), 0.1)
    # Not too large, but pressure: memory_pressure wins over the client cap.
    h.send(generate("b"), 0.1)
    h.broker.set_pressure("ok", 0.2)
    h.send(generate("c", priority="critical"), 0.3, client=OTHER_CLIENT)  # fills the queue
    # Queue full (bound 1) and this client at its cap: queue_full wins.
    h.send(generate("d"), 0.3)
    # Room in the queue again but the client is at its cap: 429.
    h.broker.gate.settings = replace(h.broker.gate.settings, max_queue=8)
    h.send(generate("e"), 0.3)
    assert errors(h) == [
        ("a", 413, "too_large"),
        ("b", 503, "memory_pressure"),
        ("d", 503, "queue_full"),
        ("e", 429, "client_cap"),
    ]


def test_per_client_cap_is_per_client_and_frees_on_reply() -> None:
    h = harness(max_in_flight_per_client=2)
    h.ready(W1, 0.0)
    fill(h, 2, 0.0)
    h.send(generate("third"), 0.0)
    h.send(generate("other"), 0.0, client=OTHER_CLIENT)
    assert errors(h) == [("third", 429, "client_cap")]
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, req["rid"], 0.5)
    h.send(generate("third"), 0.6)  # one answered: room again
    assert errors(h) == []


def test_the_cap_counts_a_key_across_its_connections() -> None:
    # CURVE: the loop passes each connection's authenticated key; two connections
    # (routing ids) with one key are one client for the cap, replies go to each.
    alice, bob = b"A" * 40, b"B" * 40
    h = harness(max_in_flight_per_client=1)
    h.ready(W1, 0.0, slots=4)
    h.send(generate("first"), 0.0, client=CLIENT, principal=alice)
    h.send(generate("second"), 0.0, client=OTHER_CLIENT, principal=alice)
    h.send(generate("bobs"), 0.0, client=OTHER_CLIENT, principal=bob)
    assert errors(h) == [("second", 429, "client_cap")]
    assert h.broker.clients.of(alice) == 1 and h.broker.clients.of(CLIENT) == 0
    # The node's log names the key of each request's path (``RequestTrace.principal``).
    admitted = {t.request_id: t.principal for t in h.broker.outbox.traces if t.step == "admitted"}
    assert admitted == {"first": alice, "bobs": bob}
    first, _ = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, first["rid"], 0.5)
    assert [(c, r["id"]) for c, r in h.drain_replies() if r["status"] == "ok"] == [
        (CLIENT, "first")
    ]
    h.send(generate("second"), 0.6, client=OTHER_CLIENT, principal=alice)  # room again
    assert errors(h) == []
    assert h.broker.clients.of(alice) == 1


def test_priority_evicts_the_newest_lower_class_request_when_full() -> None:
    h = harness(max_queue=2)
    h.ready(W1, 0.0)
    h.send(generate("running"), 0.0)
    h.send(generate("s1", priority="sheddable"), 0.0)
    h.send(generate("s2", priority="sheddable"), 0.0)
    h.send(generate("crit", priority="critical"), 0.0)
    h.send(generate("norm"), 0.0)  # evicts s1 (the only lower class left)
    h.send(generate("norm2"), 0.0)  # nothing lower queued: refused
    assert errors(h) == [
        ("s2", 503, "queue_full"),
        ("s1", 503, "queue_full"),
        ("norm2", 503, "queue_full"),
    ]
    # Dispatch order: critical first, then normal.
    (run,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, run["rid"], 1.0)
    (nxt,) = bodies(h.drain_workers(), W1, REQUEST)
    assert (
        nxt["prompt"] == "hello"
        and (job := h.broker.jobs.get(nxt["rid"])) is not None
        and job.req.id == "crit"
    )


def test_request_that_cannot_start_before_its_deadline_is_refused_at_once() -> None:
    h = harness(max_queue=16)
    h.ready(W1, 0.0)
    h.send(generate("warm"), 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, req["rid"], 2.0)  # measured service time: 2 s
    h.replies()
    h.send(generate("busy"), 2.0)
    fill(h, 2, 2.0)  # two waiting: a new one starts in ~3 x 2 s
    h.send(generate("hurry", timeout_ms=1000), 2.0)
    h.send(generate("patient", timeout_ms=20_000), 2.0)
    ((rid, code, reason),) = errors(h)
    assert (rid, code, reason) == ("hurry", 503, "deadline_unmeetable")


def test_retry_after_follows_the_measured_service_rate() -> None:
    h = harness(max_queue=2)
    h.ready(W1, 0.0)
    h.ready(W2, 0.0)
    fill(h, 2, 0.0)
    for m in h.drain_workers():
        h.final(m.identity, m.body["rid"], 4.0)  # both took 4 s
    h.replies()
    assert h.broker.estimator.samples("llm") == 2
    assert h.broker.estimator.mean_s("llm") == pytest.approx(4.0)
    fill(h, 4, 10.0)  # two run (two slots), two wait: the queue is full
    h.send(generate("late"), 10.0)
    (reply,) = [r for r in h.replies() if r["id"] == "late"]
    # (2 queued / 2 slots + 1) rounds x 4 s = 8 s
    assert (reply["code"], reply["reason"], reply["retry_after_ms"]) == (503, "queue_full", 8000)


def test_pressure_sheds_queued_work_halves_limits_and_restores() -> None:
    h = harness(max_queue=8)
    for w in (W1, W2):
        h.ready(w, 0.0)
    h.send(generate("shed-run", priority="sheddable"), 0.0)
    h.send(generate("norm-run"), 0.0)
    h.send(generate("shed-wait", priority="sheddable"), 0.0)
    h.send(generate("norm-wait"), 0.0)
    h.drain_workers()
    status = h.broker.status(0.0)
    assert (status["queue_bound"], status["credit_limit"]) == (8, 2)

    h.broker.set_pressure("high", 1.0)
    assert errors(h) == [("shed-wait", 503, "memory_pressure")]
    status = h.broker.status(1.0)
    assert (status["pressure"], status["queue_bound"], status["credit_limit"]) == ("high", 4, 1)
    h.send(generate("new-shed", priority="sheddable"), 1.0)
    assert errors(h) == [("new-shed", 503, "memory_pressure")]

    h.broker.set_pressure("critical", 2.0)
    assert errors(h) == [
        ("norm-wait", 503, "memory_pressure"),
        ("shed-run", 503, "memory_pressure"),
    ]
    cancels = [m for m in h.drain_workers() if m.command is CANCEL]
    assert len(cancels) == 1  # the running sheddable request is cancelled on its worker

    h.broker.set_pressure("ok", 3.0)
    status = h.broker.status(3.0)
    assert (status["pressure"], status["queue_bound"], status["credit_limit"]) == ("ok", 8, 2)
    h.send(generate("back", priority="sheddable"), 3.0)
    assert errors(h) == []
    assert status["counters"]["shed_memory_pressure"] == 4


def test_under_pressure_the_broker_uses_half_the_credit() -> None:
    h = harness(max_queue=8)
    for w in (W1, W2):
        h.ready(w, 0.0)
    h.broker.set_pressure("high", 0.0)
    fill(h, 2, 0.0)
    out = h.drain_workers()
    assert sum(m.command is REQUEST for m in out) == 1  # credit limit 1 of 2
    h.broker.set_pressure("ok", 1.0)
    assert sum(m.command is REQUEST for m in h.drain_workers()) == 1  # restored: the other runs


@pytest.mark.parametrize("level", ["bogus", ""])
def test_unknown_pressure_level_is_ignored(level: str) -> None:
    h = harness()
    h.broker.set_pressure(level, 0.0)
    assert h.broker.pressure.level == "ok"


def test_no_workers_means_queue_not_refuse() -> None:
    h = harness()
    h.broker.estimator.observe_service(30.0)  # even with a slow history
    h.send(generate("early", timeout_ms=1000), 0.0)
    assert h.replies() == [] and h.broker.status(0.0)["queue_depth"] == 1
    assert h.broker.clients.of(CLIENT) == 1


def test_prompts_that_surely_fit_are_not_tokenized() -> None:
    calls: list[str] = []

    def counting(req: ClientRequest) -> int:
        calls.append(req.prompt or "")
        return len(req.prompt or "")

    h = harness()
    h.broker.gate.count_tokens = Exact(counting)
    h.ready(W1, 0.0)  # n_ctx 2048
    h.send(generate("small", prompt="turn on the lights", max_tokens=64), 0.0)
    assert calls == []  # 19 bytes + 64 tokens cannot exceed 2048 tokens
    h.send(generate("big", prompt="w" * 2040, max_tokens=64), 0.0)
    assert len(calls) == 1  # might not fit: counted exactly (and refused, 413)
    assert [r["code"] for r in h.replies() if r["status"] == "error"] == [413]


def test_a_model_backlog_leaves_the_rules_their_own_queue() -> None:
    """Break-it finding: in a flood of model requests the rule engine's requests,
    the fallback meant for exactly that time, were refused queue_full."""
    h = harness(max_queue=2)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules", worker_id="rules-0")
    h.send(generate("model-run", route="llm"), 0.0)
    fill(h, 2, 0.0, route="llm")  # the model's queue is full
    h.send(generate("model-more", route="llm"), 0.0)
    h.send(generate("rules-run", route="rules"), 0.0)  # runs at once
    h.send(generate("rules-wait", route="rules"), 0.0)  # waits: the rule worker is busy
    assert errors(h) == [("model-more", 503, "queue_full")]
    assert sum(j.kind == "rules" for j in h.broker.queue) == 1
