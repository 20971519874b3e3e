"""One request's course through a client, sans I/O (``Call``).

What both client libraries (``broker.client.Client`` and ``AsyncClient``) decide per
request, once: until when to wait for its next reply, what a reply, an error reply or
the lack of one means, and, for a defensive client, the local answer in the node's
place (``broker.client_guard.NodeGuard``). The clients only send, wait and read.
"""

from __future__ import annotations

from typing import Any

from broker import protocol as p
from broker.breaker import Permit
from broker.client_conversation import Conversation, Sent
from broker.client_guard import NodeGuard
from broker.errors import EdgeNodeError, NoReply
from broker.kinds import LocalDegradeReason


class Call:
    """One request's course through a client, sans I/O: when to stop waiting, what a
    reply, an error or the lack of one means, and the local answer in the node's place.

    Shared by ``Client`` and ``AsyncClient``, which only send, wait and read. ``t0`` and
    every ``now``: seconds of ``time.monotonic()``.

    Attributes:
        sent: the request.
        done: its final reply (the node's or a local one) has been handed out.
        ended: ``end`` has run (answered, failed, timed out or abandoned).
        reserve_ms: the end of its budget kept for local answers (ms; 0 unguarded):
            ``NodeGuard.enter()``, at most half of ``sent.wait_ms``.
    """

    def __init__(
        self,
        conv: Conversation,
        sent: Sent,
        t0: float,
        guard: NodeGuard | None = None,
        permit: Permit | None = None,
    ) -> None:
        self.conv = conv
        self.sent = sent
        self.t0 = t0
        self.guard = guard
        self.permit = permit
        self.done = False
        self.ended = False
        self._pieces = 0
        # With a guard the request's budget is one deadline for all its replies: a
        # control loop never waits longer than its ``timeout_ms``, the local answer's
        # time included, and that of the guarded calls in flight with it, which may
        # be answered at the same moment (``NodeGuard.enter``). Never more than half
        # the budget: the node keeps at least half, also with calls an app left open.
        self._entered = guard is not None
        reserve_ms = min(guard.enter(), sent.wait_ms // 2) if guard is not None else 0
        self.reserve_ms = reserve_ms
        self._deadline = t0 + max(0, sent.wait_ms - reserve_ms) / 1000

    def deadline(self, now: float) -> float:
        """Until when to wait for the next reply (a guarded call: the request's end,
        less the local answer's reserve; else ``wait_ms`` from now for each reply)."""
        return self._deadline if self.guard is not None else now + self.sent.wait_ms / 1000

    def send_deadline(self) -> float:
        """Until when to wait for the socket to take the request: ``wait_ms`` from the
        call's start (a guarded call: its deadline). A node that is missing, frozen
        or unreachable must not hold a call past its budget at the send."""
        return self._deadline

    def replied(self, reply: dict[str, Any], now: float) -> list[dict[str, Any]]:
        """The reply bodies to hand out for a reply of the node (``Conversation.take``)."""
        if reply.get("status") == "partial":
            self._pieces += 1
            return [reply]
        self.done = True
        if self.guard is not None and self.permit is not None:
            self.guard.succeeded(self.permit, now)
        return [reply]

    def failed(self, exc: EdgeNodeError, now: float) -> list[dict[str, Any]]:
        """The node's error reply ``exc``: a guarded call answers locally if the node
        failed to serve (500, 503, 504).

        Raises:
            EdgeNodeError: ``exc``, when it is the request's own or there is no guard.
        """
        self.done = True
        if self.guard is None or self.permit is None:
            raise exc
        reason = self.guard.failed(self.permit, now, exc)
        if reason is None:
            raise exc
        # A timeout is the client's own verdict: no reply of the node to report.
        return self.local(reason, now, None if reason == "node_timeout" else exc)

    def timed_out(self, now: float, endpoint: str) -> list[dict[str, Any]]:
        """No reply by ``deadline``: a guarded call answers locally (``node_timeout``).

        Raises:
            NoReply: without a guard.
        """
        exc = NoReply(
            f"no reply from {endpoint} within {self.sent.wait_ms} ms (is the node running?)"
        )
        return self.failed(exc, now)

    def unreachable(self, now: float) -> list[dict[str, Any]]:
        """A guarded call found no connection to send on in time."""
        assert self.guard is not None and self.permit is not None
        return self.local(self.guard.unreachable(self.permit, now), now)

    def local(
        self, reason: LocalDegradeReason, now: float, node_error: EdgeNodeError | None = None
    ) -> list[dict[str, Any]]:
        """The fallback's answer as the final (after it, as one partial, if this is a
        stream that has had no piece from the node yet)."""
        assert self.guard is not None
        self.done = True
        total_ms = round((now - self.t0) * 1000)
        final = self.guard.local_reply(self.sent.body, reason, total_ms, node_error)
        if self.sent.body.get("stream") and not self._pieces:
            return [p.partial_reply(self.sent.id, final["text"], 0), final]
        return [final]

    def end(self, now: float) -> None:
        """Answered, failed, timed out or abandoned: later replies for the id are dropped,
        and a permit without a verdict (abandoned, task cancelled) goes back. Once:
        later calls do nothing."""
        if self.ended:
            return
        self.ended = True
        self.conv.forget(self.sent)
        if self.guard is not None and self._entered:
            self._entered = False
            self.guard.leave()
        if self.guard is not None and self.permit is not None:
            self.guard.released(self.permit, now)
