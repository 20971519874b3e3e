"""A stopping node answers every request that reaches it until its frontend closes.

Once the drain has answered the last request, the workers are stopped; a worker
may take seconds to exit (its SIGTERM grace). Clients that ask meanwhile must
get typed replies (a pong, ``503 draining``), not silence on a socket still bound.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from node.testing import Collector, NodeProcess, leftover_processes, wait_for

NodeFactory = Callable[..., NodeProcess]

#: How long a probe may wait for its reply (s): the loop answers in milliseconds.
ANSWER_WITHIN_S = 0.5


def probe(col: Collector, n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send a ping and a generate; return their final replies (asserted to come)."""
    ping, gen = f"ping-{n}", f"gen-{n}"
    col.send(id=ping, op="ping")
    col.send(id=gen, op="generate", prompt="too late", max_tokens=2)
    col.collect(timeout=ANSWER_WITHIN_S, linger=0)
    got = {rid: col.replies.get(rid) for rid in (ping, gen)}
    assert all(got.values()), f"probe {n}: no reply while the workers stop: {got}"
    return col.final(ping), col.final(gen)


def test_requests_during_the_worker_stop_get_typed_replies(make_node: NodeFactory) -> None:
    # A worker busy with a request that ignores cancellation takes ~2 s to exit
    # on SIGTERM (its engine thread is joined with a 2 s timeout), within the
    # 3 s grace. No stall verdict may kill it earlier.
    node = make_node(
        workers={"count": 1, "stop_grace_ms": 3000}, broker={"stall_timeout_ms": 60_000}
    )
    col = Collector(node.frontend)
    try:
        col.send(id="hang", op="generate", prompt="!hang", timeout_ms=50_000)
        wait_for(lambda: node.status()["in_flight"] == 1)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        # The drain waits the grace for "hang", then answers it: the workers stop next.
        col.collect(timeout=10, linger=0)
        hang = col.final("hang")
        assert (hang["code"], hang["reason"]) == (503, "shutdown"), hang
        for n in range(4):
            pong, refused = probe(col, n)
            assert pong["status"] == "ok" and pong["pong"] is True, pong
            assert (refused["code"], refused["reason"]) == (503, "draining"), refused
            assert refused["retry_after_ms"] > 0, refused
            time.sleep(0.2)
        assert node.stop(timeout=15) == 0
        col.assert_exactly_one_final_each()
        assert leftover_processes(node.run_dir) == []
    finally:
        col.close()


def test_a_stop_answers_queued_requests_at_once_and_lets_the_running_one_finish(
    make_node: NodeFactory,
) -> None:
    # Before: the queued requests were started one by one during the grace as the
    # slot freed, and whatever was left at its end got 503 shutdown (a client
    # behind a long queue waited the whole grace for nothing).
    node = make_node(
        workers={"count": 1, "slots": 1, "test_token_ms": 100, "stop_grace_ms": 8000},
        routing={"mode": "full"},
        fallback={"rules": ""},
    )
    col = Collector(node.frontend)
    try:
        # The test engine echoes "echo: " and the prompt a word per token: 30 tokens, ~3 s.
        words = " ".join(f"w{i}" for i in range(30))
        col.send(id="running", op="generate", prompt=words, max_tokens=30)
        wait_for(lambda: node.status()["in_flight"] == 1)
        for n in range(3):
            col.send(id=f"queued-{n}", op="generate", prompt=f"waits {n}", max_tokens=20)
        wait_for(lambda: node.status()["queue_depth"] == 3)
        assert node.proc is not None
        node.proc.send_signal(signal.SIGTERM)
        col.collect(timeout=15, linger=0)
        for n in range(3):
            queued = col.final(f"queued-{n}")
            assert (queued["code"], queued["reason"]) == (503, "draining"), queued
            assert queued["retry_after_ms"] > 0, queued
        running = col.final("running")
        assert running["status"] == "ok", running
        assert running["finish_reason"] == "length" and running["text"].endswith("w28"), running
        assert node.stop(timeout=15) == 0
        col.assert_exactly_one_final_each()
    finally:
        col.close()
