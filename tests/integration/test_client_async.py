"""``AsyncClient`` in a real event loop: cancelling the awaiting task cancels the
request on the node, and several tasks share one client.

Real node, test engine, one one-slot worker; ``SLOW`` runs ~3 s. That the node saw
the cancel is read from its counters (``cancelled_by_client``, never ``client_gone``,
which a client that only dropped its wait would leave behind on disconnect) and from
the request being gone on the node (a second ``cancel`` finds nothing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from broker.client import AsyncClient
from broker.errors import NotFound
from node.testing import NodeProcess

NodeFactory = Callable[..., NodeProcess]

SLOW = "!slow 100 " + " ".join(f"w{i}" for i in range(28))
WAIT_MS = 5000


async def until_in_flight(client: AsyncClient, count: int) -> dict[str, Any]:
    """The node's status once ``count`` requests run on its workers (5 s at most)."""
    for _ in range(250):
        status = await client.status()
        if status["in_flight"] == count:
            return status
        await asyncio.sleep(0.02)
    raise AssertionError(f"in_flight never reached {count}: {status}")


async def cancel_and_check(client: AsyncClient, task: asyncio.Task[Any], rid: str) -> None:
    await until_in_flight(client, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await until_in_flight(client, 0)
    assert status["counters"].get("cancelled_by_client") == 1
    assert "client_gone" not in status["counters"]
    with pytest.raises(NotFound):  # the request is over on the node, not left running
        await client.cancel(rid)
    # The one worker is free again for the next request.
    reply = await client.generate("next", max_tokens=2)
    assert reply.text == "echo: next"


def test_cancelling_the_task_awaiting_generate_cancels_it_on_the_node(
    make_node: NodeFactory,
) -> None:
    node = make_node(workers={"count": 1})

    async def main() -> None:
        async with AsyncClient(node.frontend, wait_ms=WAIT_MS) as c:
            task = asyncio.create_task(c.generate(SLOW, max_tokens=100, id="long"))
            await cancel_and_check(c, task, "long")

    asyncio.run(main())


def test_a_wait_for_timeout_cancels_the_request_on_the_node(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})

    async def main() -> None:
        async with AsyncClient(node.frontend, wait_ms=WAIT_MS) as c:
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.generate(SLOW, max_tokens=100, id="late"), 0.5)
            status = await until_in_flight(c, 0)
            assert status["counters"].get("cancelled_by_client") == 1
            with pytest.raises(NotFound):
                await c.cancel("late")

    asyncio.run(main())


def test_cancelling_the_task_reading_a_stream_cancels_it_on_the_node(
    make_node: NodeFactory,
) -> None:
    node = make_node(workers={"count": 1})
    pieces: list[str] = []

    async def main() -> None:
        async with AsyncClient(node.frontend, wait_ms=WAIT_MS) as c:

            async def read() -> None:
                async for piece in await c.stream_chat(
                    [{"role": "user", "content": SLOW}], max_tokens=100, id="story"
                ):
                    pieces.append(piece)

            task = asyncio.create_task(read())
            while not pieces and not task.done():  # cancel it while it streams
                await asyncio.sleep(0.01)
            await cancel_and_check(c, task, "story")

    asyncio.run(main())
    assert pieces and pieces[0] == "echo:"  # it was streaming when cancelled


def test_tasks_share_one_client_and_each_gets_its_own_reply(make_node: NodeFactory) -> None:
    node = make_node()

    async def main() -> list[str]:
        async with AsyncClient(node.frontend, wait_ms=WAIT_MS) as c:
            replies = await asyncio.gather(
                *(c.generate(f"!slow 20 n{i}", max_tokens=4) for i in range(6)),
                c.ping(),
            )
            return [r.text for r in replies[:-1]]

    assert asyncio.run(main()) == [f"echo: !slow 20 n{i}" for i in range(6)]
