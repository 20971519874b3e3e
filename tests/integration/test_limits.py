"""One set of size limits on every hop (issue 11), with a real node and real sockets.

Every limit comes from ``broker.max_body_bytes`` through
``broker.protocol.message_limits``: what the frontend accepts fits the worker
conversation, a body over the limit is answered 413 naming it, a body over the
sockets' cap is refused by the client library with that same error, and a
completion longer than a reply may carry is a 413 for its request, not a lost worker.

Nodes here run the test engine with 100 ms heartbeats x 3 (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from broker import protocol as p
from broker.errors import TooLarge
from node.testing import Collector, NodeProcess

NodeFactory = Callable[..., NodeProcess]
MiB = 2**20
#: A raised ``broker.max_body_bytes``: twice what the worker hop took before issue 11.
RAISED = 2 * MiB


def sized_prompt(size: int, **fields: Any) -> str:
    """A prompt ``"a b xxx..."`` (three words) whose body ``{**fields, "prompt": ...}``
    packs to exactly ``size`` bytes."""

    def body_bytes(n: int) -> int:
        return len(p.pack({**fields, "prompt": "a b " + "x" * n}))

    guess = size - 256  # the same msgpack str header (str32) as the answer
    n = guess + size - body_bytes(guess)
    assert body_bytes(n) == size
    return "a b " + "x" * n


def assert_no_worker_lost(node: NodeProcess) -> None:
    status = node.status()
    assert [p["restarts"] for p in status["processes"]] == [0, 0], status["processes"]
    assert status["counters"].get("workers_lost", 0) == 0, status["counters"]
    assert status["all_ready"] and status["credit"] == 2


def test_a_raised_body_limit_holds_on_every_hop(make_node: NodeFactory) -> None:
    node = make_node(broker={"max_body_bytes": RAISED})
    col = Collector(node.frontend)
    under: dict[str, Any] = {"id": "under", "op": "generate", "max_tokens": 3}
    over: dict[str, Any] = {"id": "over", "op": "generate", "max_tokens": 3}
    under["prompt"] = sized_prompt(RAISED, **under)
    over["prompt"] = sized_prompt(RAISED + 1, **over)
    try:
        col.send(**under)
        col.send(**over)
        col.collect(timeout=30)
        col.assert_exactly_one_final_each()
    finally:
        col.close()
    served = col.final("under")  # the whole body reached a worker: its 3 words were counted
    assert served["status"] == "ok", {k: v for k, v in served.items() if k != "text"}
    assert (served["text"], served["usage"]["prompt_tokens"]) == ("echo: a b", 3)
    refused = col.final("over")
    assert (refused["status"], refused["code"]) == ("error", 413), refused
    assert refused["message"] == f"body is {RAISED + 1} bytes, the limit is {RAISED}"
    assert_no_worker_lost(node)


def test_a_body_over_the_socket_cap_is_refused_by_the_client_with_the_same_413(
    make_node: NodeFactory,
) -> None:
    # libzmq drops the connection of a frame over ZMQ_MAXMSGSIZE before the broker
    # sees a byte of it (docs/PROTOCOL.md §2.3): no reply can exist, so the client
    # library refuses such a body itself, with the node's own words.
    node = make_node()
    limit = p.DEFAULT_MAX_BODY_BYTES
    frame = p.message_limits(limit).frame_bytes
    with node.client(wait_ms=10_000) as client:
        prompt = "x" * (frame + 1)
        size = len(p.pack({"op": "generate", "prompt": prompt, "id": "big"}))
        with pytest.raises(TooLarge) as info:
            client.generate(prompt, id="big")
        assert info.value.message == f"body is {size} bytes, the limit is {limit}"
        # Nothing was sent: the connection is whole and the same id is free again.
        assert client.generate("still here", id="big", max_tokens=3).text == "echo: still here"
    assert node.status()["counters"].get("rejected_bad_request", 0) == 0
    assert_no_worker_lost(node)


@pytest.mark.parametrize("stream", [False, True], ids=["final", "streamed"])
def test_a_completion_longer_than_a_reply_may_carry_is_413_not_a_lost_worker(
    make_node: NodeFactory, stream: bool
) -> None:
    node = make_node()
    limits = p.message_limits(p.DEFAULT_MAX_BODY_BYTES)
    prompt = f"!long {limits.frame_bytes + MiB}"  # a FINAL the backend socket would drop
    pieces: list[str] = []
    with node.client(wait_ms=30_000) as client, pytest.raises(TooLarge) as info:
        if stream:
            pieces.extend(client.stream_generate(prompt, max_tokens=64, timeout_ms=20_000))
        else:
            client.generate(prompt, max_tokens=64, timeout_ms=20_000)
    assert f"the most a reply may carry: {limits.text_bytes} bytes" in info.value.message
    assert "broker.max_body_bytes" in info.value.message
    text = info.value.partial_text
    assert set(text) == {"x"} and len(text) == limits.text_bytes  # clipped to the limit
    streamed = "".join(pieces)
    assert len(streamed) <= limits.text_bytes and text.startswith(streamed)
    assert bool(streamed) is stream
    with node.client(wait_ms=10_000) as client:  # the worker serves on
        assert client.generate("after", max_tokens=3).text == "echo: after"
    assert_no_worker_lost(node)
