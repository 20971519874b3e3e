"""The per-request service model: what finished requests teach, what it predicts."""

from __future__ import annotations

import pytest

from broker.batch_levels import BatchLevels
from broker.client_request import ClientRequest
from broker.errors import ConfigError
from broker.records import BrokerSettings
from broker.service_model import Ratio, ServiceModel, batch_cost, level_key
from broker.service_time import ServiceEstimator
from broker.token_count import byte_bound
from brokerkit import W1, W2, BrokerHarness, generate
from node.cli.status_view import render_status

#: A worker identity for ``BatchLevels``.
W = b"w"


def req(prompt: str, max_tokens: int | None = None) -> ClientRequest:
    return ClientRequest(id=1, op="generate", prompt=prompt, max_tokens=max_tokens)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion}


def test_nothing_is_predicted_before_a_measured_request() -> None:
    model = ServiceModel()
    assert not model.ready("llm")
    assert model.prompt_tokens("llm", req("hello")) is None
    assert model.snapshot("llm") is None


def test_prefill_and_decode_are_split_at_the_first_token() -> None:
    model = ServiceModel()
    # 100 prompt tokens at 2 ms, then 5 tokens at 20 ms: the first token
    # arrives after the prefill and one decode step (0.2 + 0.02 s).
    assert model.observe("llm", req("w" * 399), 8, 0.22, 0.30, usage(100, 5))
    snap = model.snapshot("llm")
    assert snap == {
        "prefill_ms_per_token": 2.0,
        "decode_ms_per_token": 20.0,
        "tokens_per_byte": 0.25,  # 100 tokens over byte_bound 400
        "completion_share": 0.625,  # 5 of 8 allowed
    }
    # 800 bytes -> ~200 tokens; 16 allowed x 0.625 = 10 expected tokens.
    tokens = model.prompt_tokens("llm", req("w" * 799))
    assert tokens == pytest.approx(200)
    assert model.predict_s("llm", 200, 16) == pytest.approx(0.4 + 0.2)


def test_long_prompts_weigh_more_than_short_ones() -> None:
    """Ratio of sums: a short prompt's fixed overhead barely moves the rate
    learned from a long one (a mean of the two per-request rates would be 1.25 ms).
    The short one is within the outlier factor (2x), so it is learned at once."""
    model = ServiceModel()
    model.observe("llm", req("w" * 999), 1, 1.0, 1.0, usage(1000, 1))  # 1 ms/token
    model.observe("llm", req("w" * 39), 1, 0.06, 0.06, usage(40, 1))  # 1.5 ms/token, overhead
    snap = model.snapshot("llm")
    # (0.8 x 1.0 + 0.06) s / (0.8 x 1000 + 40) tokens
    assert snap is not None and snap["prefill_ms_per_token"] == pytest.approx(1.024, abs=1e-3)


def test_tiny_prompts_and_schema_requests_teach_no_rates() -> None:
    """Break-it finding: a 3-token warm-up taught 44 ms/token of prefill (its fixed
    overhead), so a 1700-token prompt the model evaluates in 15 s was refused as
    needing 85 s; json_schema requests taught a decode rate 5x the plain one."""
    model = ServiceModel()
    schema = ClientRequest(id=2, op="generate", prompt="w" * 99, json_schema={"type": "object"})
    assert not model.observe("llm", schema, 8, 0.5, 4.0, usage(100, 8))
    assert not model.ready("llm")
    model.observe("llm", req("warm up"), 4, 0.15, 0.2, usage(3, 2))
    snap = model.snapshot("llm")  # a decode rate, no prefill rate: prefill counts 0
    assert snap is not None and snap["decode_ms_per_token"] == pytest.approx(50.0)
    assert snap["prefill_ms_per_token"] == 0.0
    model.observe("llm", req("w" * 399), 8, 0.82, 1.5, usage(100, 8))
    snap = model.snapshot("llm")
    # Decode: (0.8 x 0.05 + 0.68) s / (0.8 x 1 + 7) tokens = 92.3 ms; prefill from
    # the long prompt alone: (0.82 - 0.0923) s / 100 tokens (with the warm-up: 7.89).
    assert snap is not None and snap["decode_ms_per_token"] == pytest.approx(92.308, abs=1e-2)
    assert snap["prefill_ms_per_token"] == pytest.approx(7.277, abs=1e-2)


def test_samples_without_size_teach_nothing() -> None:
    model = ServiceModel()
    # The rule engine reports zero tokens; a worker may omit usage.
    assert not model.observe("rules", req("hi"), 16, 0.001, 0.001, usage(0, 0))
    assert not model.observe("llm", req("hi"), 16, 0.1, 0.2, None)
    assert not model.observe("llm", req("hi"), 16, 0.1, 0.2, {"prompt_tokens": True})
    assert not model.ready("rules") and not model.ready("llm")


def test_engines_are_kept_apart() -> None:
    model = ServiceModel()
    model.observe("llm", req("w" * 99), 4, 0.5, 0.8, usage(100, 4))
    assert model.ready("llm") and not model.ready("rules")


def test_a_one_token_answer_leaves_decode_unmeasured() -> None:
    model = ServiceModel()
    model.observe("llm", req("w" * 99), 1, 0.2, 0.2, usage(100, 1))
    snap = model.snapshot("llm")
    assert snap is not None and snap["decode_ms_per_token"] == 0.0
    assert snap["prefill_ms_per_token"] == 2.0  # includes its one decode step


def test_ratio_is_one_of_decaying_sums() -> None:
    ratio = Ratio()
    assert ratio.value == 0.0
    ratio.add(10.0, 5.0)
    ratio.add(0.0, 5.0)  # (0.8 x 10 + 0) / (0.8 x 5 + 5)
    assert (ratio.value, ratio.samples) == (pytest.approx(8 / 9), 2)
    for _ in range(30):  # old samples fade: the ratio follows the new ones
        ratio.add(3.0, 1.0)
    assert ratio.value == pytest.approx(3.0, rel=0.01)


def test_byte_bound_counts_chat_template_tokens() -> None:
    chat = ClientRequest(id=1, op="chat", messages=(("user", "héllo"), ("user", "x")))
    assert byte_bound(chat) == 6 + 1 + 1 + 2 * 6


def test_unknown_service_estimate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="service_estimate"):
        BrokerSettings(service_estimate="median")


def test_status_shows_each_kinds_mean_and_learned_rates() -> None:
    stats = ServiceEstimator()
    assert stats.snapshot() == {}  # nothing served: nothing claimed
    stats.observe_service(0.30)
    stats.observe_service(0.001, "rules")
    stats.sizes.observe("llm", req("w" * 399), 8, 0.22, 0.30, usage(100, 5))
    snap = stats.snapshot()
    assert snap["rules"] == {"mean_ms": 1.0, "samples": 1}  # no token rates for rules
    assert snap["llm"]["mean_ms"] == 300.0 and snap["llm"]["samples"] == 1
    assert (snap["llm"]["prefill_ms_per_token"], snap["llm"]["decode_ms_per_token"]) == (2.0, 20.0)
    line = render_status({**BARE_STATUS, "service": snap}).splitlines()[-1]
    assert line == (
        "service: llm mean 300 ms (1 served; prefill 2 ms/token, decode 20 ms/token),"
        " rules mean 1 ms (1 served)"
    )


#: The least ``render_status`` reads.
BARE_STATUS = {"queue_depth": 0, "queue_bound": 1, "in_flight": 0, "credit": 1}


# ---------------------------------------------------------------- batch levels


def test_batch_cost_follows_the_measured_gain() -> None:
    """Per-sequence time per token at b sequences, alone = 1: issue 10 measured the
    aggregate at 4 sequences 1.3-1.55x one sequence's (per sequence 2.6-3x) and at
    8 1.7-1.9x (4.2-4.7x); none at 2."""
    assert batch_cost(1) == 1.0
    assert batch_cost(2) == pytest.approx(2.0)
    assert 2.6 <= batch_cost(4) <= 3.0
    assert 4.2 <= batch_cost(8) <= 4.7
    assert batch_cost(32) == pytest.approx(32 / 2.25)  # no gain assumed beyond 16
    costs = [batch_cost(b) for b in range(1, 65)]
    assert costs == sorted(costs)  # more neighbours never make a sequence faster
    assert level_key(2.5) == 3 and level_key(2.49) == 2 and level_key(0.0) == 1


def test_rates_are_learned_per_batch_level() -> None:
    model = ServiceModel()
    # Alone: 2 ms/token of prefill, 20 ms/token of decode.
    model.observe("llm", req("w" * 99), 8, 0.22, 0.36, usage(100, 8))
    # Beside three others: the same request decodes at 60 ms/token and prefills at 3.
    model.observe("llm", req("w" * 99), 8, 0.36, 0.78, usage(100, 8), 4.0, 4.0)
    assert model.decode_by_level("llm") == {"1": 20.0, "4": 60.0}
    assert model.predict_s("llm", 100, 8) == pytest.approx(0.2 + 8 * 0.02)
    assert model.predict_s("llm", 100, 8, level=4) == pytest.approx(0.3 + 8 * 0.06)
    assert model.first_token_s("llm", 100, level=4) == pytest.approx(0.3 + 0.06)
    # The level-1 table is untouched by the level-4 sample: a one-slot pool's rates.
    snap = model.snapshot("llm")
    assert snap is not None
    assert (snap["prefill_ms_per_token"], snap["decode_ms_per_token"]) == (2.0, 20.0)


def test_an_unseen_level_is_predicted_from_the_nearest_measured_one() -> None:
    model = ServiceModel()
    model.observe("llm", req("w" * 99), 8, 0.22, 0.36, usage(100, 8))  # level 1
    # Decode scales by batch_cost; prefill is taken as measured.
    assert model.predict_s("llm", 100, 8, level=4) == pytest.approx(0.2 + 8 * 0.02 * batch_cost(4))
    # Level 8 measured at 100 ms/token: level 4 is nearer to 8 than to 1 (in ratio,
    # a tie goes to the higher level) and is scaled down from it; 2 is nearer to 1.
    model.observe("llm", req("w" * 99), 8, 0.5, 1.2, usage(100, 8), 8.0, 8.0)
    rates = model.decode_by_level("llm")
    assert rates == {"1": 20.0, "8": 100.0}
    # Level 8's prefill: (0.5 s - one 100 ms step) / 100 tokens, borrowed as it is.
    prefill_at_4 = model.predict_s("llm", 100, 8, level=4) - model.predict_s("llm", 0, 8, level=4)
    assert prefill_at_4 == pytest.approx(0.4)
    assert model.first_token_s("llm", 0, level=4) == pytest.approx(
        0.1 * batch_cost(4) / batch_cost(8)
    )
    assert model.first_token_s("llm", 0, level=2) == pytest.approx(0.02 * batch_cost(2))


def test_a_fractional_level_is_learned_at_the_nearest_integer() -> None:
    model = ServiceModel()
    model.observe("llm", req("w" * 99), 8, 0.22, 0.36, usage(100, 8), 1.4, 2.6)
    assert model.decode_by_level("llm") == {"3": 20.0}
    # Prefill was learned at level 1, less its first decode step predicted at
    # level 1 from level 3's rate.
    prefill = model.first_token_s("llm", 100, level=1) - model.first_token_s("llm", 0, level=1)
    assert prefill == pytest.approx(0.22 - 0.02 * batch_cost(1) / batch_cost(3))


def test_batch_level_is_the_time_weighted_count_over_each_phase() -> None:
    """Request 1 prefills alone (0-0.5 s), decodes alone to 1 s and beside request 2
    to 3 s: its decode level is (0.5 x 1 + 2 x 2) / 2.5 = 1.8, where the mean of
    the counts at dispatch and at FINAL would say 1.5."""
    levels = BatchLevels()
    levels.running(W, {1}, 0.0)
    levels.first_token(W, 1, 0.5)
    levels.running(W, {1, 2}, 1.0)
    levels.first_token(W, 2, 1.0)  # a first token at dispatch: a phase of no length
    assert levels.levels(W, 1, 3.0) == pytest.approx((1.0, 1.8))
    levels.running(W, {2}, 3.0)
    # Its decode: 2 s beside request 1, then 1 s alone.
    assert levels.levels(W, 2, 4.0) == pytest.approx((2.0, 5 / 3))
    assert levels.levels(W, 1, 4.0) == (1.0, 1.0)  # finished: forgotten
    levels.running(W, (), 4.0)  # the worker was lost
    assert levels.levels(W, 2, 5.0) == (1.0, 1.0)


def test_status_shows_rates_by_level_only_once_a_level_above_one_was_measured() -> None:
    stats = ServiceEstimator()
    stats.observe_service(0.36)
    stats.sizes.observe("llm", req("w" * 99), 8, 0.22, 0.36, usage(100, 8))
    assert "decode_ms_per_token_by_level" not in stats.snapshot()["llm"]
    stats.sizes.observe("llm", req("w" * 99), 8, 0.36, 0.78, usage(100, 8), 4.0, 4.0)
    by_level = stats.snapshot()["llm"]["decode_ms_per_token_by_level"]
    assert by_level == {"1": 20.0, "4": 60.0}


def test_a_multi_slot_worker_teaches_its_level_and_single_slot_workers_level_one() -> None:
    """Levels are per worker, not per pool: two one-slot workers busy at once each
    run at level 1, as a one-slot pool always did; four requests on one 4-slot
    worker run at level 4."""
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.ready(W2, 0.0)
    run_together(h, ["a", "b"], 0.0)
    assert h.broker.estimator.sizes.decode_by_level("llm") == {"1": 20.0}
    h = BrokerHarness()
    h.ready(W1, 0.0, slots=4)
    run_together(h, ["a", "b", "c", "d"], 0.0)
    assert h.broker.estimator.sizes.decode_by_level("llm") == {"4": 20.0}
    h.assert_each_answered_once()


def run_together(h: BrokerHarness, ids: list[str], now: float) -> None:
    """Send ``ids`` at once; each gets its first token after 0.22 s and its FINAL
    (8 tokens of a 100-token prompt) after 0.36 s."""
    for rid in ids:
        h.send(generate(rid, "w" * 99, max_tokens=8), now)
    sent = [(m.identity, m.body["rid"]) for m in h.drain_workers()]
    assert len(sent) == len(ids)
    for identity, rid in sent:
        h.partial(identity, rid, "tok", now + 0.22)
    for identity, rid in sent:
        h.final(identity, rid, now + 0.36, usage=usage(100, 8))


def test_prompt_tokens_a_slot_reused_teach_no_prefill_rate() -> None:
    model = ServiceModel()
    # 400 prompt tokens of which 360 were in the slot's KV cache: the 0.2 s
    # before the first token evaluated 40 of them (and one 20 ms decode step).
    reused = usage(400, 5) | {"cached_tokens": 360}
    assert model.observe("llm", req("w" * 1599), 8, 0.22, 0.30, reused)
    snap = model.snapshot("llm")
    assert snap is not None and snap["prefill_ms_per_token"] == pytest.approx(5.0)
    # Reusing all but a few tokens leaves too few evaluated to teach prefill.
    other = ServiceModel()
    other.observe("llm", req("w" * 1599), 8, 0.22, 0.30, usage(400, 5) | {"cached_tokens": 399})
    snap = other.snapshot("llm")  # its decode rate is learned; prefill counts 0
    assert snap is not None and snap["prefill_ms_per_token"] == 0.0
