"""Both client libraries behind one synchronous face, so one test runs on each.

``BlockingAsyncClient`` drives a real ``broker.client.AsyncClient`` from
synchronous test code: every call runs a private event loop until that call is
done, and a stream's pieces are its ``async for`` steps. Between calls the loop
is idle, as an app's loop is while it awaits something else: replies wait in
the socket until the client's reader task runs again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Literal, TypeVar

from broker.client import AsyncClient, AsyncStream, Client, Reply
from broker.client_guard import NodeGuard

T = TypeVar("T")
ClientKind = Literal["sync", "async"]
CLIENT_KINDS: tuple[ClientKind, ...] = ("sync", "async")


class BlockingAsyncStream:
    """An ``AsyncStream`` iterated from synchronous code (``id``, ``result`` and
    ``dropped_partials`` are the async stream's)."""

    def __init__(self, stream: AsyncStream, run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
        self._stream = stream
        self._run = run

    @property
    def id(self) -> str | int:
        return self._stream.id

    @property
    def result(self) -> Reply | None:
        return self._stream.result

    @property
    def dropped_partials(self) -> int:
        return self._stream.dropped_partials

    def __iter__(self) -> Iterator[str]:
        pieces = aiter(self._stream)
        while True:
            try:
                yield self._run(anext(pieces))
            except StopAsyncIteration:
                return


class BlockingAsyncClient:
    """``AsyncClient(endpoint, **kwargs)`` with ``Client``'s synchronous methods."""

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = AsyncClient(endpoint, **kwargs)

    @property
    def guard(self) -> NodeGuard | None:
        return self.client.guard

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def __enter__(self) -> BlockingAsyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()
        self._run(self.loop.shutdown_asyncgens())
        self._run(asyncio.sleep(0))  # let the cancelled reader task finish
        self.loop.close()

    def generate(self, prompt: str, **fields: Any) -> Reply:
        return self._run(self.client.generate(prompt, **fields))

    def chat(self, messages: list[dict[str, str]], **fields: Any) -> Reply:
        return self._run(self.client.chat(messages, **fields))

    def stream_generate(self, prompt: str, **fields: Any) -> BlockingAsyncStream:
        return BlockingAsyncStream(
            self._run(self.client.stream_generate(prompt, **fields)), self._run
        )

    def stream_chat(self, messages: list[dict[str, str]], **fields: Any) -> BlockingAsyncStream:
        return BlockingAsyncStream(
            self._run(self.client.stream_chat(messages, **fields)), self._run
        )

    def cancel(self, target: str | int) -> None:
        self._run(self.client.cancel(target))

    def ping(self) -> dict[str, Any]:
        return self._run(self.client.ping())

    def status(self) -> dict[str, Any]:
        return self._run(self.client.status())


AnyClient = Client | BlockingAsyncClient


def connect(kind: ClientKind, endpoint: str, **kwargs: Any) -> AnyClient:
    """A client of ``kind`` connected to ``endpoint`` (``Client``'s keyword arguments)."""
    return Client(endpoint, **kwargs) if kind == "sync" else BlockingAsyncClient(endpoint, **kwargs)
