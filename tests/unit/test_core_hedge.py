"""Degrade mode's latency budget is a hedge, driven with a fake clock.

When the model misses ``routing.ttft_budget_ms`` the rules are asked in parallel and
the model keeps running: a rule that matches answers the client (``degraded``,
``latency_budget``) and the model's job is cancelled; a rule miss ("no rule matched",
confidence 0) is dropped and the client gets the model's answer. The model's
failures (breaker open, worker lost) still fall back to whatever the rules say.
Every scenario ends with ``h.assert_each_answered_once()``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from broker import protocol as p
from broker.breaker import BreakerSettings
from broker.exits import ExitCause
from broker.protocol import WorkerCommand
from broker.routing import RoutingSettings
from brokerkit import FAST, RULES, W1, W2, BrokerHarness, ToWorker, bodies, generate

REQUEST = WorkerCommand.REQUEST
CANCEL = WorkerCommand.CANCEL
NO_MATCH = {"text": "no rule matched", "confidence": 0.0, "rule": None}
KITCHEN = '{"intent":"lights_on","room":"kitchen"}'
MATCH = {"text": KITCHEN, "confidence": 0.9, "rule": "lights_on"}
QUICK_BREAKER = BreakerSettings(minimum_calls=2, open_wait_ms=1000)


def harness(budget_ms: int = 200, **settings: Any) -> BrokerHarness:
    """Degrade mode with a rule worker (``RULES``, 1 slot) and one model worker ``W1``."""
    routing = RoutingSettings("degrade", budget_ms)
    h = BrokerHarness(replace(FAST, **settings), routing, QUICK_BREAKER)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    return h


def cancels(out: list[ToWorker], identity: bytes) -> list[int]:
    """The rids of the CANCELs sent to ``identity``."""
    return [m.body["rid"] for m in out if m.identity == identity and m.command is CANCEL]


def counters(h: BrokerHarness, now: float) -> dict[str, int]:
    found: dict[str, int] = h.broker.status(now)["counters"]
    return found


def hedge_counters(h: BrokerHarness, now: float) -> dict[str, int]:
    """The hedge outcomes and latency-budget fallbacks counted so far."""
    names = ("hedge_rules_won", "hedge_model_kept", "fallback_latency_budget")
    return {k: v for k, v in counters(h, now).items() if k in names}


def model_then_hedge(h: BrokerHarness, body: dict[str, Any]) -> tuple[int, int]:
    """Send ``body`` at 0.0, let the budget pass at 0.25; the (model rid, rules rid).

    Asserts that the rules were asked and the model was *not* cancelled.
    """
    h.send(body, 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.tick(0.25, keepalive=(W1, RULES))
    out = h.drain_workers()
    assert cancels(out, W1) == []  # the model keeps running
    (asked,) = bodies(out, RULES, REQUEST)
    assert asked["prompt"] == body["prompt"]
    return req["rid"], asked["rid"]


# --------------------------------------------------------------------------- the budget


def test_a_rule_miss_at_the_budget_is_dropped_and_the_model_answers() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="sing me a song"))
    h.final(RULES, rules, 0.26, **NO_MATCH)
    assert h.replies() == []  # "no rule matched" is no answer: the client keeps waiting
    assert h.drain_workers() == []
    h.final(W1, model, 0.9, text="echo: sing me a song")
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degraded"], reply["text"]) == (
        "llm",
        False,
        "echo: sing me a song",
    )
    assert "degrade_reason" not in reply and reply["total_ms"] == 900
    assert hedge_counters(h, 1.0) == {"hedge_model_kept": 1}
    assert h.credit(W1) == 1 and h.credit(RULES) == 1
    (record,) = h.broker.outbox.records
    assert (record["event"], record["status"], record["hedge"]) == ("llm", "ok", "model_kept")
    h.assert_each_answered_once()


def test_a_rule_match_at_the_budget_answers_and_then_cancels_the_model() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="turn on the kitchen lights"))
    h.final(RULES, rules, 0.26, **MATCH)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degraded"], reply["degrade_reason"]) == (
        "rules",
        True,
        "latency_budget",
    )
    assert (reply["text"], reply["rule"], reply["confidence"]) == (KITCHEN, "lights_on", 0.9)
    assert reply["total_ms"] == 260
    assert cancels(h.drain_workers(), W1) == [model]
    assert h.credit(W1) == 0  # the model's credit returns with its ack, not before
    h.final(W1, model, 0.3, status="cancelled", code=499)
    assert h.credit(W1) == 1
    assert hedge_counters(h, 0.3) == {"hedge_rules_won": 1, "fallback_latency_budget": 1}
    (record,) = h.broker.outbox.records
    assert (record["event"], record["reason"], record["hedge"]) == (
        "fallback",
        "latency_budget",
        "rules_won",
    )
    assert h.broker.router.breaker.snapshot(0.3)["calls"] == 0  # released, not judged
    h.assert_each_answered_once()


def test_a_rules_error_is_no_answer_either() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="turn on the kitchen lights"))
    h.final(RULES, rules, 0.26, status="error", code=500, message="boom")
    assert h.replies() == []
    h.final(W1, model, 0.5)
    assert h.replies()[0]["served_by"] == "llm"
    assert hedge_counters(h, 0.5) == {"hedge_model_kept": 1}
    h.assert_each_answered_once()


def test_a_stream_that_started_while_the_rules_were_asked_stays_with_the_model() -> None:
    h = harness()
    body = generate("s", prompt="turn on the kitchen lights", stream=True)
    model, rules = model_then_hedge(h, body)
    h.partial(W1, model, "echo:", 0.255)
    h.final(RULES, rules, 0.26, **MATCH)  # too late: the client has the model's first token
    h.final(W1, model, 0.4, text="echo: turn")
    partial, final = h.replies()
    assert (partial["status"], final["served_by"], final["degraded"]) == ("partial", "llm", False)
    assert cancels(h.drain_workers(), W1) == []
    assert hedge_counters(h, 0.4) == {"hedge_model_kept": 1}
    h.assert_each_answered_once()


def test_a_streamed_hedge_is_held_back_until_the_rules_win() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("s", prompt="lights on", stream=True))
    h.partial(RULES, rules, KITCHEN, 0.255)  # the rule engine streams its answer whole
    assert h.replies() == []  # not yet known to be an answer
    h.final(RULES, rules, 0.26, **MATCH)
    partial, final = h.replies()
    assert (partial["status"], partial["text"], partial["index"]) == ("partial", KITCHEN, 0)
    assert (final["text"], final["served_by"], final["degraded"]) == (KITCHEN, "rules", True)
    assert cancels(h.drain_workers(), W1) == [model]
    h.final(W1, model, 0.3, status="cancelled", code=499)
    h.assert_each_answered_once()


def test_a_streamed_rule_miss_never_reaches_the_client() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("s", prompt="sing me a song", stream=True))
    h.partial(RULES, rules, "no rule matched", 0.255)
    h.final(RULES, rules, 0.26, **NO_MATCH)
    assert h.replies() == []
    h.partial(W1, model, "echo:", 0.4)
    h.final(W1, model, 0.5, text="echo:")
    partial, final = h.replies()
    assert (partial["text"], partial["index"], final["served_by"]) == ("echo:", 0, "llm")
    h.assert_each_answered_once()


def test_a_first_token_within_the_budget_means_no_hedge() -> None:
    h = harness()
    h.send(generate("s", stream=True), 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, req["rid"], "echo:", 0.1)
    h.tick(0.25, keepalive=(W1, RULES))
    assert h.drain_workers() == []
    h.final(W1, req["rid"], 1.0)
    assert hedge_counters(h, 1.0) == {}
    h.assert_each_answered_once()


def test_a_model_answer_before_the_rules_ran_drops_the_queued_hedge() -> None:
    h = harness()
    h.send(generate("r", route="rules"), 0.0)  # keeps the only rule slot busy
    (busy,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.send(generate("q", prompt="turn on the kitchen lights"), 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.tick(0.25, keepalive=(W1, RULES))
    assert h.drain_workers() == []  # the hedge waits for the rule slot
    h.final(W1, req["rid"], 0.3)
    assert h.replies()[0]["served_by"] == "llm"
    h.final(RULES, busy["rid"], 0.35, **MATCH)
    assert h.drain_workers() == []  # the dropped hedge never runs
    assert h.broker.status(0.35)["queue_depth"] == 0
    assert hedge_counters(h, 0.35) == {"hedge_model_kept": 1}
    h.assert_each_answered_once()


def test_the_deadline_while_the_rules_are_asked_answers_once() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="hi", timeout_ms=500))
    h.tick(0.5, keepalive=(W1, RULES))
    (reply,) = h.replies()
    assert reply["code"] == 504
    assert cancels(h.drain_workers(), W1) == [model]
    h.final(RULES, rules, 0.55, **MATCH)  # a late match answers nobody
    h.final(W1, model, 0.6, status="cancelled", code=499)
    assert h.replies() == []
    assert h.credit(W1) == 1 and h.credit(RULES) == 1
    h.assert_each_answered_once()


def test_a_client_cancel_while_the_rules_are_asked_answers_once() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="turn on the kitchen lights"))
    h.send({"id": "c", "op": "cancel", "target": "q"}, 0.3)
    assert [(r["id"], r.get("code")) for r in h.replies()] == [("q", 499), ("c", None)]
    h.final(RULES, rules, 0.31, **MATCH)
    h.final(W1, model, 0.32, status="cancelled", code=499)
    assert h.replies() == []
    h.assert_each_answered_once()


def test_shutdown_while_the_rules_are_asked_answers_once() -> None:
    h = harness()
    model_then_hedge(h, generate("q", prompt="turn on the kitchen lights"))
    h.broker.abort_all("stopping", 0.3)
    (reply,) = h.replies()
    assert (reply["id"], reply["code"], reply["reason"]) == ("q", 503, "shutdown")
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- at admission


def test_a_predicted_wait_over_the_budget_asks_the_rules_at_once() -> None:
    h = harness(max_queue=8)
    h.broker.estimator.observe_service(1.0)  # the model takes 1 s: any queueing misses 200 ms
    h.send(generate("busy"), 0.0)
    (busy,) = bodies(h.drain_workers(), W1, REQUEST)
    h.send(generate("q", prompt="sing me a song"), 0.1)
    h.send(generate("m", prompt="turn on the kitchen lights"), 0.1)
    out = h.drain_workers()
    assert bodies(out, W1, REQUEST) == []  # both wait for the model ...
    (ask_q,) = bodies(out, RULES, REQUEST)  # ... and the rules are asked at once
    assert h.broker.status(0.1)["queue_depth"] == 3  # q's and m's model jobs, m's hedge
    h.final(RULES, ask_q["rid"], 0.11, **NO_MATCH)
    (ask_m,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.final(RULES, ask_m["rid"], 0.12, **MATCH)
    (m,) = h.replies()
    assert (m["id"], m["served_by"], m["degrade_reason"]) == ("m", "rules", "latency_budget")
    h.final(W1, busy["rid"], 1.0)
    (q_model,) = bodies(h.drain_workers(), W1, REQUEST)  # q's turn; m's model job is gone
    assert q_model["prompt"] == "sing me a song"
    h.final(W1, q_model["rid"], 2.0, text="echo: sing me a song")
    replies = {r["id"]: r for r in h.replies()}
    assert (replies["q"]["served_by"], replies["q"]["degraded"]) == ("llm", False)
    assert hedge_counters(h, 2.0) == {
        "hedge_rules_won": 1,
        "hedge_model_kept": 1,
        "fallback_latency_budget": 1,
    }
    assert h.broker.status(2.0)["queue_depth"] == 0
    h.assert_each_answered_once()


def test_a_request_the_model_cannot_take_is_left_to_the_rules_whatever_they_say() -> None:
    h = harness()
    h.broker.estimator.observe_service(1.0)
    h.send(generate("busy"), 0.0)
    (busy,) = bodies(h.drain_workers(), W1, REQUEST)
    # The model could not start it within its 500 ms: nothing better than the rules.
    h.send(generate("q", prompt="sing me a song", timeout_ms=500), 0.1)
    (asked,) = h.requests(RULES)
    h.final(RULES, asked["rid"], 0.11, **NO_MATCH)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degrade_reason"], reply["text"]) == (
        "rules",
        "latency_budget",
        "no rule matched",
    )
    h.final(W1, busy["rid"], 1.0)
    assert "hedge_model_kept" not in counters(h, 1.0)
    h.assert_each_answered_once()


def one_second_answers(h: BrokerHarness, at: float) -> None:
    """The model serves one request at ``at``: 16 tokens (the default max_tokens)
    in 1 s, so its size model predicts 1 s for the next one alone."""
    h.send(generate("warm", prompt="warm up"), at)
    (warm,) = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, warm["rid"], "w", at + 0.05)
    usage = {"prompt_tokens": 4, "completion_tokens": 16}
    h.final(W1, warm["rid"], at + 1.0, text="w" * 16, usage=usage)
    assert [r["id"] for r in h.replies() if r["status"] != "partial"] == ["warm"]
    assert h.broker.estimator.sized("llm")


def test_an_idle_model_too_slow_for_the_deadline_leaves_the_request_to_the_rules() -> None:
    # An idle node refused it 503 deadline_unmeetable while a busy one answered the
    # same request from the rules: a defensive client's breaker opened against an
    # idle, healthy node (break-it pass, session 19). No probe either: in degrade mode
    # the rules answer, where a probe would make the client wait to its deadline.
    h = harness()
    one_second_answers(h, 0.0)  # 300 ms is too short
    for n, at in enumerate((2.0, 5.0, 8.0)):  # idle each time, past the probe interval
        h.send(generate(f"q{n}", prompt="turn on the kitchen lights", timeout_ms=300), at)
        out = h.drain_workers()
        assert bodies(out, W1, REQUEST) == []
        (asked,) = bodies(out, RULES, REQUEST)
        h.final(RULES, asked["rid"], at + 0.01, **MATCH)
        (reply,) = h.replies()
        assert (reply["id"], reply["served_by"], reply["degrade_reason"]) == (
            f"q{n}",
            "rules",
            "latency_budget",
        )
        assert reply["text"] == KITCHEN
    # What the model can do in time is still the model's.
    h.send(generate("slow", prompt="tell me a story", timeout_ms=5000), 11.0)
    (model,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, model["rid"], 12.0, text="a story")
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degraded"]) == ("llm", False)
    h.assert_each_answered_once()


def test_a_model_not_done_near_the_deadline_asks_the_rules_whose_match_answers() -> None:
    # The first token came within the latency budget, so nothing asked the rules, and
    # a model that ran on to max_tokens answered 504 at the deadline: 25 of 30
    # requests of the README's 300 ms defensive client on an idle node, whose size
    # model had learned only from the answers that stopped early (break-it pass 2,
    # session 19).
    h = harness()
    h.send(generate("m", prompt="turn on the kitchen lights", timeout_ms=300), 0.0)
    (model,) = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, model["rid"], "The", 0.03)  # a first token in time: no hedge
    h.tick(0.2, keepalive=(W1, RULES))
    assert h.drain_workers() == []
    h.tick(0.25, keepalive=(W1, RULES))  # 50 ms before the deadline
    out = h.drain_workers()
    assert cancels(out, W1) == []
    (asked,) = bodies(out, RULES, REQUEST)
    h.final(RULES, asked["rid"], 0.26, **MATCH)
    (reply,) = [r for r in h.replies() if r["status"] != "partial"]
    assert (reply["id"], reply["served_by"], reply["degrade_reason"]) == (
        "m",
        "rules",
        "latency_budget",
    )
    assert cancels(h.drain_workers(), W1) == [model["rid"]]
    h.final(W1, model["rid"], 0.27, status="error", code=499, message="cancelled")
    h.assert_each_answered_once()


def test_a_rule_miss_near_the_deadline_leaves_the_model_its_504() -> None:
    h = harness()
    h.send(generate("q", prompt="sing me a song", timeout_ms=300), 0.0)
    (model,) = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, model["rid"], "La", 0.03)
    h.tick(0.25, keepalive=(W1, RULES))
    (asked,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.final(RULES, asked["rid"], 0.26, **NO_MATCH)
    assert [r for r in h.replies() if r["status"] != "partial"] == []
    h.tick(0.3, keepalive=(W1, RULES))
    (reply,) = [r for r in h.replies() if r["status"] != "partial"]
    assert (reply["id"], reply["code"]) == ("q", 504)
    h.final(W1, model["rid"], 0.31, status="error", code=499, message="cancelled")
    h.assert_each_answered_once()


def test_in_full_mode_the_deadline_refusal_stays_a_503() -> None:
    h = BrokerHarness(FAST, RoutingSettings("full", 200), QUICK_BREAKER)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    one_second_answers(h, 0.0)
    h.send(generate("probe", prompt="turn on the kitchen lights", timeout_ms=300), 3.0)
    (probe,) = bodies(h.drain_workers(), W1, REQUEST)  # an idle model tests its estimate
    h.send(generate("q", prompt="turn on the kitchen lights", timeout_ms=300), 3.0)
    (reply,) = h.replies()
    assert (reply["id"], reply["code"], reply["reason"]) == ("q", 503, "deadline_unmeetable")
    assert h.drain_workers() == []
    h.final(W1, probe["rid"], 3.2)
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- model failures


def test_a_lost_model_worker_still_falls_back_to_a_rule_miss() -> None:
    h = harness()
    h.ready(W2, 0.0, worker_id="w2")
    h.send(generate("q", prompt="sing me a song"), 0.0)
    (first,) = bodies(h.drain_workers(), W1, REQUEST)
    h.broker.worker_exited(W1.decode(), ExitCause(signal="SIGKILL"), 0.05)
    (again,) = bodies(h.drain_workers(), W2, REQUEST)  # re-dispatched once
    h.broker.worker_exited("w2", ExitCause(signal="SIGKILL"), 0.1)
    (asked,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.final(RULES, asked["rid"], 0.11, **NO_MATCH)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degrade_reason"], reply["text"]) == (
        "rules",
        "worker_lost",
        "no rule matched",
    )
    assert first["rid"] == again["rid"]
    h.assert_each_answered_once()


def test_an_open_breaker_still_falls_back_to_a_rule_miss() -> None:
    h = harness()
    for _ in range(2):
        h.broker.router.breaker.note_failure(0.0, "crash")
    h.send(generate("q", prompt="sing me a song"), 0.1)
    (asked,) = h.requests(RULES)
    h.final(RULES, asked["rid"], 0.11, **NO_MATCH)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degrade_reason"], reply["text"]) == (
        "rules",
        "circuit_open",
        "no rule matched",
    )
    h.assert_each_answered_once()


def test_the_hedge_counters_are_in_status() -> None:
    h = harness()
    model, rules = model_then_hedge(h, generate("q", prompt="turn on the kitchen lights"))
    h.final(RULES, rules, 0.26, **MATCH)
    h.final(W1, model, 0.3, status="cancelled", code=499)
    reply = h.broker.status(0.3)
    assert reply["counters"]["hedge_rules_won"] == 1
    assert p.unpack_map(p.pack(reply))["counters"]["hedge_rules_won"] == 1  # msgpack-ready
    h.assert_each_answered_once()
