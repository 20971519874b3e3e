"""Leaving a stream before its end cancels the request on the node: ``break``
out of the loop, ``close()``/``aclose()``, a ``with`` block, or dropping the
stream; the node's ``in_flight`` goes back to 0 long before the stream would
have ended. Real node, test engine (``!slow <ms>`` sets the per-token delay)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from broker.client import AsyncClient, Client
from node.testing import NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]

#: 1 + 40 pieces at 200 ms each (8 s): still running whenever a test looks.
SLOW = "!slow 200 " + " ".join(f"w{i}" for i in range(38))
WAIT_MS = 5000


def idle(c: Client) -> bool:
    return c.status()["in_flight"] == 0


def test_break_out_of_a_stream_cancels_it(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    with Client(node.frontend, wait_ms=WAIT_MS) as c:
        stream = c.stream_generate(SLOW, max_tokens=100)
        for piece in stream:
            assert piece == "echo:"
            break
        wait_for(lambda: idle(c), timeout=3)
        assert stream.result is None
        assert list(stream) == []  # left: nothing more comes
        assert c.generate("after", max_tokens=2).text == "echo: after"


def test_close_with_and_drop_cancel_a_stream(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1, "slots": 3})
    with Client(node.frontend, wait_ms=WAIT_MS) as c:
        closed = c.stream_generate(SLOW, max_tokens=100)
        pieces = iter(closed)  # held: a dropped iterator is a loop left
        assert next(pieces) == "echo:"
        with c.stream_generate(SLOW, max_tokens=100) as block:
            assert next(iter(block)) == "echo:"
        dropped = c.stream_generate(SLOW, max_tokens=100)  # never iterated
        wait_for(lambda: c.status()["in_flight"] == 2, timeout=3)  # the block's ended
        closed.close()
        del dropped
        gc.collect()
        wait_for(lambda: idle(c), timeout=3)
        assert c.generate("after", max_tokens=2).text == "echo: after"


def test_leaving_an_async_stream_cancels_it(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1, "slots": 2})

    async def main() -> None:
        async with AsyncClient(node.frontend, wait_ms=WAIT_MS) as c:
            stream = await c.stream_generate(SLOW, max_tokens=100)
            async for piece in stream:
                assert piece == "echo:"
                break
            other = await c.stream_generate(SLOW, max_tokens=100)
            async with other:
                async for _ in other:
                    break
            for _ in range(150):
                if (await c.status())["in_flight"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await c.status())["in_flight"] == 0
            assert stream.result is None and other.result is None
            assert (await c.generate("after", max_tokens=2)).text == "echo: after"

    asyncio.run(main())
