"""Flood beyond capacity with real sockets and processes (test engine).

Each request takes ~6 tokens x 10 ms on one of 2 workers: capacity ~30 req/s.
The test offers ~10x that for a bounded time and checks the gate's promises.
A burst of long prompts checks that admission weighs each request's size.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import msgpack
import psutil

from node.bench.stats import percentile
from node.testing import Collector, NodeProcess

NodeFactory = Callable[..., NodeProcess]

QUEUE_BOUND = 8
SLOTS = 2


def flood(node: NodeProcess, seconds: float, rate_per_s: float, tag: str) -> Collector:
    """Offer ``rate_per_s`` requests for ``seconds`` from one DEALER; return its replies."""
    col = Collector(node.frontend)
    sent_at: dict[str, float] = {}
    col.sent_at = sent_at  # type: ignore[attr-defined]
    col.received_at = {}  # type: ignore[attr-defined]
    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        due = start + n / rate_per_s
        while time.monotonic() < due:
            _read(col)
        rid = f"{tag}-{n}"
        sent_at[rid] = time.monotonic()
        col.send(id=rid, op="generate", prompt="turn the kitchen lights on", max_tokens=6)
        n += 1
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and len(col.finals()) < len(col.sent):
        _read(col, 20)
    col.collect(timeout=1, linger=0.3)
    return col


def _read(col: Collector, timeout_ms: int = 0) -> None:
    if col.sock.poll(timeout_ms):
        frames = col.sock.recv_multipart()
        body = msgpack.unpackb(frames[-1])
        col.replies.setdefault(body.get("id"), []).append(body)
        if body["status"] != "partial":
            col.received_at[body["id"]] = time.monotonic()  # type: ignore[attr-defined]


def test_flood_at_ten_times_capacity(make_node: NodeFactory) -> None:
    node = make_node(broker={"max_queue": QUEUE_BOUND, "max_in_flight_per_client": 10_000})
    broker_proc = psutil.Process(node.status()["pid"])
    warm = flood(node, 1.0, 300, "warm")  # reach steady state before measuring memory
    warm.close()
    rss_before = broker_proc.memory_info().rss

    col = flood(node, 3.0, 300, "flood")
    try:
        col.assert_exactly_one_final_each()
        finals = {rid: col.final(rid) for rid in col.sent}
        ok = [r for r in finals.values() if r["status"] == "ok"]
        shed = [r for r in finals.values() if r["status"] == "error"]
        assert len(col.sent) >= 600 and ok and shed
        assert {(r["code"], r["reason"]) for r in shed} == {(503, "queue_full")}
        assert all(50 <= r["retry_after_ms"] <= 30_000 for r in shed)

        # Admitted requests waited behind at most one queue's worth of others: while
        # one waited, at most QUEUE_BOUND + SLOTS served requests ended (+ SLOTS for
        # replies already on their way when it was sent). Counted, not timed: a stall
        # of a loaded CI machine stretched a wait to 1.4 s against 62 ms of service.
        sent_at, received_at = col.sent_at, col.received_at  # type: ignore[attr-defined]
        ends = sorted(received_at[r["id"]] for r in ok)
        waited_behind = [
            bisect.bisect_left(ends, sent_at[r["id"]] + r["queue_ms"] / 1000)
            - bisect.bisect_right(ends, sent_at[r["id"]])
            for r in ok
        ]
        assert max(waited_behind) <= QUEUE_BOUND + 2 * SLOTS, sorted(waited_behind)[-5:]
        # Goodput near capacity: the workers were kept busy, not starved.
        service = percentile((r["total_ms"] - r["queue_ms"] for r in ok), 50)
        assert len(ok) >= 0.5 * 3.0 * SLOTS * 1000 / service

        # Shed replies come back much faster than a served request takes.
        shed_lat = [(received_at[r["id"]] - sent_at[r["id"]]) * 1000 for r in shed]
        p99 = percentile(shed_lat, 99)
        assert p99 < percentile((r["total_ms"] for r in ok), 50), p99
    finally:
        col.close()

    # The broker's memory stays flat across a flood as long as the warm-up one.
    assert broker_proc.memory_info().rss < rss_before * 1.10 + 2 * 2**20
    status = node.status()
    assert status["queue_depth"] == 0 and status["in_flight"] == 0 and status["credit"] == SLOTS
    assert status["counters"]["shed_queue_full"] >= len(shed)  # the warm-up shed some too


#: The test engine evaluates these prompts at 2 ms per word before its first
#: token (``!prefill``), then writes 4 tokens at 10 ms: ~55 ms and ~0.45 s.
SHORT_PROMPT = "!prefill 2 turn the kitchen lights on"
LONG_PROMPT = "!prefill 2 " + "lamp " * 200
BURST_BUDGET_MS = 1200


def long_prompt_burst(node: NodeProcess) -> tuple[int, int, int]:
    """Warm up on one long and eight short prompts, then send 4 short and 10 long
    ones at once with a 1.2 s budget: two workers finish only about 4 of the
    long ones in time. Returns (admitted, admitted but 504, long ones served)."""
    col = Collector(node.frontend)
    try:
        col.send(id="warm-long", op="generate", prompt=LONG_PROMPT, max_tokens=4)
        col.collect(timeout=10, linger=0)
        for i in range(8):
            col.send(id=f"warm-{i}", op="generate", prompt=SHORT_PROMPT, max_tokens=4)
        col.collect(timeout=10, linger=0)
        burst = [(f"short-{i}", SHORT_PROMPT) for i in range(4)]
        burst += [(f"long-{i}", LONG_PROMPT) for i in range(10)]
        for rid, prompt in burst:
            col.send(id=rid, op="generate", prompt=prompt, max_tokens=4, timeout_ms=BURST_BUDGET_MS)
        col.collect(timeout=15, linger=0.3)
        col.assert_exactly_one_final_each()
        finals = [col.final(rid) for rid, _ in burst]
    finally:
        col.close()
    refused = [r for r in finals if r.get("reason") == "deadline_unmeetable"]
    missed = [r for r in finals if r["status"] == "error" and r["code"] == 504]
    assert len(refused) + len(missed) + sum(r["status"] == "ok" for r in finals) == len(finals)
    served_long = sum(r["status"] == "ok" and r["id"].startswith("long") for r in finals)
    return len(finals) - len(refused), len(missed), served_long


def test_a_long_prompt_burst_ends_in_504_far_less_often_when_sized(
    make_node: NodeFactory,
) -> None:
    """The mean service time (mostly short requests) lets the whole burst in and
    about half the long prompts expire; sized by prompt and max_tokens, the
    broker refuses those up front (503) and still serves what fits."""
    share = {}
    served = {}
    for estimate in ("mean", "size"):
        node = make_node(
            broker={"max_queue": 32, "max_in_flight_per_client": 100, "service_estimate": estimate}
        )
        admitted, missed, served[estimate] = long_prompt_burst(node)
        share[estimate] = missed / admitted
        node.stop()
    assert share["mean"] >= 0.25, share  # the defect: admitted, then 504
    assert share["size"] <= share["mean"] / 3, share
    assert served["size"] >= 2, served  # not by refusing everything long
