"""A four-slot llama worker in a real node: one process, four sequences, and the
broker's promise kept when it dies or when requests are cancelled, expire or
carry a schema (issue 10)."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable

import pytest

from fallback.intents import INTENT_SCHEMA
from node.testing import Collector, NodeProcess, wait_for

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]

NodeFactory = Callable[..., NodeProcess]
SLOTS = 4


def slots_node(make_node: NodeFactory) -> NodeProcess:
    return make_node(
        workers={"engine": "llama", "count": 1, "slots": SLOTS},
        broker={
            "heartbeat_interval_ms": 1000,
            "stall_timeout_ms": 15000,
            "max_in_flight_per_client": 64,
        },
        routing={"mode": "full"},
    )


def credit(node: NodeProcess) -> list[tuple[int, int]]:
    return [(w["credit"], w["slots"]) for w in node.status()["workers"]]


def test_kill9_of_a_four_slot_worker_answers_each_request_once(make_node: NodeFactory) -> None:
    node = slots_node(make_node)
    assert credit(node) == [(SLOTS, SLOTS)]
    col = Collector(node.frontend)
    try:
        for i in range(SLOTS):
            # Two stream (their text is seen: 503 with it), two do not (run again).
            col.send(id=f"r{i}", op="generate", prompt=f"Story number {i}:", max_tokens=96,
                     temperature=0.0, stream=i < 2)  # fmt: skip
        assert wait_for(lambda: credit(node) == [(0, SLOTS)], timeout=20)

        def streamed() -> bool:
            col.collect(timeout=0.05, until_all_final=False, linger=0)
            return all(col.replies.get(f"r{i}") for i in range(2))

        assert wait_for(streamed, timeout=30)
        (pid,) = node.worker_pids()
        os.kill(pid, signal.SIGKILL)
        col.collect(timeout=90, linger=0.5)
        col.assert_exactly_one_final_each()
        for i in range(2):
            reply = col.final(f"r{i}")
            assert (reply["code"], reply["reason"]) == (503, "worker_lost")
            assert reply["text"]  # what the client had seen, whole
        for i in range(2, SLOTS):
            reply = col.final(f"r{i}")
            assert reply["status"] == "ok" and reply["usage"]["completion_tokens"] == 96
        assert wait_for(lambda: credit(node) == [(SLOTS, SLOTS)], timeout=10)
        (process,) = node.status()["processes"]
        assert (process["restarts"], process["last_exit"]) == (1, "killed by SIGKILL")
    finally:
        col.close()


def test_credit_balances_after_mixed_real_requests(make_node: NodeFactory) -> None:
    """Cancels, expiring deadlines and json_schema requests on one four-slot worker."""
    node = slots_node(make_node)
    rng = random.Random(4)
    col = Collector(node.frontend)
    kinds: dict[str, str] = {}
    try:
        for i in range(40):
            rid, kind = f"r{i}", rng.choice(["plain", "cancel", "deadline", "schema"])
            kinds[rid] = kind
            body = {"id": rid, "op": "generate", "prompt": f"Note {i}: the sensor", "max_tokens": 8}
            if kind == "deadline":
                body |= {"max_tokens": 64, "timeout_ms": 700}
            elif kind == "schema":
                body |= {
                    "prompt": "Turn on the kitchen lights. JSON:",
                    "json_schema": INTENT_SCHEMA,
                }
            elif kind == "cancel":
                body |= {"max_tokens": 64}
            col.send(**body)
            if kind == "cancel":
                col.collect(timeout=rng.uniform(0.05, 0.6), until_all_final=False, linger=0)
                col.send(id=f"c{i}", op="cancel", target=rid)
        col.collect(timeout=120, linger=0.5)
        col.assert_exactly_one_final_each()
        codes = {rid: col.final(rid).get("code", 200) for rid in kinds}
        bad = {
            r: col.final(r)
            for r, k in kinds.items()
            if k in ("plain", "schema") and codes[r] != 200
        }
        assert not bad, bad
        assert all(codes[r] in (200, 499, 503) for r, k in kinds.items() if k == "cancel")
        assert all(codes[r] in (200, 503, 504) for r, k in kinds.items() if k == "deadline")
        assert any(codes[r] == 499 for r, k in kinds.items() if k == "cancel")
        assert wait_for(lambda: credit(node) == [(SLOTS, SLOTS)], timeout=10)
        (process,) = node.status()["processes"]
        assert process["restarts"] == 0
    finally:
        col.close()


def test_an_ambiguous_pattern_gets_413_and_its_neighbours_stream_on(
    make_node: NodeFactory,
) -> None:
    """A pattern whose grammar is too costly to follow beside three plain streams on
    one four-slot worker: ``([a-z ]{0,16}){0,16}`` took minutes per token, the worker
    was killed as stalled and the three streams got 503 worker_lost (second break-it
    pass, 2026-12-07; that one is now refused before it runs). Now the schema request
    alone ends, with 413, and the worker keeps running."""
    node = slots_node(make_node)
    col = Collector(node.frontend)
    try:
        for i in range(SLOTS - 1):
            col.send(id=f"p{i}", op="generate", prompt=f"Story number {i}:", max_tokens=48,
                     temperature=0.0, stream=True)  # fmt: skip
        col.send(id="costly", op="generate", prompt="Write a sentence in JSON:", max_tokens=64,
                 temperature=0.0, json_schema={"type": "string",
                                               "pattern": "^([a-z ]{1,16}){0,16}$"})  # fmt: skip
        col.collect(timeout=120, linger=0.5)
        col.assert_exactly_one_final_each()
        costly = col.final("costly")
        assert costly["code"] == 413, costly
        assert "too costly to follow" in costly["message"]
        for i in range(SLOTS - 1):
            reply = col.final(f"p{i}")
            assert reply["status"] == "ok" and reply["usage"]["completion_tokens"] == 48, reply
        assert wait_for(lambda: credit(node) == [(SLOTS, SLOTS)], timeout=10)
        (process,) = node.status()["processes"]
        assert process["restarts"] == 0
    finally:
        col.close()
