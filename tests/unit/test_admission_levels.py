"""Admission on multi-slot workers: a request is predicted at the batch level it
would run at, with a fake clock and hand-driven workers.

A worker with S slots decodes its running requests together, each the slower
the more there are (``broker.service_model.batch_cost``). Predicting every request at
its speed alone admitted requests that could only meet their deadline on an
idle worker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from broker.protocol import WorkerCommand
from broker.service_model import batch_cost
from brokerkit import FAST, W1, BrokerHarness, bodies, generate

REQUEST = WorkerCommand.REQUEST

#: 100 prompt tokens (one per byte, plus BOS: ``byte_bound``), 16 generated.
PROMPT = "w" * 99
MAX_TOKENS = 16
#: What the warm-up teaches, alone: 2 ms per prompt token, 20 ms per token.
PREFILL_S = 0.2
DECODE_S = 0.02
ALONE_S = PREFILL_S + MAX_TOKENS * DECODE_S  # 0.52 s

QUIET = replace(FAST, max_queue=32, heartbeat_interval_ms=600_000, stall_timeout_ms=600_000)


def usage() -> dict[str, int]:
    return {"prompt_tokens": 100, "completion_tokens": MAX_TOKENS}


def at_level(level: int) -> float:
    """The predicted service (s) of a warm-up-sized request at ``level``: prefill as
    measured alone, decode scaled by ``batch_cost``."""
    return PREFILL_S + MAX_TOKENS * DECODE_S * batch_cost(level)


def warmed(slots: int) -> BrokerHarness:
    """One worker of ``slots`` slots that has served one request alone at the rates
    above (dispatch at 0, first token at 0.22 s, FINAL at 0.52 s)."""
    h = BrokerHarness(QUIET)
    h.ready(W1, 0.0, slots=slots)
    h.send(generate("warm", PROMPT, max_tokens=MAX_TOKENS), 0.0)
    [sent] = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, sent["rid"], "tok", PREFILL_S + DECODE_S)
    h.final(W1, sent["rid"], ALONE_S, usage=usage())
    h.drain_replies()
    assert h.broker.estimator.sizes.decode_by_level("llm") == {"1": 20.0}
    return h


def start(h: BrokerHarness, ids: list[str], now: float) -> None:
    """Send ``ids`` (warm-up-sized, no deadline to speak of): they run at once."""
    for rid in ids:
        h.send(generate(rid, PROMPT, max_tokens=MAX_TOKENS), now)
    assert len(bodies(h.drain_workers(), W1, REQUEST)) == len(ids)


def refusal(h: BrokerHarness, rid: str) -> dict[str, Any]:
    [reply] = [r for r in h.replies() if r["id"] == rid]
    assert (reply["status"], reply["code"], reply["reason"]) == (
        "error",
        503,
        "deadline_unmeetable",
    )
    return reply


def test_a_request_that_fits_alone_is_refused_beside_three_others() -> None:
    """0.52 s alone fits an 800 ms budget; beside three others it runs at level 4
    (0.2 + 16 x 20 ms x 2.81 = 1.10 s) and cannot. Retrying helps, once the three
    finish (at level 3, 0.97 s after they started): the advice says when."""
    assert ALONE_S < 0.8 < at_level(4)
    h = warmed(slots=4)
    h.send(generate("idle", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=800), 1.0)
    assert h.replies() == []  # on an idle worker: admitted
    h.final(W1, bodies(h.drain_workers(), W1, REQUEST)[0]["rid"], 1.52, usage=usage())
    h.drain_replies()

    start(h, ["a", "b", "c"], 2.0)
    h.send(generate("busy", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=800), 2.0)
    reply = refusal(h, "busy")
    assert reply["message"] == (
        f"expected wait 0 ms + service {at_level(4) * 1000:.0f} ms at batch level 4"
        " exceeds the 800 ms budget"
    )
    assert reply["retry_after_ms"] == pytest.approx(at_level(3) * 1000, abs=1)
    assert h.broker.stats.counters["shed_deadline_unmeetable"] == 1


def test_a_budget_that_holds_level_four_is_admitted_beside_three_others() -> None:
    h = warmed(slots=4)
    start(h, ["a", "b", "c"], 1.0)
    h.send(generate("roomy", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=1200), 1.0)
    assert h.replies() == []
    assert len(bodies(h.drain_workers(), W1, REQUEST)) == 1


def test_the_queue_played_onto_a_full_worker_runs_at_its_slot_count() -> None:
    """A 2-slot worker runs a (since 1.0 s) and b (since 1.1 s), c waits. Each runs
    at level 2 (0.84 s): a frees its slot 0.64 s from now, c takes it beside b,
    b's slot frees at 0.74 s and the new request starts there beside c, at level 2:
    0.74 + 0.84 s > 1.5 s. Alone (0.52 s) it would have fitted."""
    h = warmed(slots=2)
    start(h, ["a"], 1.0)
    start(h, ["b"], 1.1)
    h.send(generate("c", PROMPT, max_tokens=MAX_TOKENS), 1.2)
    assert h.drain_workers() == []  # no credit: queued
    h.send(generate("late", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=1500), 1.2)
    reply = refusal(h, "late")
    assert at_level(2) == pytest.approx(0.84)
    assert reply["message"] == (
        "expected wait 740 ms + service 840 ms at batch level 2 exceeds the 1500 ms budget"
    )
    assert reply["retry_after_ms"] == 740  # level 2 fits the budget: the next free slot


def test_single_slot_workers_predict_every_request_alone() -> None:
    """slots = 1: a request only ever starts on an idle worker, so the level is 1
    and the message and advice are as before the levels (``test_admission_sized``
    holds the rest of the one-slot behaviour)."""
    h = warmed(slots=1)
    start(h, ["a"], 1.0)  # runs alone until 1.52 s
    h.send(generate("late", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=1000), 1.0)
    reply = refusal(h, "late")
    assert reply["message"] == "expected wait 520 ms + service 520 ms exceeds the 1000 ms budget"
    assert reply["retry_after_ms"] == 520
