"""A pause inside a request must not become the learned service rate, and an
estimate that refuses requests must still be tested: a fake clock, the real
broker core, simulated workers.

The defect (break2 report): the broker SIGSTOPped 4 s while two 8-token chats
ran; their time, pause included, became the decode rate (22.6 -> 304 ms/token),
and from then on every ``timeout_ms=300`` chat was refused with 503
``deadline_unmeetable`` on an idle node, for good: refused requests teach the
estimate nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from broker.admission import PROBE_AFTER_S
from broker.client_request import ClientRequest
from broker.protocol import WorkerCommand
from broker.service_model import OUTLIER_FACTOR, OUTLIER_STREAK, ServiceModel
from brokerkit import FAST, W1, W2, BrokerHarness, generate

#: Heartbeats and stall checks out of the way: the simulated workers send none.
QUIET = replace(FAST, max_queue=32, heartbeat_interval_ms=600_000, stall_timeout_ms=600_000)

PROMPT = "p" * 40  # reported as 40 prompt tokens: enough to teach a prefill rate
PROMPT_TOKENS = 40
MAX_TOKENS = 8
PREFILL_S = 0.002  # per prompt token
DECODE_S = 0.020  # per generated token: 0.08 + 8 x 0.02 = 0.24 s per request


def node() -> BrokerHarness:
    """A broker with two one-slot model workers."""
    h = BrokerHarness(QUIET)
    for w in (W1, W2):
        h.ready(w, 0.0)
    h.drain_workers()
    return h


def dispatched(h: BrokerHarness) -> list[tuple[bytes, int]]:
    """The (worker, rid) of each REQUEST the broker sent since the last drain."""
    return [
        (m.identity, m.body["rid"]) for m in h.drain_workers() if m.command is WorkerCommand.REQUEST
    ]


def serve(
    h: BrokerHarness,
    worker: bytes,
    rid: int,
    start: float,
    decode_s: float = DECODE_S,
    pause: float = 0.0,
) -> float:
    """The worker answers ``rid`` dispatched at ``start``: its first token after the
    prefill and one step, the FINAL after the other steps; the broker sees both
    ``pause`` s late (it was stopped). Returns when the FINAL was seen."""
    first = start + PREFILL_S * PROMPT_TOKENS + decode_s
    h.partial(worker, rid, "tok", first)
    end = first + decode_s * (MAX_TOKENS - 1) + pause
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS}
    h.final(worker, rid, end, usage=usage)
    return end


def one(
    h: BrokerHarness, rid: str, now: float, decode_s: float = DECODE_S, **fields: Any
) -> dict[str, Any]:
    """Send one request at ``now``, serve it if dispatched; its final reply."""
    h.send(generate(rid, PROMPT, max_tokens=MAX_TOKENS, **fields), now)
    for worker, wrid in dispatched(h):
        serve(h, worker, wrid, now, decode_s)
    finals = [b for b in h.replies() if b["id"] == rid and b["status"] != "partial"]
    assert len(finals) == 1, finals
    return finals[0]


def outcome(body: dict[str, Any]) -> str:
    return "ok" if body["status"] == "ok" else f"{body['code']} {body.get('reason')}"


def decode_ms(h: BrokerHarness) -> float:
    snap = h.broker.estimator.snapshot()["llm"]
    value = snap["decode_ms_per_token"]
    assert isinstance(value, float)
    return value


def warm(h: BrokerHarness, count: int = 4) -> float:
    """``count`` ordinary requests one after another; returns the clock after them."""
    now = 0.0
    for i in range(count):
        assert outcome(one(h, f"warm-{i}", now)) == "ok"
        now += 0.5
    return now


def test_a_broker_pause_inside_two_requests_is_not_learned_as_service() -> None:
    h = node()
    now = warm(h)
    before = decode_ms(h)
    assert before == pytest.approx(20.0, rel=0.01)
    # Two chats run; the broker is stopped 4 s before it sees their last tokens.
    for i in (1, 2):
        h.send(generate(f"paused-{i}", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=20_000), now)
    for worker, rid in dispatched(h):
        end = serve(h, worker, rid, now, pause=4.0)
    assert [outcome(b) for b in h.replies() if b["status"] != "partial"] == ["ok", "ok"]
    assert decode_ms(h) == pytest.approx(before, rel=0.01)
    # Straight after (no probe yet: a request just finished), a 300 ms chat fits.
    assert outcome(one(h, "short", end + 0.5, timeout_ms=300)) == "ok"


def test_a_worker_pause_in_both_slots_counts_as_one_event() -> None:
    """Four requests stalled together (two per worker, one after the other while
    overlapping the same pause) are one pause, not a change of speed."""
    model = ServiceModel()
    req = ClientRequest(id="x", op="generate", prompt=PROMPT, max_tokens=MAX_TOKENS)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS}
    for i in range(4):
        assert model.observe("llm", req, MAX_TOKENS, 0.1, 0.24, usage, started=i * 0.3)
    base = model.snapshot("llm")
    assert base is not None
    for start in (10.0, 10.0, 10.01, 10.02):  # overlapping: one stall of 2 s
        model.observe("llm", req, MAX_TOKENS, 0.1, 2.24, usage, started=start)
    assert model.snapshot("llm") == base


def test_a_lasting_slowdown_is_learned_after_a_streak_of_requests_in_a_row() -> None:
    model = ServiceModel()
    req = ClientRequest(id="x", op="generate", prompt=PROMPT, max_tokens=MAX_TOKENS)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS}
    for i in range(4):
        model.observe("llm", req, MAX_TOKENS, 0.1, 0.24, usage, started=i * 0.3)
    slow = 0.02 * (OUTLIER_FACTOR + 1)  # s per token, beyond the factor
    start = 10.0
    for n in range(1, OUTLIER_STREAK + 1):
        total = 0.1 + slow * (MAX_TOKENS - 1)
        model.observe("llm", req, MAX_TOKENS, 0.1, total, usage, started=start)
        start += total + 0.01  # the next one starts after this one finished
        decode = model.decode_by_level("llm")["1"]
        if n < OUTLIER_STREAK:
            assert decode == pytest.approx(20.0, rel=0.01)  # held back
    assert decode > 2 * 20.0  # the streak proves it: learned


def test_a_slower_sample_inside_the_factor_is_learned_at_once() -> None:
    model = ServiceModel()
    req = ClientRequest(id="x", op="generate", prompt=PROMPT, max_tokens=MAX_TOKENS)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS}
    model.observe("llm", req, MAX_TOKENS, 0.1, 0.24, usage, started=0.0)
    model.observe("llm", req, MAX_TOKENS, 0.1, 0.1 + 0.03 * 7, usage, started=1.0)
    assert model.decode_by_level("llm")["1"] > 20.0


def slowed(h: BrokerHarness) -> float:
    """Warm at 20 ms/token, then a real slowdown to 200 ms/token for a streak of
    requests in a row (learned), after which the engine is fast again."""
    now = warm(h)
    for i in range(OUTLIER_STREAK + 1):
        body = one(h, f"slow-{i}", now, decode_s=0.2, timeout_ms=20_000)
        assert outcome(body) == "ok"
        now += 2.0
    assert decode_ms(h) > 5 * 20.0
    return now


def test_an_idle_pool_probes_an_estimate_that_refuses_and_relearns() -> None:
    h = node()
    now = slowed(h)
    last_final = now - 2.0 + 0.08 + 0.2 * MAX_TOKENS
    # The estimate refuses a 300 ms request at once: just tested (a request finished).
    first = one(h, "refused", last_final + 0.1, timeout_ms=300)
    assert outcome(first) == "503 deadline_unmeetable"
    # Every 0.5 s a 300 ms request; the engine is fast again: the probes teach it.
    results = []
    t = last_final + 0.5
    while t < last_final + 40:
        results.append(outcome(one(h, f"r{t:.1f}", t, timeout_ms=300)))
        t += 0.5
    # Refused until PROBE_AFTER_S after the last test; then one probe per
    # PROBE_AFTER_S while it still refuses, each teaching the fast rate ...
    last_refused = max(i for i, r in enumerate(results) if r != "ok")
    probes = [i for i, r in enumerate(results[:last_refused]) if r == "ok"]
    assert probes and probes[0] >= 1, results
    assert all(b - a >= PROBE_AFTER_S / 0.5 for a, b in itertools.pairwise(probes))
    # ... until every request is admitted again, not one per probe interval.
    assert results[-8:] == ["ok"] * 8, results
    assert decode_ms(h) < 2 * 20.0


def test_a_busy_pool_does_not_probe() -> None:
    """With no free slot the refusal stands: a probe must not wait in the queue."""
    h = node()
    now = slowed(h) + PROBE_AFTER_S + 1
    for i in (1, 2):  # both workers busy, unanswered
        h.send(generate(f"busy-{i}", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=20_000), now)
    assert len(dispatched(h)) == 2
    h.send(generate("hurry", PROMPT, max_tokens=MAX_TOKENS, timeout_ms=300), now + 0.1)
    (reply,) = [b for b in h.replies() if b["id"] == "hurry"]
    assert outcome(reply) == "503 deadline_unmeetable"


def test_a_much_faster_sample_is_learned_as_any_other() -> None:
    """Too low an estimate heals by itself: samples below are not held back."""
    model = ServiceModel()
    req = ClientRequest(id="x", op="generate", prompt=PROMPT, max_tokens=MAX_TOKENS)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": MAX_TOKENS}
    model.observe("llm", req, MAX_TOKENS, 0.1, 0.1 + 0.2 * 7, usage, started=0.0)
    model.observe("llm", req, MAX_TOKENS, 0.1, 0.1 + 0.01 * 7, usage, started=2.0)
    # (0.8 x 1.4 + 0.07) / (0.8 x 7 + 7) s per token: folded in, not held back.
    assert model.decode_by_level("llm")["1"] == pytest.approx(1190 / 12.6, rel=0.01)


def test_while_the_estimate_holds_an_idle_pool_probes_once_per_interval() -> None:
    """The engine is still slow: a probe holds its slot; the other slot, free, is
    not probed again before PROBE_AFTER_S."""
    h = node()
    now = slowed(h) + PROBE_AFTER_S
    admitted = []
    for k in range(8):  # every 0.5 s for 4 s; nothing is answered (slow engine)
        rid = f"p{k}"
        h.send(generate(rid, PROMPT, max_tokens=MAX_TOKENS, timeout_ms=300), now + 0.5 * k)
        if dispatched(h):
            admitted.append(k)
        refused = [b for b in h.replies() if b["id"] == rid and b["status"] == "error"]
        assert bool(refused) != (k in admitted)
    # One probe at once (untested for PROBE_AFTER_S), the next on the free slot only
    # PROBE_AFTER_S later; then no slot is free.
    assert admitted == [0, int(PROBE_AFTER_S / 0.5)]
