"""Safe retry against a real node (PROTOCOL §3.5): a client that timed out resends
with the same id and ``retry: true``, and the request still runs once, by the
worker's own count of the requests it started (its HEARTBEAT ``started``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from broker.errors import Unavailable
from node.testing import Collector, NodeProcess, wait_for

#: One test worker, one slot: every request it starts is counted in one place.
ONE_WORKER = {"count": 1, "slots": 1, "test_token_ms": 250}
#: Eight tokens ("echo:" and seven words) at 250 ms each: 2 s of work, so that a
#: resend 0.3 s in finds it running even on a loaded machine.
PROMPT = "one two three four five six seven"


def started(node: NodeProcess) -> int:
    """The worker's own count of requests started, once two heartbeats (100 ms
    each) have passed since asked, so that it counts everything sent before."""
    time.sleep(0.3)
    (worker,) = node.status()["workers"]
    count = worker["started"]
    assert isinstance(count, int), worker
    return count


@pytest.fixture
def node(make_node: Callable[..., NodeProcess]) -> NodeProcess:
    return make_node(workers=ONE_WORKER)


def test_a_client_that_timed_out_gets_its_answer_from_the_one_run(node: NodeProcess) -> None:
    assert started(node) == 0
    with node.client(wait_ms=300) as client:
        with pytest.raises(Unavailable, match="no reply"):
            client.generate(PROMPT, id="job-1", max_tokens=16)
        # Its own wait this time (timeout_ms is the request's budget, not what it asks).
        reply = client.generate(PROMPT, id="job-1", max_tokens=16, retry=True, timeout_ms=5000)
    assert reply.text == "echo: " + PROMPT and "replayed" not in reply.raw
    assert started(node) == 1
    status = node.status()
    assert status["counters"]["retry_attached"] == 1


def test_a_retried_stream_and_a_late_retry_never_run_twice(node: NodeProcess) -> None:
    col = Collector(node.frontend)
    try:
        body: dict[str, Any] = {"op": "generate", "prompt": PROMPT, "stream": True}
        col.send(id="s", **body)
        col.collect(until_all_final=False, timeout=0.3, linger=0)  # the client's "timeout"
        col.send(id="s", **body, retry=True)
        col.collect(timeout=10, linger=0.3)
        col.assert_exactly_one_final_each()  # the resend shares the one final
        first = col.final("s")
        partials = [r["text"] for r in col.replies["s"] if r["status"] == "partial"]
        assert "".join(partials) == first["text"] == "echo: " + PROMPT
        assert started(node) == 1
        # Long after the answer: the same final again, marked, and still no second run.
        col.replies.clear()
        col.send(id="s", **body, retry=True)
        col.collect(timeout=5, linger=0.3)
        again = col.final("s")
        assert again == {**first, "replayed": True}
        assert started(node) == 1
        # Without retry the answered id is free (PROTOCOL §3.3): it runs, and is counted.
        col.replies.clear()
        col.send(id="s", **body)
        col.collect(timeout=10, linger=0.3)
        assert "replayed" not in col.final("s")
        wait_for(lambda: started(node) == 2, timeout=5)
    finally:
        col.close()
