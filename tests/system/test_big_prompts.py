"""Oversized prompts must cost the broker little and never its workers' lives.

Found by a break-it session: 16 prompts of ~256 KiB (43,000 tokens each) were
tokenized back to back on the broker's loop; heartbeats waited 5 s behind them
and the node killed every healthy worker as dead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from nodeproc import Collector, NodeProcess

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]


def test_a_burst_of_huge_prompts_gets_413s_and_kills_no_worker(make_node: NodeFactory) -> None:
    node = make_node(
        workers={"engine": "llama", "count": 2},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
    )
    col = Collector(node.frontend)
    try:
        col.send(
            id="stream",
            op="generate",
            prompt="Once upon a time",
            max_tokens=48,
            stream=True,
            route="llm",
        )
        huge = "hello " * 43_000
        for i in range(16):
            col.send(id=f"huge-{i}", op="generate", prompt=huge, max_tokens=4)
        started = time.monotonic()
        with node.client(wait_ms=5000) as c:
            c.ping()
        ping_s = time.monotonic() - started
        col.collect(timeout=60)
        col.assert_exactly_one_final_each()
        assert {col.final(f"huge-{i}")["code"] for i in range(16)} == {413}
        assert col.final("stream")["status"] == "ok"
        status = node.status()
        assert status["counters"].get("workers_lost", 0) == 0
        assert all(p["restarts"] == 0 for p in status["processes"])
        assert ping_s < 3.0  # liveness is 3 s: the loop never stalled that long
    finally:
        col.close()
