"""The client against a scripted fake node (a ROUTER on loopback TCP): replies
in any order, every error reply's fields on the exception, late replies.

The fake answers ``ping`` itself and hands every other request to the test,
which scripts the replies: what a real node does only under load or faults.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq
from clientkit import AnyClient

from broker import protocol as p
from broker.errors import (
    Cancelled,
    DeadlineExceeded,
    EdgeNodeError,
    ErrorCode,
    InternalError,
    Overloaded,
    ProtocolError,
    TooLarge,
    Unavailable,
)

Connect = Callable[..., AnyClient]


class FakeNode:
    """A frontend ROUTER run by a thread (zmq sockets stay in one thread)."""

    def __init__(self) -> None:
        self.requests: queue.Queue[dict[str, Any]] = queue.Queue()
        self._out: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peer = b""
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(10):
                peer, _, _, raw = self._sock.recv_multipart()
                self._peer = peer
                body = p.unpack_map(raw)
                if body.get("op") == "ping":
                    self._send({"id": body["id"], "status": "ok", "pong": True, "version": 1})
                else:
                    self.requests.put(body)
            while not self._out.empty():
                self._send(self._out.get())
        self._sock.close(0)

    def _send(self, body: dict[str, Any]) -> None:
        self._sock.send_multipart([self._peer, b"", p.CLIENT_TAG, p.pack(body)])

    def reply(self, *bodies: dict[str, Any]) -> None:
        """Send these reply bodies, in this order."""
        for body in bodies:
            self._out.put(body)

    def next_request(self) -> dict[str, Any]:
        return self.requests.get(timeout=5)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def fake() -> Iterator[FakeNode]:
    node = FakeNode()
    yield node
    node.close()


def partial(rid: Any, text: str, index: int) -> dict[str, Any]:
    return {"id": rid, "status": "partial", "text": text, "index": index}


def ok(rid: Any, text: str, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "status": "ok", "text": text, "finish_reason": "stop", **extra}


def error(rid: Any, code: int, **extra: Any) -> dict[str, Any]:
    return {"id": rid, "status": "error", "code": code, "error": ErrorCode(code).name, **extra}


@pytest.mark.parametrize(
    ("reply", "cls", "reason", "retry", "text"),
    [
        (error("r", 503, message="node is draining", reason="draining", retry_after_ms=1000),
         Unavailable, "draining", 1000, ""),
        (error("r", 503, message="worker lost", reason="worker_lost", retry_after_ms=1000,
               text="echo: a"), Unavailable, "worker_lost", 1000, "echo: a"),
        (error("r", 503, message="expected service 9 ms alone exceeds the 5 ms budget",
               reason="deadline_unmeetable"), Unavailable, "deadline_unmeetable", None, ""),
        (error("r", 503, message="queue is full (4 waiting)", reason="queue_full",
               retry_after_ms=250), Unavailable, "queue_full", 250, ""),
        (error("r", 503, message="circuit open", reason="circuit_open", retry_after_ms=50),
         Unavailable, "circuit_open", 50, ""),
        (error("r", 503, message="no free slot"), Unavailable, None, None, ""),
        (error("r", 429, message="cap", reason="client_cap", retry_after_ms=75),
         Overloaded, "client_cap", 75, ""),
        (error("r", 413, message="too many tokens", reason="too_large"),
         TooLarge, "too_large", None, ""),
        (error("r", 504, message="deadline exceeded", text="echo:"),
         DeadlineExceeded, None, None, "echo:"),
        # 499 has no reason on the wire; the client names it (its own cancel).
        (error("r", 499, message="cancelled by client", text="x"), Cancelled,
         "cancelled_by_client", None, "x"),
        (error("r", 500, message="llama.cpp decode failed"), InternalError, None, None, ""),
    ],
)  # fmt: skip
def test_an_error_reply_s_fields_are_on_its_exception(
    fake: FakeNode,
    connect_client: Connect,
    reply: dict[str, Any],
    cls: type[EdgeNodeError],
    reason: str | None,
    retry: int | None,
    text: str,
) -> None:
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        stream = c.stream_generate("a", id="r")
        fake.next_request()
        fake.reply(reply)
        with pytest.raises(cls) as caught:
            list(stream)
    exc = caught.value
    assert exc.code == reply["code"]
    assert exc.reason == reason
    assert exc.retry_after_ms == retry
    assert exc.partial_text == text
    assert exc.message == reply["message"]


def test_mistyped_error_fields_do_not_break_the_client(
    fake: FakeNode, connect_client: Connect
) -> None:
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        stream = c.stream_generate("a", id="r")
        fake.next_request()
        fake.reply(
            {"id": "r", "status": "error", "code": "503", "reason": 7, "retry_after_ms": 1.5}
        )
        with pytest.raises(InternalError) as caught:
            list(stream)
    assert (caught.value.reason, caught.value.retry_after_ms) == (None, None)


def test_replies_in_any_order_reach_their_own_request(
    fake: FakeNode, connect_client: Connect
) -> None:
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        one = c.stream_generate("a", id="one")
        two = c.stream_chat([{"role": "user", "content": "b"}], id=2)
        assert [fake.next_request()["id"] for _ in range(2)] == ["one", 2]
        fake.reply(
            partial(2, "B0", 0),
            partial("one", "A0", 0),
            partial("unknown", "dropped", 0),
            ok(2, "B0"),
            partial("one", "A1", 1),
            ok("one", "A0A1"),
        )
        assert list(one) == ["A0", "A1"]
        assert list(two) == ["B0"]
        assert one.result is not None and (one.result.id, one.result.text) == ("one", "A0A1")
        assert two.result is not None and (two.result.id, two.result.text) == (2, "B0")


def test_a_cancel_reply_before_its_targets_499_still_ends_both(
    fake: FakeNode, connect_client: Connect
) -> None:
    # The node sends the target's 499 first (PROTOCOL §11); the client does not rely on it.
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        stream = c.stream_generate("a", id="t")
        fake.next_request()
        fake.reply(partial("t", "x", 0))
        pieces = iter(stream)
        assert next(pieces) == "x"
        done = threading.Event()

        def answer_cancel() -> None:
            cancel = fake.next_request()
            assert cancel["op"] == "cancel" and cancel["target"] == "t"
            fake.reply(
                {"id": cancel["id"], "status": "ok", "cancelled": "t"},
                error("t", 499, message="cancelled by client", text="x"),
            )
            done.set()

        helper = threading.Thread(target=answer_cancel)
        helper.start()
        c.cancel(stream.id)
        helper.join(5)
        assert done.is_set()
        with pytest.raises(Cancelled) as caught:
            list(pieces)
        assert caught.value.partial_text == "x"


def test_the_wait_counts_only_this_requests_replies_and_late_ones_are_dropped(
    fake: FakeNode,
    connect_client: Connect,
) -> None:
    with connect_client(fake.endpoint, wait_ms=300) as c:
        busy = c.stream_generate("chatty", id="busy")
        quiet = c.stream_generate("silent", id="quiet")
        fake.next_request()
        fake.next_request()
        for i in range(10):  # 500 ms of replies for the other stream
            fake.reply(partial("busy", str(i), i))
            time.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(Unavailable) as caught:
            list(quiet)
        assert 0.25 < time.monotonic() - started < 1.0
        assert caught.value.reason is None
        assert "no reply" in str(caught.value)
        fake.reply(ok("quiet", "too late"), ok("busy", "0123456789"))
        assert c.ping()["pong"] is True  # the late reply was dropped on the way
        assert "".join(busy) == "0123456789"  # kept while the other waits timed out
        # The timed-out id is free again.
        again = c.stream_generate("retry", id="quiet")
        fake.next_request()
        fake.reply(ok("quiet", "fresh"))
        assert list(again) == [] and again.result is not None and again.result.text == "fresh"


def test_a_stream_never_read_frees_its_id_when_dropped(
    fake: FakeNode, connect_client: Connect
) -> None:
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        stream = c.stream_generate("a", id="gone")
        with pytest.raises(ProtocolError):
            c.stream_generate("b", id="gone")
        del stream
        c.stream_generate("c", id="gone")  # no duplicate_id now


@pytest.mark.parametrize("bad", [[1], True, 1.5, None, -3, "", "x" * 129, 2**63])
def test_an_id_the_node_would_refuse_is_refused_before_sending(
    fake: FakeNode, connect_client: Connect, bad: Any
) -> None:
    # The node's 400 for such an id carries ``id: nil`` (it cannot echo an invalid
    # id), which no inbox takes: the client must refuse it itself, at once.
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        if bad is None:  # None means "make one up", as when absent
            stream = c.stream_generate("a", id=bad)
            assert isinstance(stream.id, str)
            return
        with pytest.raises(ProtocolError) as caught:
            c.generate("a", id=bad)
        assert caught.value.reason is None
    assert fake.requests.empty()


def test_a_value_msgpack_cannot_carry_is_refused_before_sending_and_typed(
    fake: FakeNode, connect_client: Connect
) -> None:
    """``{"const": 2**64 + 1}`` raised msgpack's OverflowError out of the client
    (break-it pass, session 17); the same client then serves the next call."""
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        with pytest.raises(ProtocolError, match="cannot be encoded as msgpack"):
            c.generate("a", json_schema={"const": 2**64 + 1})
        assert fake.requests.empty()

        def answer() -> None:
            request = fake.next_request()
            fake.reply(ok(request["id"], "fine"))

        answering = threading.Thread(target=answer, daemon=True)
        answering.start()
        assert c.generate("b").text == "fine"
        answering.join(5)


def test_dropped_partials_are_on_the_stream_and_its_reply(
    fake: FakeNode, connect_client: Connect
) -> None:
    with connect_client(fake.endpoint, wait_ms=5000) as c:
        stream = c.stream_generate("a b c d", id="s")
        fake.next_request()
        # Chunks 1 and 2 were dropped by the node (the client was not reading).
        fake.reply(
            partial("s", "a", 0),
            {**partial("s", " d", 3), "dropped_partials": 2},
            ok("s", "a b c d", dropped_partials=2),
        )
        pieces = iter(stream)
        assert next(pieces) == "a"
        assert stream.dropped_partials == 0
        assert list(pieces) == [" d"]
        assert stream.dropped_partials == 2
        assert stream.result is not None
        assert stream.result.dropped_partials == 2
        assert stream.result.text == "a b c d"
        # Absent, or not a count: 0.
        plain = c.stream_generate("x", id="p")
        fake.next_request()
        fake.reply({**partial("p", "x", 0), "dropped_partials": "many"}, ok("p", "x"))
        assert list(plain) == ["x"]
        assert plain.dropped_partials == 0
        assert plain.result is not None and plain.result.dropped_partials == 0
