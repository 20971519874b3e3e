"""The client library apps import: a synchronous DEALER client of the node.

    from broker.client import Client
    with Client("ipc:///tmp/edgenode-0/frontend.sock") as node:
        reply = node.chat([{"role": "user", "content": "Turn on the lights"}], max_tokens=32)
        print(reply.text, reply.usage)
        stream = node.stream_generate("Once upon a time", max_tokens=20)
        for piece in stream:
            print(piece, end="")
        print(stream.result.finish_reason)

Every request has an ``id`` (PROTOCOL §3.3): pass ``id=`` to choose it, else
the client makes one up (``"<pid in hex>-<n>"``); ``Stream.id`` and ``Reply.id``
tell it, and ``Client.cancel(id)`` takes it. One client can have several
requests in flight on its one socket (streams, plus a cancel, ping, status or
generate meanwhile): replies are filed by ``id``, each kept until the call
waiting for that id reads it.

Error replies raise the typed exceptions of ``broker.errors`` (``Overloaded``,
``Unavailable``, ``DeadlineExceeded``, ``Cancelled`` ...). Each carries the
error reply's fields: ``code`` (the HTTP-aligned ``ErrorCode``), ``reason``
(PROTOCOL §5.2, e.g. ``"queue_full"``; None when the reply has none),
``retry_after_ms`` (None when retrying later cannot help) and ``partial_text``
(text generated before the failure). Branch on ``reason``, not on the message.
Not thread-safe: use one ``Client`` per thread.
"""

from __future__ import annotations

import itertools
import math
import os
import time
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from broker import protocol as p
from broker.client_request import check_request_id
from broker.errors import EdgeNodeError, ProtocolError, Unavailable, error_from_wire

#: Extra wait beyond the request's own ``timeout_ms`` before the client gives
#: up on the node itself (the node answers 504 at the deadline on its own).
REPLY_SLACK_MS = 2000

RequestId = str | int
#: Replies received for one request id and not read yet, oldest first.
Inbox = deque[dict[str, Any]]
#: A request in flight: its id, how long to wait for each of its replies (ms), its inbox.
Sent = tuple[RequestId, int, Inbox]


def forget(inboxes: dict[RequestId, Inbox], rid: RequestId, box: Inbox) -> None:
    """Stop keeping replies for ``rid``, if ``box`` is still its inbox (the id may
    be in flight again by now, for a newer request)."""
    if inboxes.get(rid) is box:
        del inboxes[rid]


def reply_error(reply: dict[str, Any]) -> EdgeNodeError:
    """The typed exception for an error reply body, with all its fields.

    ``code`` picks the class (unknown or missing: ``InternalError``); ``message``,
    ``reason``, ``retry_after_ms`` and ``text`` (as ``partial_text``) are copied
    when they have their documented types (PROTOCOL §4.4).
    """
    code, retry, reason = reply.get("code"), reply.get("retry_after_ms"), reply.get("reason")
    text = reply.get("text")
    return error_from_wire(
        code if isinstance(code, int) else 500,
        str(reply.get("message", "")),
        retry if isinstance(retry, int) and not isinstance(retry, bool) else None,
        text if isinstance(text, str) else "",
        reason if isinstance(reason, str) else None,
    )


@dataclass(frozen=True)
class Reply:
    """A final ``ok`` reply. Times in ms; ``usage`` counts tokens.

    ``id`` is the request's id; ``raw`` the whole reply body (PROTOCOL §4.2),
    including the fields without an attribute (``worker``, ``degrade_reason``,
    the rule engine's ``confidence`` and ``rule``). ``dropped_partials``: how
    many of a stream's partials the node dropped because this client was not
    reading them fast enough (PROTOCOL §10); ``text`` is whole regardless.
    """

    id: RequestId
    text: str
    finish_reason: str
    usage: dict[str, int]
    served_by: str
    degraded: bool
    queue_ms: int
    ttft_ms: int
    total_ms: int
    raw: dict[str, Any] = field(repr=False)
    dropped_partials: int = 0

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
            dropped_partials=dropped_partials(body),
        )


def dropped_partials(body: dict[str, Any]) -> int:
    """A reply's ``dropped_partials`` (PROTOCOL §10): 0 when absent or not a count."""
    count = body.get("dropped_partials", 0)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


class Stream:
    """The text pieces of a streamed request, as they come.

    Iterating yields each ``partial`` reply's text (str) and stops after the
    final ``ok``, which sets ``result``; an error reply raises its typed
    exception from the iteration (``Cancelled`` after ``Client.cancel(stream.id)``).
    Iteration can stop and resume (``next(it)`` a few times, a ``ping``, more).

    A client that does not read a stream as fast as it comes loses pieces: the
    node drops partials it cannot queue for it (never the final reply). Then
    ``dropped_partials`` counts them, and the pieces yielded do not add up to
    the text: ``result.text`` is always the whole output.

    Attributes:
        id: the request's id: the ``id=`` given, else the one the client made up.
        result: the final ``Reply``; None until the stream ends with ``ok``.
        dropped_partials: partials of this stream the node dropped so far (0 if none).
    """

    def __init__(self, pieces: Iterator[tuple[str, int] | Reply], rid: RequestId) -> None:
        self._pieces = pieces
        self.id = rid
        self.result: Reply | None = None
        self.dropped_partials = 0

    def __iter__(self) -> Iterator[str]:
        for item in self._pieces:
            if isinstance(item, Reply):
                self.result = item
                self.dropped_partials = max(self.dropped_partials, item.dropped_partials)
                return
            text, dropped = item
            self.dropped_partials = max(self.dropped_partials, dropped)
            yield text


class Client:
    """Talks to a node's frontend endpoint over one DEALER socket.

    Args:
        endpoint: e.g. ``ipc:///tmp/edgenode-0/frontend.sock`` or ``tcp://127.0.0.1:5555``.
        timeout_ms: default request budget sent as ``timeout_ms`` (None: the node's default).
        wait_ms: how long to wait for each reply of a request that has no budget; with
            a budget, ``timeout_ms + REPLY_SLACK_MS``. Past it, the call raises
            ``Unavailable`` ("no reply ... is the node running?").
        max_body_bytes: the node's ``broker.max_body_bytes`` (bytes). A larger body
            raises ``TooLarge`` here, before anything is sent, in the node's own words
            (``body is N bytes, the limit is M``): above the node's socket cap
            libzmq drops the connection without a reply (PROTOCOL §2.3).

    The request methods take the protocol's fields as keywords (PROTOCOL §3.1):
    ``id`` (str of 1-128 characters or int in [0, 2**63); default ``"<pid in hex>-<n>"``;
    another raises ``ProtocolError`` before anything is sent),
    ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
    ``json_schema``, ``timeout_ms`` (ms), ``route``, ``priority``. An ``id`` that
    is still in flight on this client raises ``ProtocolError`` with ``reason``
    ``"duplicate_id"`` before anything is sent.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int | None = None,
        wait_ms: int = 120_000,
        max_body_bytes: int = p.DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.endpoint = endpoint
        self.max_body_bytes = max_body_bytes
        self.timeout_ms = timeout_ms
        self.wait_ms = wait_ms
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT and names that resolve to IPv6
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-"
        # One inbox per request in flight. A reply for another id than the one a
        # call waits for goes to that id's inbox: a cancel's wait must not eat
        # the target stream's 499, nor a ping a stream's partials.
        self._inboxes: dict[RequestId, Inbox] = {}

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (pending replies are dropped; requests still run on the node)."""
        self._sock.close(0)
        self._inboxes.clear()

    # ------------------------------------------------------------------ ops

    def generate(self, prompt: str, **fields: Any) -> Reply:
        """Complete ``prompt`` and return the final reply (``Reply.id`` is the request's id).

        ``fields`` are protocol fields (see the class docstring). Raises the typed
        exception of an error reply, ``Unavailable`` when no reply comes in time.
        """
        return self._final(self._start({"op": "generate", "prompt": prompt, **fields}))

    def chat(self, messages: list[dict[str, str]], **fields: Any) -> Reply:
        """Answer a chat (``[{"role": "user", "content": ...}]``) with the model's template.

        As ``generate`` otherwise.
        """
        return self._final(self._start({"op": "chat", "messages": messages, **fields}))

    def stream_generate(self, prompt: str, **fields: Any) -> Stream:
        """Like ``generate`` but returns a ``Stream`` that yields text as it is produced.

        The request is sent at once; ``Stream.id`` is its id, for ``cancel``.
        Errors are raised while iterating.
        """
        return self._stream({"op": "generate", "prompt": prompt, "stream": True, **fields})

    def stream_chat(self, messages: list[dict[str, str]], **fields: Any) -> Stream:
        """Like ``chat`` but returns a ``Stream``, as ``stream_generate`` does."""
        return self._stream({"op": "chat", "messages": messages, "stream": True, **fields})

    def cancel(self, target: RequestId) -> None:
        """Cancel a request of this client that is still in flight, by its id.

        The target's own final reply (499) comes first and is kept for it: the
        stream that reads it raises ``Cancelled`` with the text so far.

        Raises:
            NotFound: ``target`` is not in flight on this connection (unknown or
                already answered).
        """
        self.request({"op": "cancel", "target": target})

    def ping(self) -> dict[str, Any]:
        """Round trip to the broker (no worker involved): ``{id, status, pong, version}``."""
        return self.request({"op": "ping"})

    def status(self) -> dict[str, Any]:
        """The node's status map (workers, queue, counters; PROTOCOL §12)."""
        node: dict[str, Any] = self.request({"op": "status"})["node"]
        return node

    # ------------------------------------------------------------------ plumbing

    def send(self, body: dict[str, Any]) -> tuple[RequestId, int]:
        """Send a request body (an ``id`` is added if missing or None); returns (id, wait ms).

        Nothing is kept for it: its replies are dropped when some other call of
        this client reads the socket. Use the ops, or ``request``, to get them.

        Raises:
            TooLarge: the packed body is over ``max_body_bytes`` (nothing is sent).
        """
        body = dict(body)
        if body.get("id") is None:
            body["id"] = self._prefix + str(next(self._ids))
        if self.timeout_ms is not None:
            body.setdefault("timeout_ms", self.timeout_ms)
        wait = body["timeout_ms"] + REPLY_SLACK_MS if "timeout_ms" in body else self.wait_ms
        data = p.pack(body)
        p.check_body_size(data, self.max_body_bytes)
        self._sock.send_multipart([b"", p.CLIENT_TAG, data])
        rid: RequestId = body["id"]
        return rid, wait

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body`` and return its final reply body; raises on error replies."""
        for reply in self._raw_replies(self._start(body)):
            if reply["status"] != "partial":
                return reply
        raise AssertionError("unreachable")  # pragma: no cover

    def _start(self, body: dict[str, Any]) -> Sent:
        """Send ``body`` with an inbox kept for its id until its final reply is read."""
        body = dict(body)
        if body.get("id") is None:
            body["id"] = self._prefix + str(next(self._ids))
        # The broker's own rule: its 400 for a bad id carries ``id: nil``, which no
        # inbox would take, so the call would wait out its whole wait for nothing.
        rid = check_request_id("id", body["id"])
        if rid in self._inboxes:
            # The node would refuse it too, but its 400 would carry this same id
            # and end the request in flight instead (PROTOCOL §3.3).
            raise ProtocolError(
                f"id {rid!r} is already in flight on this client", reason="duplicate_id"
            )
        rid, wait = self.send(body)
        box: Inbox = deque()
        self._inboxes[rid] = box
        return rid, wait, box

    def _stream(self, body: dict[str, Any]) -> Stream:
        sent = self._start(body)
        stream = Stream(self._replies(sent), sent[0])
        # A stream dropped before it was ever iterated has no generator to close:
        # its inbox goes with the stream object.
        weakref.finalize(stream, forget, self._inboxes, sent[0], sent[2])
        return stream

    def _final(self, sent: Sent) -> Reply:
        for item in self._replies(sent):
            if isinstance(item, Reply):
                return item
        raise AssertionError("unreachable")  # pragma: no cover

    def _replies(self, sent: Sent) -> Iterator[tuple[str, int] | Reply]:
        """Each partial's (text, ``dropped_partials``), then the final ``Reply``."""
        for reply in self._raw_replies(sent):
            if reply["status"] == "partial":
                yield reply.get("text", ""), dropped_partials(reply)
            else:
                yield Reply.from_body(reply)

    def _raw_replies(self, sent: Sent) -> Iterator[dict[str, Any]]:
        """The replies to ``sent``, its final one last; an error reply is raised."""
        rid, wait_ms, box = sent
        try:
            while True:
                reply = self._next_reply(box, wait_ms)
                if reply.get("status") == "error":
                    raise reply_error(reply)
                if reply.get("status") != "partial":
                    # Free the id before handing the final over: a finished stream
                    # kept alive by its caller must not keep the id in flight.
                    forget(self._inboxes, rid, box)
                    yield reply
                    return
                yield reply
        finally:
            # Answered, failed, timed out or abandoned (the generator closed):
            # later replies for this id, e.g. after a local timeout, are dropped.
            forget(self._inboxes, rid, box)

    def _next_reply(self, box: Inbox, wait_ms: int) -> dict[str, Any]:
        """The oldest reply in ``box``, reading the socket until one arrives.

        Raises:
            Unavailable: none within ``wait_ms`` (replies for other ids do not count).
        """
        deadline = time.monotonic() + wait_ms / 1000
        while not box:
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms):
                raise Unavailable(
                    f"no reply from {self.endpoint} within {wait_ms} ms (is the node running?)"
                )
            self._file(self._sock.recv_multipart())
        return box.popleft()

    def _file(self, frames: list[bytes]) -> None:
        """Put a received reply in the inbox of its id; drop it if none is kept
        (a late reply to a request that timed out here, or one sent with ``send``)."""
        if len(frames) != 3 or frames[1] != p.CLIENT_TAG:
            return
        reply = p.unpack_map(frames[2])
        rid = reply.get("id")
        if isinstance(rid, (str, int)) and (box := self._inboxes.get(rid)) is not None:
            box.append(reply)
