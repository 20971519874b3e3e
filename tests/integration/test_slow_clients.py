"""Clients that stop reading or vanish: no final reply is lost silently, and a
gone client's work stops (issue 11).

Real node, test engine, real clients: a ``Client`` that stops reading while its
streams run (its pipe fills: ~1000 messages at the broker's ROUTER, ~1000 at the
client's DEALER, a few hundred in the kernel), a client whose socket is closed
mid-request, and a client process killed with SIGKILL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from broker.client import Client, Stream
from broker.errors import EdgeNodeError
from node.testing import REPO, NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]

#: 300 words: the test engine streams "echo:" and then one piece per word of
#: the prompt, "!slow 1" included: 303 pieces of 1 ms each.
WORDS = " ".join(f"w{i}" for i in range(300))
STREAMED = f"!slow 1 {WORDS}"
PIECES = 303
#: A request that runs 100 s (100 tokens of 1 s, within its 120 s budget): the
#: old code kept its worker that long after its client had gone.
LONG = "!slow 1000 " + " ".join(f"x{i}" for i in range(99))
LONG_REQUEST = {"op": "generate", "prompt": LONG, "max_tokens": 100, "timeout_ms": 120_000}


def counters(node: NodeProcess) -> dict[str, int]:
    found: dict[str, int] = node.status()["counters"]
    return found


def idle(node: NodeProcess, workers: int) -> dict[str, Any] | None:
    """The status once nothing runs and every worker's credit is back, else None."""
    s = node.status()
    return s if s["in_flight"] == 0 and s["queue_depth"] == 0 and s["credit"] == workers else None


@pytest.mark.timeout(150)
def test_a_client_that_stops_reading_gets_all_its_final_replies_later(
    make_node: NodeFactory,
) -> None:
    node = make_node(broker={"max_in_flight_per_client": 32})
    with node.client(wait_ms=20_000) as c:
        streams = [
            c.stream_generate(STREAMED, max_tokens=400, id=f"r{i}", timeout_ms=20_000)
            for i in range(20)
        ]
        # The client reads nothing for 10 s, and at least until all 20 have finished.
        stop_reading_until = time.monotonic() + 10
        wait_for(lambda: counters(node).get("ok", 0) >= 20, timeout=60, every=0.2)
        time.sleep(max(0.0, stop_reading_until - time.monotonic()))  # the scenario, not a sync

        finals: dict[str, str] = {}
        received: dict[str, int] = {}
        lost: list[str] = []
        for stream in streams:
            try:
                received[str(stream.id)] = len(list(stream))
            except EdgeNodeError as exc:  # the old code: the final reply never came
                lost.append(f"{stream.id}: {exc}")
                break
            assert stream.result is not None
            finals[str(stream.id)] = stream.result.text
        assert not lost and len(finals) == 20, (len(finals), lost)
        assert all(text == f"echo: {STREAMED}" for text in finals.values())

        # Partials were dropped (the pipe was full), and each stream says how many.
        dropped = {str(s.id): s.dropped_partials for s in streams}
        assert all(received[i] + dropped[i] == PIECES for i in finals), (received, dropped)
        assert sum(dropped.values()) > 0
        assert all(_result(s).dropped_partials == dropped[str(s.id)] for s in streams)

        # The counters agree with what the client saw.
        n = counters(node)
        assert n["ok"] == 20
        assert n.get("client_gone", 0) == 0
        assert n.get("finals_undeliverable", 0) == 0
        assert n["finals_backlogged"] >= 1  # some finals had to wait for the client
        assert n["partials_dropped"] == sum(dropped.values())
        assert n["partials_delivered"] == sum(received.values())
        assert node.status()["delivery"]["backlog"] == 0


def _result(stream: Stream) -> Any:
    assert stream.result is not None
    return stream.result


def test_a_client_that_disconnects_mid_request_frees_its_worker(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    gone = node.client(wait_ms=5000)
    gone.send({"id": "doomed", **LONG_REQUEST})
    wait_for(lambda: node.status()["in_flight"] == 1)
    gone.close()  # a real disconnect: the socket is closed, nothing else is sent

    status = wait_for(lambda: idle(node, 1), timeout=10)
    assert status["counters"]["client_gone"] == 1
    assert "ok" not in status["counters"]
    # The worker serves the next client at once (the old code kept it a minute).
    with node.client(wait_ms=5000) as other:
        assert other.generate("next please", max_tokens=3, timeout_ms=5000).text == (
            "echo: next please"
        )
    assert counters(node)["ok"] == 1


CLIENT_SCRIPT = """
import sys
from broker.client import Client
with Client(sys.argv[1], wait_ms=10000) as c:
    stream = c.stream_generate(sys.argv[2], max_tokens=100, id="killed", timeout_ms=120000)
    for piece in stream:
        print(piece, flush=True)
"""


def test_a_client_process_killed_mid_stream_frees_its_worker(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_SCRIPT, node.frontend, LONG],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO)},
    )
    try:
        assert client.stdout is not None
        assert client.stdout.readline().strip() == b"echo:"  # it is streaming
        client.send_signal(signal.SIGKILL)
        client.wait(10)
        status = wait_for(lambda: idle(node, 1), timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        if client.stdout is not None:
            client.stdout.close()
    assert status["counters"]["client_gone"] == 1
    assert "ok" not in status["counters"]
    with node.client(wait_ms=5000) as other:
        assert other.generate("after", max_tokens=2, timeout_ms=5000).text == "echo: after"


@pytest.mark.timeout(120)
def test_a_client_whose_backlog_overflows_is_treated_as_gone(make_node: NodeFactory) -> None:
    node = make_node(broker={"max_in_flight_per_client": 32, "client_backlog": 2})
    c = node.client(wait_ms=5000)
    try:
        # One long request holds a worker; the other streams far more partials
        # than the pipe holds, so later finals wait in the backlog, which overflows.
        c.send({"id": "long", **LONG_REQUEST})
        wait_for(lambda: node.status()["in_flight"] == 1)
        for i in range(16):
            c.send(
                {
                    "id": f"s{i}",
                    "op": "generate",
                    "prompt": STREAMED,
                    "max_tokens": 400,
                    "stream": True,
                }
            )
        status = wait_for(lambda: idle(node, 2), timeout=60, every=0.2)
    finally:
        c.close()
    n = status["counters"]
    assert n["backlog_overflows"] == 1
    assert n["finals_undeliverable"] == 3  # the two waiting and the one that overflowed
    # "long" (cancelled) and the three answers it never got: client_gone, never ok.
    assert n["client_gone"] >= 1 + 3
    assert n.get("ok", 0) + n["client_gone"] == 17
    assert status["delivery"]["backlog"] == 0
    with Client(node.frontend, wait_ms=5000) as other:
        assert other.generate("still serving", max_tokens=3).text == "echo: still serving"
