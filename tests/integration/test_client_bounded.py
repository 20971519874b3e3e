"""Every client call is bounded, and a closed client says so: real zmq sockets, no node.

- A guarded client (``fallback=``) sends only on a live connection (ZMQ_IMMEDIATE):
  ``ping``/``status`` to a node that is not there raise ``NoReply`` after ``timeout_ms``
  instead of blocking in the send for ever; ``generate`` answers locally within
  ``timeout_ms`` (plus 10 ms of scheduling), in a fresh process (the fallback's
  one-off setup paid when the client is made) and with 10 calls at once, also when
  their 10 local answers at one deadline take longer together than that margin.
- ``close`` ends every pending call of an ``AsyncClient`` at once with ``ClientClosed``,
  and any call made after ``close`` raises it (both clients), with no task exception
  left unretrieved.

The time bounds are the clients' documented contract with a scheduling margin, not
speed figures.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from clientkit import AnyClient

from broker.client import AsyncClient, Client
from broker.errors import Cancelled, ClientClosed, NoReply
from fallback.engine import RuleEngine

Connect = Callable[..., AnyClient]
ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "fallback" / "default_rules.toml"
BUDGET_MS = 200
#: A ping that raises ``NoReply``: after its budget, with margin for a loaded box.
NOREPLY_BOUND_S = (BUDGET_MS + 300) / 1000
#: The defensive client's contract: answered within ``timeout_ms`` plus a few ms.
ANSWER_MARGIN_MS = 10


def free_tcp_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(params=["tcp", "ipc"])
def dead_endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An endpoint with nothing behind it: a free TCP port, or an ipc path with no file."""
    if request.param == "tcp":
        return f"tcp://127.0.0.1:{free_tcp_port()}"
    return f"ipc://{tmp_path}/missing.sock"


@pytest.fixture
def silent_node(tmp_path: Path) -> Iterator[tuple[str, zmq.Socket[bytes]]]:
    """A ROUTER that takes requests and never answers: (endpoint, socket)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/silent.sock"
    router.bind(endpoint)
    yield endpoint, router
    router.close(0)


def received(router: zmq.Socket[bytes], count: int, timeout_s: float = 5.0) -> list[bytes]:
    """The bodies of the next ``count`` requests ``router`` receives."""
    bodies = []
    until = time.monotonic() + timeout_s
    while len(bodies) < count:
        left_ms = max(1, round((until - time.monotonic()) * 1000))
        assert router.poll(left_ms), f"{len(bodies)} of {count} requests arrived"
        bodies.append(router.recv_multipart()[-1])
    return bodies


def test_ping_and_status_of_a_guarded_client_end_in_noreply_when_no_node_is_there(
    connect_client: Connect, dead_endpoint: str
) -> None:
    with connect_client(
        dead_endpoint, timeout_ms=BUDGET_MS, fallback=RuleEngine.from_file(RULES)
    ) as client:
        for call in (client.ping, client.status):
            started = time.monotonic()
            with pytest.raises(NoReply, match="is the node running"):
                call()
            took = time.monotonic() - started
            assert BUDGET_MS / 1000 * 0.9 <= took <= NOREPLY_BOUND_S, took


def test_send_of_a_guarded_client_ends_in_noreply_when_no_node_is_there(
    dead_endpoint: str,
) -> None:
    with Client(dead_endpoint, timeout_ms=BUDGET_MS, fallback=RuleEngine.from_file(RULES)) as c:
        started = time.monotonic()
        with pytest.raises(NoReply):
            c.send({"op": "ping"})
        assert time.monotonic() - started <= NOREPLY_BOUND_S


#: Run in a fresh interpreter: the first local answers of a process, each call timed (ms).
FRESH_PROCESS = """
import asyncio, json, sys, time
from broker.client import AsyncClient, Client
from fallback.engine import RuleEngine

kind, endpoint, rules = sys.argv[1:4]
budget, n, answer_s = int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
prompt = "turn on the kitchen lights"


class Slowed(RuleEngine):
    # The rules, each answer taking answer_s more, blocking as a heavier fallback's
    # would: the calls at one deadline are answered one after another.

    def answer(self, request):
        time.sleep(answer_s)
        return super().answer(request)


def fallback():
    return Slowed.from_file(rules) if answer_s else RuleEngine.from_file(rules)

async def timed(client):
    started = time.monotonic()
    reply = await client.generate(prompt)
    return (time.monotonic() - started) * 1000, reply.served_by, reply.degrade_reason

async def run_async():
    async with AsyncClient(endpoint, timeout_ms=budget, fallback=fallback()) as c:
        return list(await asyncio.gather(*(timed(c) for _ in range(n))))

if kind == "sync":
    with Client(endpoint, timeout_ms=budget, fallback=fallback()) as c:
        out = []
        for _ in range(n):
            started = time.monotonic()
            reply = c.generate(prompt)
            out.append(((time.monotonic() - started) * 1000, reply.served_by, reply.degrade_reason))
else:
    out = asyncio.run(run_async())
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    ("kind", "calls", "answer_ms"),
    [
        ("sync", 1, 0),
        ("sync", 3, 0),
        ("async", 1, 0),
        ("async", 10, 0),
        # 10 answers of 5 ms at one deadline take 50 ms, more than the 10 ms margin: the
        # reserve must grow with the guarded calls in flight (NodeGuard.enter).
        ("async", 10, 5),
        ("sync", 3, 5),
    ],
)
def test_a_guarded_call_to_no_node_is_answered_locally_within_its_budget(
    kind: str, calls: int, answer_ms: int, dead_endpoint: str
) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this tree before the installed one
    args = [kind, dead_endpoint, str(RULES), str(BUDGET_MS), str(calls), str(answer_ms / 1000)]
    run = subprocess.run(
        [sys.executable, "-c", FRESH_PROCESS, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    results = json.loads(run.stdout)
    assert len(results) == calls
    for took_ms, served_by, reason in results:
        assert (served_by, reason) == ("local", "node_unreachable")
        assert took_ms <= BUDGET_MS + ANSWER_MARGIN_MS, results


def test_closing_an_async_client_ends_its_pending_calls_at_once(
    silent_node: tuple[str, zmq.Socket[bytes]], dead_endpoint: str
) -> None:
    endpoint, router = silent_node

    async def scenario() -> None:
        client = AsyncClient(endpoint)  # no budget: each would wait wait_ms (120 s)
        guarded = AsyncClient(
            dead_endpoint, timeout_ms=30_000, fallback=RuleEngine.from_file(RULES)
        )
        stream = await client.stream_generate("a story")

        async def read_stream() -> list[str]:
            return [piece async for piece in stream]

        tasks = [
            asyncio.create_task(client.generate("hello")),
            asyncio.create_task(client.ping()),
            asyncio.create_task(read_stream()),
            asyncio.create_task(guarded.ping()),  # waiting for a connection to send on
        ]
        await asyncio.sleep(0)
        await asyncio.to_thread(received, router, 3)  # the stream, generate and ping
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in tasks)
        client.close()
        await guarded.aclose()
        _, pending = await asyncio.wait(tasks, timeout=1.0)
        assert not pending
        for task in tasks:
            exc = task.exception()
            assert isinstance(exc, ClientClosed) and isinstance(exc, Cancelled), exc
            assert "closed" in str(exc)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_closed_client_raises_client_closed(
    silent_node: tuple[str, zmq.Socket[bytes]],
) -> None:
    endpoint, _ = silent_node
    client = Client(endpoint, timeout_ms=BUDGET_MS)
    stream = client.stream_generate("a story")
    client.close()
    client.close()  # idempotent
    for call in (
        lambda: client.ping(),
        lambda: client.status(),
        lambda: client.generate("hi"),
        lambda: client.stream_chat([{"role": "user", "content": "hi"}]),
        lambda: client.cancel("x"),
        lambda: client.send({"op": "ping"}),
        lambda: list(stream),
    ):
        with pytest.raises(ClientClosed, match="closed"):
            call()


def test_a_closed_async_client_raises_client_closed_and_leaves_no_task_error(
    silent_node: tuple[str, zmq.Socket[bytes]],
) -> None:
    endpoint, _ = silent_node
    errors: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        async with AsyncClient(endpoint, timeout_ms=BUDGET_MS) as client:
            with pytest.raises(NoReply):
                await client.ping()  # the reader task runs
        for make in (
            client.ping,
            client.status,
            lambda: client.generate("hi"),
            lambda: client.stream_chat([{"role": "user", "content": "hi"}]),
            lambda: client.cancel("x"),
        ):
            with pytest.raises(ClientClosed, match="closed"):
                await make()
        await asyncio.sleep(0.05)
        gc.collect()  # an unretrieved task exception is reported when the task is freed
        await asyncio.sleep(0)

    asyncio.run(scenario())
    gc.collect()
    assert errors == []
