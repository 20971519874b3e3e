"""A worker's error messages are clipped: they may quote client input whole (a
rejected json_schema), and a worker's log is not rotated (break-it finding:
40 such requests wrote 4.75 MB)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from broker import protocol as p
from broker.errors import ProtocolError
from broker.protocol import WorkerCommand
from node.engine import EngineSpec
from node.worker import MAX_MESSAGE_CHARS, WorkerLoop, WorkerSpec, clip

HUGE = "a" * 250_000


class Raising:
    """An engine whose every request fails with ``exc``."""

    kind, model, n_ctx = "test", "raising", 64
    steps = 0  # compute steps, for the worker's progress count

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def run(self, job: dict[str, Any], cancelled: threading.Event, emit: Callable[[str], None]):  # type: ignore[no-untyped-def]
        raise self.exc


class NoSocket:
    def send_multipart(self, frames: list[bytes]) -> None:
        raise AssertionError("nothing is streamed")


@pytest.fixture
def make_loop() -> Iterator[Callable[[Exception], WorkerLoop]]:
    loops: list[WorkerLoop] = []

    def make(exc: Exception) -> WorkerLoop:
        spec = WorkerSpec("llm-0", "inproc://none", EngineSpec("test", "test", 64, 8, 1))
        loop = WorkerLoop(spec, Raising(exc))  # type: ignore[arg-type]
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop._events.close(0)
        loop._wake_r.close()
        loop._wake_w.close()
        loop.ctx.term()


def test_clip_keeps_short_messages_and_says_what_it_cut() -> None:
    assert clip("short") == "short"
    cut = clip("x" * 600, limit=100)
    assert cut.startswith("x" * 100) and cut.endswith("... [500 more characters]")


@pytest.mark.parametrize(
    "exc", [ProtocolError(f"json_schema is not usable: {HUGE}"), ValueError(HUGE)]
)
def test_an_error_quoting_client_input_is_clipped_in_the_reply_and_the_log(
    make_loop: Callable[[Exception], WorkerLoop],
    exc: Exception,
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = make_loop(exc)
    with caplog.at_level(logging.INFO, logger="edgenode.worker"):
        reply = loop._run_one(NoSocket(), 7, {"prompt": "x"}, threading.Event())  # type: ignore[arg-type]
        loop._log_final(7, reply, abandoned=False)  # the I/O thread logs the FINAL it relays
    assert reply["status"] == "error" and reply["code"] in (400, 500)
    assert len(reply["message"]) < MAX_MESSAGE_CHARS + 40
    assert caplog.records  # it was logged, clipped:
    assert sum(len(r.getMessage()) for r in caplog.records) < 2 * (MAX_MESSAGE_CHARS + 100)


def _sent_for(loop: WorkerLoop, events: list[tuple[bytes, dict[str, Any]]]) -> list[Any]:
    """The (command, body) pairs ``loop`` sends the broker for engine ``events``."""
    sent: list[Any] = []
    loop._send = lambda command, body: sent.append((command, body))  # type: ignore[method-assign]
    for rid in (7, 8):
        loop.running[rid] = threading.Event()
    for kind, payload in events:
        loop._on_engine_event([kind, p.pack(payload)])
    return sent


def test_a_final_carries_its_own_last_pieces(
    make_loop: Callable[[Exception], WorkerLoop],
) -> None:
    """PROTOCOL §13.2: the request's last text and its end, waiting together, go as
    one FINAL with ``parts`` and ``progress``, not as a PARTIAL and a FINAL."""
    loop = make_loop(RuntimeError("unused"))
    final = {"rid": 7, "status": "ok", "text": "ab"}
    sent = _sent_for(loop, [(b"partials", {"parts": [[7, "a"], [7, "b"]]}), (b"final", final)])
    assert [command for command, _ in sent] == [WorkerCommand.FINAL]
    body = sent[0][1]
    assert body["parts"] == [[7, "a"], [7, "b"]] and isinstance(body["progress"], int)
    assert not loop._parts


def test_another_requests_pieces_go_first_in_a_partial_of_their_own(
    make_loop: Callable[[Exception], WorkerLoop],
) -> None:
    loop = make_loop(RuntimeError("unused"))
    final = {"rid": 7, "status": "ok", "text": "a"}
    sent = _sent_for(loop, [(b"partials", {"parts": [[7, "a"], [8, "x"]]}), (b"final", final)])
    assert [command for command, _ in sent] == [WorkerCommand.PARTIAL, WorkerCommand.FINAL]
    assert sent[0][1]["parts"] == [[7, "a"], [8, "x"]]
    assert "parts" not in sent[1][1]
