"""One client connection's side of the client conversation, sans I/O.

The state both client libraries (``broker.client.Client`` and ``AsyncClient``) keep
per connection: the ids they make up, the requests in flight and the replies
received for each and not read yet (an inbox per id). Building a request body,
filing a received reply and reading the next reply of a request (error replies
raised as their typed exception) are here, once; the clients only move frames
and wait. No sockets, no clock.
"""

from __future__ import annotations

import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from broker import protocol as p
from broker.client_request import check_request_id
from broker.errors import EdgeNodeError, ErrorCode, ProtocolError, error_from_wire

#: Extra wait beyond the request's own ``timeout_ms`` before a client without a
#: fallback gives up on the node itself (the node answers 504 at the deadline on
#: its own). A client with a fallback waits ``timeout_ms`` and no more.
REPLY_SLACK_MS = 2000

RequestId = str | int
#: Replies received for one request id and not read yet, oldest first.
Inbox = deque[dict[str, Any]]

#: ``Cancelled.reason`` of a request this client cancelled (the node's ``status``
#: counts the same cancels as ``cancelled_by_client``).
CLIENT_CANCEL_REASON = "cancelled_by_client"


def reply_error(reply: dict[str, Any]) -> EdgeNodeError:
    """The typed exception for an error reply body, with all its fields.

    ``code`` picks the class (unknown or missing: ``InternalError``); ``message``,
    ``reason``, ``retry_after_ms`` and ``text`` (as ``partial_text``) are copied
    when they have their documented types (PROTOCOL §4.4). A 499 has no ``reason`` on
    the wire (PROTOCOL §5.2) and comes only from this client's own ``cancel``: its
    ``reason`` is ``CLIENT_CANCEL_REASON``, so apps branch on ``reason`` as for any other.
    """
    code, retry, reason = reply.get("code"), reply.get("retry_after_ms"), reply.get("reason")
    text = reply.get("text")
    if code == ErrorCode.CANCELLED and not isinstance(reason, str):
        reason = CLIENT_CANCEL_REASON
    return error_from_wire(
        code if isinstance(code, int) else 500,
        str(reply.get("message", "")),
        retry if isinstance(retry, int) and not isinstance(retry, bool) else None,
        text if isinstance(text, str) else "",
        reason if isinstance(reason, str) else None,
    )


def dropped_partials(body: dict[str, Any]) -> int:
    """A reply's ``dropped_partials`` (PROTOCOL §10): 0 when absent or not a count."""
    count = body.get("dropped_partials", 0)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


@dataclass(frozen=True)
class Sent:
    """A request ready to send, or sent.

    Attributes:
        id: the request's id (the ``id=`` given, else one made up).
        body: the request body as sent (with ``id`` and any default ``timeout_ms``).
        data: ``body`` packed (msgpack), at most the client's ``max_body_bytes``.
        wait_ms: how long to wait for each of its replies (ms).
        box: its inbox, filled by ``Conversation.file`` once ``open``.
    """

    id: RequestId
    body: dict[str, Any]
    data: bytes
    wait_ms: int
    box: Inbox = field(default_factory=deque, compare=False)

    def frames(self) -> list[bytes]:
        """The DEALER frames that carry it: ``["", "EDGE/C1", body]``."""
        return [b"", p.CLIENT_TAG, self.data]


class Conversation:
    """Ids and inboxes of one client connection.

    Args:
        timeout_ms: default ``timeout_ms`` added to every request without one (None: none).
        wait_ms: wait per reply for a request without ``timeout_ms`` (ms).
        max_body_bytes: the node's ``broker.max_body_bytes`` (bytes).
        slack_ms: added to a request's ``timeout_ms`` to make its wait per reply
            (``REPLY_SLACK_MS``; 0 for a client with a fallback, which answers at the
            budget itself).
    """

    def __init__(
        self, *, timeout_ms: int | None, wait_ms: int, max_body_bytes: int, slack_ms: int
    ) -> None:
        self.timeout_ms = timeout_ms
        self.wait_ms = wait_ms
        self.max_body_bytes = max_body_bytes
        self.slack_ms = slack_ms
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}-"
        # One inbox per request in flight. A reply for another id than the one a
        # call waits for goes to that id's inbox: a cancel's wait must not eat
        # the target stream's 499, nor a ping a stream's partials.
        self._inboxes: dict[RequestId, Inbox] = {}

    def prepare(self, body: dict[str, Any], *, keep: bool = True) -> Sent:
        """Complete and pack ``body``: an ``id`` if missing or None, the default
        ``timeout_ms`` if any. Nothing is kept for it yet (``open``).

        ``keep``: the caller will ``open`` it, so an id in flight is refused.

        Raises:
            ProtocolError: an id the node would refuse (its 400 would carry ``id: nil``,
                which no inbox takes), or, with ``keep``, an id still in flight here
                (``reason`` ``"duplicate_id"``: the node's 400 would end that request),
                or a value msgpack cannot carry (``broker.protocol.pack``).
            TooLarge: the packed body is over ``max_body_bytes``.
        """
        body = dict(body)
        if body.get("id") is None:
            body["id"] = self._prefix + str(next(self._ids))
        rid = check_request_id("id", body["id"])
        if keep and rid in self._inboxes:
            raise ProtocolError(
                f"id {rid!r} is already in flight on this client", reason="duplicate_id"
            )
        if self.timeout_ms is not None:
            body.setdefault("timeout_ms", self.timeout_ms)
        budget = body.get("timeout_ms")
        wait = budget + self.slack_ms if isinstance(budget, int) else self.wait_ms
        data = p.pack(body)
        p.check_body_size(data, self.max_body_bytes)
        return Sent(rid, body, data, wait)

    def open(self, sent: Sent) -> None:
        """Keep replies for ``sent`` from now on, until its final is read or ``forget``."""
        self._inboxes[sent.id] = sent.box

    def forget(self, sent: Sent) -> None:
        """Stop keeping replies for ``sent`` (if its id is not in flight again by now,
        for a newer request)."""
        if self._inboxes.get(sent.id) is sent.box:
            del self._inboxes[sent.id]

    def file(self, frames: list[bytes]) -> RequestId | None:
        """Put a received reply in the inbox of its id; returns that id, or None when
        it was dropped (no inbox: a late reply to a request that timed out here, or
        one sent without keeping; or not a reply at all)."""
        if len(frames) != 3 or frames[1] != p.CLIENT_TAG:
            return None
        try:
            reply = p.unpack_map(frames[2])
        except ProtocolError:
            return None  # not from a node: nothing to file it under
        rid = reply.get("id")
        if isinstance(rid, (str, int)) and (box := self._inboxes.get(rid)) is not None:
            box.append(reply)
            return rid
        return None

    def take(self, sent: Sent) -> dict[str, Any] | None:
        """The oldest unread reply of ``sent`` (a ``partial`` or its final), None if
        there is none yet. After the final, the id is free again.

        Raises:
            EdgeNodeError: the reply is an error reply (its typed exception); final too.
        """
        if not sent.box:
            return None
        reply = sent.box.popleft()
        status = reply.get("status")
        if status != "partial":
            # Free the id before handing the final over: a finished stream kept
            # alive by its caller must not keep the id in flight.
            self.forget(sent)
        if status == "error":
            raise reply_error(reply)
        return reply

    def clear(self) -> None:
        """Forget every request (the connection is closed)."""
        self._inboxes.clear()
