"""One ``Client``, several requests in flight: cancel, ping and status while a
stream is open, interleaved streams, and the error fields apps branch on.

Real node, test engine (``!slow <ms>`` sets the per-token delay). The clients
wait at most 5 s for a reply, so a reply the client loses fails the test in
seconds instead of hanging for the default two minutes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from clientkit import AnyClient

from broker.client import Client
from broker.errors import Cancelled, ErrorCode, NotFound, ProtocolError, Unavailable
from node.testing import NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]
Connect = Callable[..., AnyClient]

#: A stream of 1 + 30 pieces at 100 ms each: still running whenever a test acts on it.
SLOW = "!slow 100 " + " ".join(f"w{i}" for i in range(28))
WAIT_MS = 5000


@pytest.fixture(scope="module")
def two_workers(make_module_node: NodeFactory) -> NodeProcess:
    """One node (two one-slot workers) for every test here that only sends requests:
    each test's requests are its own client's and all end before it does."""
    return make_module_node()


def test_cancel_on_the_same_client_ends_the_stream_with_cancelled(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_generate(SLOW, max_tokens=100, id="story-1", route="llm")
        assert stream.id == "story-1"
        pieces = iter(stream)
        first = [next(pieces) for _ in range(3)]
        assert first == ["echo:", " !slow", " 100"]
        started = time.monotonic()
        assert c.cancel("story-1") is None
        with pytest.raises(Cancelled) as caught:
            list(pieces)
        assert time.monotonic() - started < 2.0, "the stream must end at once, not at wait_ms"
        assert caught.value.code == ErrorCode.CANCELLED
        assert caught.value.partial_text.startswith("echo: !slow 100")
        # 499 has no reason on the wire (PROTOCOL §5.2); the client names its own cancel.
        assert caught.value.reason == "cancelled_by_client"
        assert stream.result is None
        # The request is over: a second cancel finds nothing, and the client still works.
        with pytest.raises(NotFound):
            c.cancel("story-1")
        assert c.generate("still here", max_tokens=3).text == "echo: still here"


def test_the_generated_id_of_a_stream_cancels_it(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_chat([{"role": "user", "content": SLOW}], max_tokens=100)
        assert isinstance(stream.id, str) and stream.id.startswith(f"{os.getpid():x}-")
        c.cancel(stream.id)  # before reading anything
        with pytest.raises(Cancelled):
            list(stream)


def test_ping_status_and_generate_while_a_stream_is_open(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_generate("!slow 50 a b c d e f", max_tokens=20)
        pieces = iter(stream)
        got = [next(pieces), next(pieces)]
        assert c.ping()["pong"] is True
        assert c.status()["protocol"] == 1
        assert c.generate("in between", max_tokens=4).text == "echo: in between"
        got += list(pieces)  # nothing the stream was sent meanwhile is lost
        assert stream.result is not None
        assert "".join(got) == stream.result.text == "echo: !slow 50 a b c d e f"
        assert stream.result.id == stream.id


def test_two_streams_interleaved_on_one_client(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        one = c.stream_generate("!slow 30 a b c d e", max_tokens=20)
        two = c.stream_generate("!slow 20 v w x y z", max_tokens=20)
        assert one.id != two.id
        it1, it2 = iter(one), iter(two)
        got1, got2 = [next(it1)], [next(it2)]
        time.sleep(0.3)  # both finish meanwhile: their replies wait in the client
        got2 += list(it2)
        got1 += list(it1)
        assert "".join(got1) == "echo: !slow 30 a b c d e"
        assert "".join(got2) == "echo: !slow 20 v w x y z"
        assert one.result is not None and one.result.id == one.id
        assert two.result is not None and two.result.id == two.id


def test_an_id_in_flight_on_this_client_is_refused_locally(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_generate(SLOW, max_tokens=100, id="twice")
        pieces = iter(stream)
        next(pieces)
        with pytest.raises(ProtocolError) as caught:
            c.generate("again", id="twice")
        assert caught.value.reason == "duplicate_id"
        assert caught.value.code == ErrorCode.BAD_REQUEST
        c.cancel("twice")
        with pytest.raises(Cancelled):
            list(pieces)
        # Once answered, the id is free again.
        assert c.generate("again", id="twice", max_tokens=2).id == "twice"


def test_errors_carry_reason_code_and_retry_after(
    make_node: NodeFactory, connect_client: Connect
) -> None:
    node = make_node(workers={"count": 1}, broker={"max_queue": 1})
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        running = c.stream_generate(SLOW, max_tokens=100)
        pieces = iter(running)  # held: dropping it would cancel the stream
        next(pieces)  # it runs: the only worker is busy
        queued = c.stream_generate("waits", max_tokens=2)
        with pytest.raises(Unavailable) as caught:
            c.generate("no room", max_tokens=2)
        err = caught.value
        assert err.code == ErrorCode.UNAVAILABLE
        assert err.reason == "queue_full"
        assert err.retry_after_ms is not None and 50 <= err.retry_after_ms <= 30_000
        assert "queue is full" in str(err)
        c.cancel(running.id)
        with pytest.raises(Cancelled):
            list(pieces)
        assert "".join(queued) == "echo: waits"


def test_a_finished_stream_frees_its_id_while_the_stream_object_lives(
    two_workers: NodeProcess, connect_client: Connect
) -> None:
    # Break-it finding: the id stayed "in flight" until the Stream was collected.
    node = two_workers
    with connect_client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_generate("tell me", max_tokens=5, id="s6")
        assert "".join(stream) == "echo: tell me"
        again = c.stream_generate("x", max_tokens=2, id="s6")
        assert "".join(again) == "echo: x" and stream.id == again.id == "s6"


class Interrupted(Exception):
    """What the test's SIGALRM handler raises, as Ctrl-C raises KeyboardInterrupt."""


@pytest.mark.parametrize("call", ["stream", "generate"])
def test_an_exception_from_a_signal_handler_during_the_wait_cancels_the_request(
    two_workers: NodeProcess, call: str
) -> None:
    """A Ctrl-C (or any signal handler's exception) while the sync client waits for a
    reply leaves the call: the request is cancelled on the node, as a ``break`` does.
    Before, the generator's ``finally`` ended the call first, so leaving the stream
    sent no cancel and the request held its slot to ``max_tokens`` (break-it pass,
    session 19: five Ctrl-Cs took a 4-slot worker's every slot)."""

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise Interrupted

    # 30 pieces at 200 ms: 6 s, far past the interrupt and the wait for the cancel.
    slow = "!slow 200 " + " ".join(f"w{i}" for i in range(28))
    before = signal.signal(signal.SIGALRM, interrupt)
    try:
        with Client(two_workers.frontend, timeout_ms=WAIT_MS) as c:
            signal.setitimer(signal.ITIMER_REAL, 0.6)
            with pytest.raises(Interrupted):
                if call == "stream":
                    with c.stream_generate(slow, max_tokens=100, route="llm") as stream:
                        for _ in stream:
                            pass
                else:
                    c.generate(slow, max_tokens=100, route="llm")
            wait_for(lambda: c.status()["in_flight"] == 0, timeout=3.5)
            assert c.generate("still here", max_tokens=3).text == "echo: still here"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_an_exception_as_the_request_went_out_still_cancels_it(
    two_workers: NodeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pyzmq may raise a signal handler's exception (Ctrl-C) from ``send`` after the
    frames went out: the client took the request for unsent and left it running to
    max_tokens (2 in 150 interrupted calls, break-it pass, session 19). A cancel goes
    after any such exception; for an id the node never got it is a dropped 404."""
    slow = "!slow 200 " + " ".join(f"w{i}" for i in range(28))  # 6 s
    with Client(two_workers.frontend, timeout_ms=WAIT_MS) as c:
        send = c._sock.send_multipart
        interrupted: list[bool] = []

        def send_then_interrupt(frames: Any, *args: Any) -> Any:
            sent = send(frames, *args)
            if not interrupted:
                interrupted.append(True)
                raise Interrupted
            return sent

        monkeypatch.setattr(c._sock, "send_multipart", send_then_interrupt)
        with pytest.raises(Interrupted):
            c.generate(slow, max_tokens=100, route="llm")
        wait_for(lambda: c.status()["in_flight"] == 0, timeout=3.5)
        assert c.generate("still here", max_tokens=3).text == "echo: still here"
