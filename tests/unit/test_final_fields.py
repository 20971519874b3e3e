"""A worker's FINAL reaches the client only with the field types PROTOCOL §4.2
promises: a custom worker that sends ``finish_reason: 12`` or a ``usage`` of
strings must not break the reply a C app decodes (§13.3 says what workers send).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from broker.protocol import WorkerCommand
from brokerkit import RULES, W1, BrokerHarness, generate

GOOD_USAGE = {"prompt_tokens": 4, "completion_tokens": 2}


def ask(h: BrokerHarness, identity: bytes = W1, **request: Any) -> int:
    """Register ``identity`` if needed, send one request to it; returns the worker's rid."""
    if h.broker.workers.get(identity) is None:
        engine = "rules" if identity == RULES else "llm"
        h.ready(identity, 0.0, engine=engine, worker_id=identity.decode())
    h.send(generate("r1", **request), 0.1)
    (req,) = h.requests(identity)
    rid = req["rid"]
    assert isinstance(rid, int)
    return rid


def final_of(h: BrokerHarness, rid: int, identity: bytes = W1, **fields: Any) -> dict[str, Any]:
    """Send a FINAL with exactly ``fields`` (besides rid) and return the client's reply."""
    h.worker_send(identity, WorkerCommand.FINAL, {"rid": rid, **fields}, 0.2)
    (reply,) = [r for r in h.replies() if r["status"] != "partial"]
    h.assert_each_answered_once()
    return reply


def test_a_well_typed_final_is_relayed_unchanged(h: BrokerHarness) -> None:
    rid = ask(h)
    reply = final_of(h, rid, status="ok", text="hi", finish_reason="length", usage=GOOD_USAGE)
    assert (reply["text"], reply["finish_reason"], reply["usage"]) == ("hi", "length", GOOD_USAGE)
    assert "confidence" not in reply and "rule" not in reply


def test_the_broken_final_of_the_break_it_session(h: BrokerHarness) -> None:
    rid = ask(h, stream=True)
    h.partial(W1, rid, "echo:", 0.15)
    reply = final_of(
        h, rid, status="ok", finish_reason=12, usage={"prompt_tokens": "NaN"}, text=b"raw"
    )
    assert reply["finish_reason"] == "stop"  # the documented default
    assert reply["usage"] == {}  # "may be an empty map if the worker reports none"
    assert reply["text"] == "echo:"  # not a str: the streamed text stands in


@pytest.mark.parametrize(
    "usage",
    [
        {"prompt_tokens": -1, "completion_tokens": 2},
        {"prompt_tokens": True, "completion_tokens": 2},
        {"prompt_tokens": 4.0, "completion_tokens": 2},
        {"prompt_tokens": 2**64 - 1, "completion_tokens": 2},
        {"prompt_tokens": None, "completion_tokens": 2},
        {"prompt_tokens": [4], "completion_tokens": 2, "total_tokens": 6, "cost": "free"},
    ],
)
def test_usage_keeps_only_the_documented_counts_that_are_counts(
    h: BrokerHarness, usage: dict[str, Any]
) -> None:
    rid = ask(h)
    reply = final_of(h, rid, status="ok", text="x", usage=usage)
    assert reply["usage"] == {"completion_tokens": 2}


def test_usage_keeps_the_prompt_tokens_a_slot_reused(h: BrokerHarness) -> None:
    rid = ask(h)
    usage = {"prompt_tokens": 300, "completion_tokens": 2, "cached_tokens": 299}
    assert final_of(h, rid, status="ok", text="x", usage=usage)["usage"] == usage


@pytest.mark.parametrize("usage", [[1, 2], "4/2", 7, None])
def test_usage_that_is_not_a_map_becomes_empty(h: BrokerHarness, usage: Any) -> None:
    rid = ask(h)
    assert final_of(h, rid, status="ok", text="x", usage=usage)["usage"] == {}


@pytest.mark.parametrize("reason", ["", "eos", "STOP", "x" * 100, None, True, ["stop"]])
def test_finish_reason_outside_the_documented_set_becomes_stop(
    h: BrokerHarness, reason: Any
) -> None:
    rid = ask(h)
    assert final_of(h, rid, status="ok", text="x", finish_reason=reason)["finish_reason"] == "stop"


def test_rule_fields_are_kept_well_typed_and_only_from_the_rule_engine(h: BrokerHarness) -> None:
    rid = ask(h, RULES, route="rules")
    reply = final_of(h, rid, RULES, status="ok", text="{}", confidence=0.9, rule="lights_on")
    assert (reply["confidence"], reply["rule"], reply["served_by"]) == (0.9, "lights_on", "rules")

    h2 = BrokerHarness()
    rid = ask(h2, RULES, route="rules")
    reply = final_of(h2, rid, RULES, status="ok", text="no rule matched", confidence=0, rule=None)
    assert reply["confidence"] == 0.0 and isinstance(reply["confidence"], float)
    assert reply["rule"] is None

    h3 = BrokerHarness()
    rid = ask(h3)  # a model worker has no business sending them
    reply = final_of(h3, rid, status="ok", text="x", confidence=0.5, rule="r")
    assert "confidence" not in reply and "rule" not in reply


@pytest.mark.parametrize(
    ("confidence", "expected"),
    [(math.nan, 0.0), ("0.9", 0.0), (True, 0.0), (None, 0.0), (1.5, 1.0), (-0.1, 0.0), (1, 1.0)],
)
def test_confidence_is_a_float_in_0_to_1(
    h: BrokerHarness, confidence: Any, expected: float
) -> None:
    # Out of range is clamped rather than zeroed: the latency hedge (broker.routing)
    # counts any confidence > 0 as a match, and the reply must not contradict it.
    rid = ask(h, RULES, route="rules")
    reply = final_of(h, rid, RULES, status="ok", text="t", confidence=confidence, rule="r")
    assert reply["confidence"] == expected and isinstance(reply["confidence"], float)


@pytest.mark.parametrize("rule", [5, ["r"], b"r", {"name": "r"}, 7.5])
def test_a_rule_name_that_is_not_a_str_becomes_nil(h: BrokerHarness, rule: Any) -> None:
    rid = ask(h, RULES, route="rules")
    reply = final_of(h, rid, RULES, status="ok", text="t", confidence=0.5, rule=rule)
    assert reply["rule"] is None and reply["confidence"] == 0.5


def test_a_rule_worker_that_omits_them_gets_the_no_match_values(h: BrokerHarness) -> None:
    rid = ask(h, RULES, route="rules")
    reply = final_of(h, rid, RULES, status="ok", text="t")
    assert reply["confidence"] == 0.0 and reply["rule"] is None


@pytest.mark.parametrize("message", [None, 42, {"why": "x"}, ""])
def test_an_error_final_without_a_str_message_gets_a_generic_one(
    h: BrokerHarness, message: Any
) -> None:
    rid = ask(h)
    reply = final_of(h, rid, status="error", code=True, message=message, text=7)
    assert reply["code"] == 500
    assert reply["message"] == "worker reported an error"
    assert "text" not in reply
