"""The client library apps import: a synchronous DEALER client of the node.

    from broker.client import Client
    with Client("ipc:///tmp/edgenode-0/frontend.sock") as node:
        reply = node.chat([{"role": "user", "content": "Turn on the lights"}], max_tokens=32)
        print(reply.text, reply.usage)
        stream = node.stream_generate("Once upon a time", max_tokens=20)
        for piece in stream:
            print(piece, end="")
        print(stream.result.finish_reason)

Error replies raise the typed exceptions of ``broker.errors`` (``Overloaded``,
``Unavailable``, ``DeadlineExceeded`` ...), each carrying ``retry_after_ms`` and
any partial text. Not thread-safe: use one ``Client`` per thread.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from broker import protocol as p
from broker.errors import Unavailable, error_from_wire

#: Extra wait beyond the request's own ``timeout_ms`` before the client gives
#: up on the node itself (the node answers 504 at the deadline on its own).
REPLY_SLACK_MS = 2000


@dataclass(frozen=True)
class Reply:
    """A final ``ok`` reply. Times in ms; ``usage`` counts tokens."""

    id: str | int
    text: str
    finish_reason: str
    usage: dict[str, int]
    served_by: str
    degraded: bool
    queue_ms: int
    ttft_ms: int
    total_ms: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Reply:
        """Build from a reply body with ``status: ok``."""
        return cls(
            id=body["id"],
            text=body.get("text", ""),
            finish_reason=body.get("finish_reason", ""),
            usage=body.get("usage", {}),
            served_by=body.get("served_by", ""),
            degraded=bool(body.get("degraded", False)),
            queue_ms=body.get("queue_ms", 0),
            ttft_ms=body.get("ttft_ms", 0),
            total_ms=body.get("total_ms", 0),
            raw=body,
        )


class Stream:
    """Iterates the text pieces of a streamed request; ``result`` is set at the end."""

    def __init__(self, pieces: Iterator[str | Reply]) -> None:
        self._pieces = pieces
        self.result: Reply | None = None

    def __iter__(self) -> Iterator[str]:
        for item in self._pieces:
            if isinstance(item, Reply):
                self.result = item
                return
            yield item


class Client:
    """Talks to a node's frontend endpoint.

    Args:
        endpoint: e.g. ``ipc:///tmp/edgenode-0/frontend.sock`` or ``tcp://127.0.0.1:5555``.
        timeout_ms: default request budget sent as ``timeout_ms`` (None: the node's default).
        wait_ms: how long to wait for a reply when the request has no budget.
    """

    def __init__(
        self, endpoint: str, *, timeout_ms: int | None = None, wait_ms: int = 120_000
    ) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self.wait_ms = wait_ms
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (pending replies are dropped)."""
        self._sock.close(0)

    # ------------------------------------------------------------------ ops

    def generate(self, prompt: str, **fields: Any) -> Reply:
        """Complete ``prompt``; ``fields`` are protocol fields (max_tokens, temperature ...)."""
        return self._final(self.send({"op": "generate", "prompt": prompt, **fields}))

    def chat(self, messages: list[dict[str, str]], **fields: Any) -> Reply:
        """Answer a chat (``[{"role": "user", "content": ...}]``) with the model's template."""
        return self._final(self.send({"op": "chat", "messages": messages, **fields}))

    def stream_generate(self, prompt: str, **fields: Any) -> Stream:
        """Like ``generate`` but yields text as it is produced."""
        body = {"op": "generate", "prompt": prompt, "stream": True, **fields}
        return Stream(self._replies(self.send(body)))

    def stream_chat(self, messages: list[dict[str, str]], **fields: Any) -> Stream:
        """Like ``chat`` but yields text as it is produced."""
        body = {"op": "chat", "messages": messages, "stream": True, **fields}
        return Stream(self._replies(self.send(body)))

    def cancel(self, target: str | int) -> None:
        """Cancel an in-flight request of this client by its id; raises ``NotFound``."""
        self.request({"op": "cancel", "target": target})

    def ping(self) -> dict[str, Any]:
        """Round trip to the broker (no worker involved)."""
        return self.request({"op": "ping"})

    def status(self) -> dict[str, Any]:
        """The node's status map (workers, queue, counters)."""
        node: dict[str, Any] = self.request({"op": "status"})["node"]
        return node

    # ------------------------------------------------------------------ plumbing

    def send(self, body: dict[str, Any]) -> tuple[str | int, int]:
        """Send a request body (an ``id`` is added if missing); returns (id, wait ms)."""
        body = dict(body)
        body.setdefault("id", self._prefix + str(next(self._ids)))
        if self.timeout_ms is not None:
            body.setdefault("timeout_ms", self.timeout_ms)
        wait = body["timeout_ms"] + REPLY_SLACK_MS if "timeout_ms" in body else self.wait_ms
        self._sock.send_multipart([b"", p.CLIENT_TAG, p.pack(body)])
        rid: str | int = body["id"]
        return rid, wait

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body`` and return the final reply body; raises on error replies."""
        for reply in self._raw_replies(self.send(body)):
            if reply["status"] != "partial":
                return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _final(self, sent: tuple[str | int, int]) -> Reply:
        for item in self._replies(sent):
            if isinstance(item, Reply):
                return item
        raise AssertionError("unreachable")  # pragma: no cover

    def _replies(self, sent: tuple[str | int, int]) -> Iterator[str | Reply]:
        for reply in self._raw_replies(sent):
            if reply["status"] == "partial":
                yield reply.get("text", "")
            else:
                yield Reply.from_body(reply)

    def _raw_replies(self, sent: tuple[str | int, int]) -> Iterator[dict[str, Any]]:
        rid, wait_ms = sent
        while True:
            if not self._sock.poll(wait_ms):
                raise Unavailable(
                    f"no reply from {self.endpoint} within {wait_ms} ms (is the node running?)"
                )
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != p.CLIENT_TAG:
                continue
            reply = p.unpack_map(frames[2])
            if reply.get("id") != rid:
                continue  # a late reply to an earlier request that timed out here
            if reply.get("status") == "error":
                raise error_from_wire(
                    int(reply.get("code", 500)),
                    str(reply.get("message", "")),
                    reply.get("retry_after_ms"),
                    reply.get("text", ""),
                )
            yield reply
            if reply.get("status") != "partial":
                return
