"""The rule-engine fallback and the migration modes with real processes (test engine).

Nodes here run two (or one) test-engine model workers plus the rule worker ``rules-0``
(``fallback.rules = "default"``), with 100 ms heartbeats x 3 (tests/conftest.py). The test
engine's ``!slow <ms>`` directive makes a model call slow; ``!json <object>`` makes it answer
that JSON, like a model held to a ``json_schema``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from fallback.intents import INTENT_SCHEMA
from node.testing import Collector, NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]

RULES = {"rules": "default"}
#: Opens once 2+ calls are in its window and half failed; after open_wait_ms a single
#: successful probe closes it.
QUICK_BREAKER = {
    "minimum_calls": 2,
    "open_wait_ms": 1000,
    "half_open_probes": 1,
    "half_open_successes": 1,
}
KITCHEN_ON = {"intent": "lights_on", "room": "kitchen"}


def migration_log(node: NodeProcess) -> Path:
    return node.run_dir / "logs" / "migration.jsonl"


def records(node: NodeProcess, event: str | None = None) -> list[dict[str, Any]]:
    """The migration log's records so far (of one ``event`` kind if given)."""
    path = migration_log(node)
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if event is None or r["event"] == event]


def llm_workers(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in status["workers"] if w["kind"] == "llm"]


def breaker(status: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, Any] = status["routing"]["breaker"]
    return state


def restarts(status: dict[str, Any]) -> dict[str, int]:
    return {p["worker_id"]: p["restarts"] for p in status["processes"]}


def idle_with_full_credit(node: NodeProcess, workers: int) -> dict[str, Any]:
    """Wait until ``workers`` workers (model and rules) are registered, idle, all credit back."""

    def check() -> dict[str, Any] | None:
        s = node.status()
        ok = len(s["workers"]) == workers and s["credit"] == workers and s["all_ready"]
        return s if ok and s["in_flight"] == 0 and s["queue_depth"] == 0 else None

    status: dict[str, Any] = wait_for(check, timeout=15)
    return status


def ask_raw(node: NodeProcess, **body: Any) -> dict[str, Any]:
    """One request with a raw DEALER: its final reply body, errors included."""
    col = Collector(node.frontend)
    try:
        col.send(**body)
        col.collect(timeout=10, linger=0)
        return col.final(body["id"])
    finally:
        col.close()


# --------------------------------------------------------------------------- degrade mode


def test_killing_every_model_worker_degrades_to_the_rules_then_probes_back(
    make_node: NodeFactory,
) -> None:
    node = make_node(
        fallback=RULES,
        # A longer wait than the restart: the breaker is still open when workers are back.
        breaker={**QUICK_BREAKER, "open_wait_ms": 3000},
    )
    with node.client(wait_ms=5000) as c:
        first = c.generate("Turn on the kitchen lights")
        assert (first.served_by, first.degraded) == ("llm", False)

        status = node.status()
        assert breaker(status)["state"] == "closed"
        killed_at = time.monotonic()
        for w in llm_workers(status):
            os.kill(w["pid"], signal.SIGKILL)
        status = wait_for(lambda: (s := node.status()) and not llm_workers(s) and s, every=0.005)
        detected_at = time.monotonic()
        assert detected_at - killed_at < 1.0  # reaped at SIGCHLD, not after heartbeats
        # 1 success + 2 idle workers lost (failures) = 67 % of 3 >= minimum_calls: open.
        assert breaker(status)["state"] == "open"
        assert breaker(status)["times_opened"] == 1

        reply = c.generate("Turn on the kitchen lights")
        answered_in = time.monotonic() - detected_at
        assert (reply.served_by, reply.degraded) == ("rules", True)
        assert reply.raw["degrade_reason"] in ("no_model_worker", "circuit_open")
        assert json.loads(reply.text) == KITCHEN_ON and reply.raw["rule"] == "lights_on"
        assert answered_in < 1.0, answered_in

        # The workers are restarted (500 ms backoff) while the breaker stays open: the
        # rules keep answering, now because of the breaker.
        wait_for(lambda: len(llm_workers(node.status())) == 2)
        status = node.status()
        assert breaker(status)["state"] == "open", breaker(status)
        reply = c.generate("lock the front door")
        assert (reply.served_by, reply.degraded) == ("rules", True)
        assert reply.raw["degrade_reason"] == "circuit_open"

        # After open_wait_ms the breaker lets one probe through; its success closes it.
        wait_for(lambda: breaker(node.status())["state"] == "half_open", timeout=5)
        probe = c.generate("Turn on the kitchen lights")
        assert (probe.served_by, probe.degraded) == ("llm", False)
        assert "degrade_reason" not in probe.raw
        status = node.status()
        assert breaker(status)["state"] == "closed"
        assert breaker(status)["times_opened"] == 1
        for i in range(4):
            reply = c.generate(f"request {i}")
            assert (reply.served_by, reply.degraded, reply.text) == (
                "llm",
                False,
                f"echo: request {i}",
            )
    status = idle_with_full_credit(node, 3)
    assert restarts(status) == {"llm-0": 1, "llm-1": 1, "rules-0": 0}
    fallbacks = records(node, "fallback")
    assert [r["reason"] for r in fallbacks][-1] == "circuit_open"
    assert {r["mode"] for r in fallbacks} == {"degrade"}


def test_latency_budget_hands_a_slow_model_call_to_the_rules(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1}, fallback=RULES, routing={"ttft_budget_ms": 200})
    with node.client(wait_ms=5000) as c:
        start = time.monotonic()
        # First token after 800 ms: the 200 ms budget to the first token cannot be met.
        reply = c.generate("!slow 800 turn on the kitchen lights", max_tokens=4)
        elapsed = time.monotonic() - start
        assert (reply.served_by, reply.degraded) == ("rules", True)
        assert reply.raw["degrade_reason"] == "latency_budget"
        assert json.loads(reply.text) == KITCHEN_ON
        assert 0.2 <= elapsed < 0.8, elapsed
    # The model worker got CANCEL and acked: its credit is back without a restart (a worker
    # that did not ack within cancel_grace_ms would have been killed as hung).
    status = idle_with_full_credit(node, 2)
    assert restarts(status) == {"llm-0": 0, "rules-0": 0}
    assert status["counters"].get("workers_lost", 0) == 0
    assert status["counters"]["fallback_latency_budget"] == 1
    assert status["counters"]["hedge_rules_won"] == 1
    assert "hedge_model_kept" not in status["counters"]
    assert breaker(status)["state"] == "closed" and breaker(status)["calls"] == 0
    assert "cancelled" in (node.run_dir / "logs" / "llm-0.log").read_text()
    fallback = wait_for(lambda: records(node, "fallback"))
    assert [(r["reason"], r["mode"], r["hedge"]) for r in fallback] == [
        ("latency_budget", "degrade", "rules_won")
    ]
    # A model that answers in time is still the model.
    with node.client(wait_ms=5000) as c:
        reply = c.generate("turn on the kitchen lights")
        assert (reply.served_by, reply.degraded) == ("llm", False)


def test_a_rule_miss_at_the_latency_budget_waits_for_the_model(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1}, fallback=RULES, routing={"ttft_budget_ms": 200})
    with node.client(wait_ms=5000) as c:
        start = time.monotonic()
        # First token after 400 ms, past the 200 ms budget; and no rule knows this one.
        reply = c.generate("!slow 400 sing me a song", max_tokens=3)
        elapsed = time.monotonic() - start
        assert (reply.served_by, reply.degraded, reply.text) == ("llm", False, "echo: !slow 400")
        assert "degrade_reason" not in reply.raw
        assert elapsed >= 1.2, elapsed  # 3 tokens x 400 ms: the model's whole answer
    status = idle_with_full_credit(node, 2)
    assert restarts(status) == {"llm-0": 0, "rules-0": 0}
    assert status["counters"]["hedge_model_kept"] == 1
    assert "hedge_rules_won" not in status["counters"]
    assert "fallback_latency_budget" not in status["counters"]
    assert "cancelled" not in (node.run_dir / "logs" / "llm-0.log").read_text()
    logged = wait_for(lambda: records(node, "llm"))
    assert [(r["status"], r["hedge"]) for r in logged] == [("ok", "model_kept")]
    assert records(node, "fallback") == []


# --------------------------------------------------------------------------- explicit, full


def test_explicit_rules_route_and_the_rule_answer_fields(make_node: NodeFactory) -> None:
    node = make_node(fallback=RULES)
    with node.client(wait_ms=5000) as c:
        reply = c.generate("Turn on the kitchen lights", route="rules")
        assert (reply.served_by, reply.degraded) == ("rules", False)
        assert reply.raw["worker"] == "rules-0" and reply.raw["rule"] == "lights_on"
        assert 0 < reply.raw["confidence"] <= 1
        assert json.loads(reply.text) == KITCHEN_ON
        unknown = c.generate("sing me a song", route="rules")
        assert (unknown.text, unknown.raw["confidence"], unknown.raw["rule"]) == (
            "no rule matched",
            0.0,
            None,
        )
        with_schema = c.generate("sing me a song", route="rules", json_schema=INTENT_SCHEMA)
        assert json.loads(with_schema.text) == {"intent": "unknown"}
        assert c.generate("Turn on the kitchen lights").served_by == "llm"  # auto: the model
        assert c.generate("Turn on the kitchen lights", route="llm").served_by == "llm"
    # Degrade mode logs the model's calls (and fallbacks), not the explicit rules requests.
    logged = wait_for(lambda: len(records(node)) == 2 and records(node))
    assert [(r["event"], r["mode"], r["status"]) for r in logged] == [("llm", "degrade", "ok")] * 2


def test_full_mode_never_uses_the_rules_and_an_open_breaker_is_503(
    make_node: NodeFactory,
) -> None:
    node = make_node(
        fallback=RULES,
        routing={"mode": "full"},
        breaker={**QUICK_BREAKER, "open_wait_ms": 5000},
    )
    with node.client(wait_ms=5000) as c:
        reply = c.generate("Turn on the kitchen lights")
        assert (reply.served_by, reply.degraded) == ("llm", False)
    # 1 success + 2 workers lost = 67 % failures over minimum_calls: open.
    for w in llm_workers(node.status()):
        os.kill(w["pid"], signal.SIGKILL)
    status = wait_for(lambda: (s := node.status()) and breaker(s)["state"] == "open" and s)
    refused = ask_raw(node, id="x", op="generate", prompt="Turn on the kitchen lights")
    assert (refused["status"], refused["code"], refused["reason"]) == ("error", 503, "circuit_open")
    assert 0 < refused["retry_after_ms"] <= 5000
    # Still refused once the workers are back: the breaker waits its open_wait_ms.
    wait_for(lambda: len(llm_workers(node.status())) == 2)
    refused = ask_raw(node, id="y", op="generate", prompt="Turn on the kitchen lights")
    assert (refused["code"], refused["reason"]) == (503, "circuit_open")
    # The rules are there, for whoever asks them explicitly.
    with node.client(wait_ms=5000) as c:
        reply = c.generate("Turn on the kitchen lights", route="rules")
        assert (reply.served_by, reply.degraded) == ("rules", False)
    status = node.status()
    assert not any(k.startswith("fallback_") for k in status["counters"]), status["counters"]
    assert status["counters"]["shed_circuit_open"] == 2
    assert records(node, "fallback") == []


# --------------------------------------------------------------------------- shadow, dual


def test_shadow_mode_rules_answer_and_the_model_gets_copies_when_free(
    make_node: NodeFactory,
) -> None:
    node = make_node(workers={"count": 1}, fallback=RULES, routing={"mode": "shadow"})
    with node.client(wait_ms=5000) as c:
        a = c.generate("Turn on the kitchen lights", id="a")
        assert (a.served_by, a.degraded, a.raw["rule"]) == ("rules", False, "lights_on")
        assert json.loads(a.text) == KITCHEN_ON
        wait_for(lambda: records(node, "pair"))
        # b's copy keeps the only model worker busy for 1.5 s (5 tokens x 300 ms) ...
        b = c.generate("!slow 300 lock up", id="b")
        assert (b.served_by, b.raw["rule"]) == ("rules", "door_lock")
        wait_for(lambda: any(w["active"] for w in llm_workers(node.status())))
        # ... so c gets no copy, and its answer does not wait for the model.
        start = time.monotonic()
        cc = c.generate("dock", id="c")
        assert time.monotonic() - start < 0.3
        assert (cc.served_by, cc.degraded, cc.raw["rule"]) == ("rules", False, "robot_dock")
        assert cc.total_ms < 300
    wait_for(lambda: len(records(node, "pair")) == 2, timeout=5)
    pairs = {r["id"]: r for r in records(node, "pair")}
    assert set(pairs) == {"a", "b"}
    for rid, prompt in (("a", "Turn on the kitchen lights"), ("b", "!slow 300 lock up")):
        pair = pairs[rid]
        assert (pair["mode"], pair["prompt"], pair["schema"]) == ("shadow", prompt, False)
        assert pair["rules"]["status"] == "ok" and pair["rules"]["confidence"] > 0.5
        assert pair["llm"]["status"] == "ok" and pair["llm"]["worker"] == "llm-0"
        assert pair["llm"]["text"] == f"echo: {prompt}"
        assert pair["llm"]["ttft_ms"] is not None and pair["llm"]["latency_ms"] >= 0
        assert pair["low_confidence"] is False
        # The rules' JSON against the echo's text: every JSON field disagrees.
        assert pair["agreement"]["kind"] == "mixed" and pair["agreement"]["agree"] is False
    assert pairs["a"]["rules"]["rule"] == "lights_on"
    assert pairs["a"]["agreement"]["fields"] == ["intent", "room"]
    assert pairs["b"]["llm"]["latency_ms"] >= 1500
    skipped = records(node, "copy_skipped")
    assert [(r["id"], r["mode"], r["reason"]) for r in skipped] == [("c", "shadow", "no_credit")]

    result = node.cli("report", "--log", str(migration_log(node)), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)["by_mode"]["shadow"]
    assert summary["pairs"]["count"] == 2 and summary["pairs"]["compared"] == 2
    assert summary["copy_skipped"] == {"total": 1, "by_reason": {"no_credit": 1}}
    assert summary["latency_ms"]["rules"]["count"] == 2
    assert summary["latency_ms"]["llm"]["p99"] >= 1500
    text = node.cli("report", "--log", str(migration_log(node)))
    assert text.returncode == 0, text.stderr
    assert "shadow: 0.0% agreement over 2 pairs" in text.stdout
    assert "copies skipped: 1 (no_credit 1)" in text.stdout
    assert "verdict: hold: only 2 model samples" in text.stdout


def _json_chat(rid: str, command: str, model_answer: dict[str, Any]) -> dict[str, Any]:
    """A chat request with the intent schema; the test engine answers ``model_answer``."""
    return {
        "id": rid,
        "op": "chat",
        "messages": [
            {"role": "system", "content": "!json " + json.dumps(model_answer)},
            {"role": "user", "content": command},
        ],
        "json_schema": INTENT_SCHEMA,
    }


def test_dual_mode_pairs_every_request_and_compares_json_field_by_field(
    make_node: NodeFactory,
) -> None:
    node = make_node(workers={"count": 1}, fallback=RULES, routing={"mode": "dual"})
    col = Collector(node.frontend)
    try:
        # Sent together: the one model worker is busy, yet every request gets its copy.
        col.send(**_json_chat("same", "Turn on the kitchen lights", KITCHEN_ON))
        col.send(
            **_json_chat("room", "Turn on the kitchen lights", {**KITCHEN_ON, "room": "bedroom"})
        )
        col.send(**_json_chat("intent", "dock", {"intent": "robot_stop"}))
        col.send(id="text", op="generate", prompt="what is the meaning of life")
        col.collect(timeout=10)
        col.assert_exactly_one_final_each()
    finally:
        col.close()
    for rid in col.sent:
        reply = col.final(rid)
        assert (reply["status"], reply["served_by"], reply["degraded"]) == ("ok", "rules", False)
    assert json.loads(col.final("same")["text"]) == KITCHEN_ON

    pairs = {
        r["id"]: r
        for r in wait_for(lambda: len(records(node, "pair")) == 4 and records(node, "pair"))
    }
    assert records(node, "copy_skipped") == []
    assert all(p["mode"] == "dual" for p in pairs.values())
    assert [pairs[k]["schema"] for k in ("same", "room", "intent", "text")] == [
        True,
        True,
        True,
        False,
    ]
    agreement = {rid: p["agreement"] for rid, p in pairs.items()}
    assert agreement["same"] == {
        "kind": "json",
        "agree": True,
        "ratio": 1.0,
        "fields": ["intent", "room"],
        "disagree": [],
    }
    assert agreement["room"] == {
        "kind": "json",
        "agree": False,
        "ratio": 0.5,
        "fields": ["intent", "room"],
        "disagree": ["room"],
    }
    assert (agreement["intent"]["kind"], agreement["intent"]["disagree"]) == ("json", ["intent"])
    assert pairs["room"]["llm"]["text"] == '{"intent":"lights_on","room":"bedroom"}'
    # No rule matched: a text comparison, flagged for review as low-confidence.
    assert agreement["text"]["kind"] == "text" and agreement["text"]["agree"] is False
    assert pairs["text"]["rules"]["confidence"] == 0.0 and pairs["text"]["rules"]["rule"] is None
    assert pairs["text"]["low_confidence"] is True

    result = node.cli("report", "--log", str(migration_log(node)), "--json")
    assert result.returncode == 0, result.stderr
    dual = json.loads(result.stdout)["by_mode"]["dual"]["pairs"]
    assert (dual["count"], dual["compared"], dual["agree"], dual["agreement_pct"]) == (
        4,
        4,
        1,
        25.0,
    )
    assert dual["kinds"] == {"json": 3, "text": 1}
    assert dual["low_confidence"] == 1
    assert dict(dual["top_disagreeing_fields"]) == {"intent": 1, "room": 1}


def test_a_flood_of_shadow_traffic_never_delays_the_rules(make_node: NodeFactory) -> None:
    # Each model copy takes >= 5 tokens x 500 ms = 2.5 s; a rule answer takes ~1 ms.
    node = make_node(
        workers={"count": 2, "test_token_ms": 500},
        fallback=RULES,
        routing={"mode": "shadow"},
        broker={"max_queue": 1000, "max_in_flight_per_client": 1000},
    )
    commands = [
        "Turn on the kitchen lights",
        "lock the front door",
        "move forward 2 meters",
        "what's the battery level?",
        "Set the thermostat to 21 degrees",
    ]
    n = 200
    col = Collector(node.frontend)
    try:
        for i in range(n):
            col.send(id=i, op="generate", prompt=commands[i % len(commands)])
        # Read until every request has its answer (Collector.collect rescans all ids per
        # message: too slow to time a flood with).
        deadline = time.monotonic() + 10
        finals = 0
        while finals < n and time.monotonic() < deadline:
            if col.sock.poll(20):
                body = msgpack.unpackb(col.sock.recv_multipart()[-1])
                col.replies.setdefault(body["id"], []).append(body)
                finals += body["status"] != "partial"
        # Every answer is in while the model still works on its first copies: no copy has
        # finished, so nothing the model does could have held an answer back.
        status = node.status()
        assert records(node, "pair") == []
        assert status["routing"]["pairs_pending"] == sum(w["active"] for w in llm_workers(status))
        assert status["queue_depth"] == 0  # copies never wait in the queue in shadow mode
        col.collect(timeout=0, linger=0.3)
        col.assert_exactly_one_final_each()
    finally:
        col.close()
    replies = [col.final(i) for i in range(n)]
    assert {(r["status"], r["served_by"], r["degraded"]) for r in replies} == {
        ("ok", "rules", False)
    }
    wait_for(lambda: node.status()["routing"]["pairs_pending"] == 0, timeout=10)
    pairs = records(node, "pair")
    skipped = records(node, "copy_skipped")
    assert len(pairs) + len(skipped) == n
    assert 1 <= len(pairs) <= 2, len(pairs)  # the two model workers were free only at first
    assert {r["reason"] for r in skipped} == {"no_credit"}
    assert all(p["llm"]["status"] == "ok" and p["llm"]["latency_ms"] >= 2500 for p in pairs)
