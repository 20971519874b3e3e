"""The client library apps import: DEALER clients of the node, synchronous and asyncio.

    from broker.client import Client
    with Client("ipc:///tmp/edgenode-0/frontend.sock") as node:
        reply = node.chat([{"role": "user", "content": "Turn on the lights"}], max_tokens=32)
        print(reply.text, reply.usage)
        stream = node.stream_generate("Once upon a time", max_tokens=20)
        for piece in stream:
            print(piece, end="")
        print(stream.result.finish_reason)

    from broker.client import AsyncClient
    async with AsyncClient(endpoint) as node:
        reply = await node.generate("Turn on the lights", timeout_ms=200)
        async for piece in node.stream_generate("Once upon a time"):
            ...

Every request has an ``id`` (PROTOCOL §3.3): pass ``id=`` to choose it, else
the client makes one up (``"<pid in hex>-<n>"``); ``Stream.id`` and ``Reply.id``
tell it, and ``cancel(id)`` takes it. One client can have several requests in
flight on its one socket (streams, plus a cancel, ping, status or generate
meanwhile): replies are filed by ``id``, each kept until the call waiting for
that id reads it (``broker.client_conversation``, shared by both clients).
``AsyncClient``: cancelling the task that awaits a request (or iterates a
stream) sends the node a ``cancel`` for it.

Error replies raise the typed exceptions of ``broker.errors`` (``Overloaded``,
``Unavailable``, ``DeadlineExceeded``, ``Cancelled`` ...). Each carries the
error reply's fields: ``code`` (the HTTP-aligned ``ErrorCode``), ``reason``
(PROTOCOL §5.2, e.g. ``"queue_full"``; None when the reply has none),
``retry_after_ms`` (None when retrying later cannot help) and ``partial_text``
(text generated before the failure). Branch on ``reason``, not on the message.
No reply in time raises ``NoReply`` (an ``Unavailable``).

The defensive client: ``fallback=`` (e.g. ``fallback.engine.RuleEngine``) makes
``generate``/``chat`` and their streams answer locally, with ``degraded: true``
and ``served_by: "local"``, when the node does not answer within the request's
``timeout_ms`` or the client's circuit breaker over the node is open
(``broker.client_guard``). Not thread-safe: use one client per thread (one
``AsyncClient`` per event loop); a ``Client`` called from a second thread while
another thread's call is using it raises ``ClientInUse``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import threading
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import zmq
import zmq.asyncio
from zmq.utils.z85 import Z85CHARS

from broker import protocol as p
from broker.breaker import BreakerSettings
from broker.client_call import Call
from broker.client_conversation import (
    REPLY_SLACK_MS,
    Conversation,
    RequestId,
    Sent,
    dropped_partials,
)
from broker.client_guard import LocalFallback, make_guard
from broker.errors import ClientClosed, ConfigError, EdgeNodeError, NoReply, ProtocolError


@dataclass(frozen=True)
class Reply:
    """A final ``ok`` reply. Times in ms; ``usage`` counts tokens.

    ``id`` is the request's id; ``raw`` the whole reply body (PROTOCOL §4.2),
    including the fields without an attribute (``worker``, the rule engine's
    ``confidence`` and ``rule``, a local answer's ``node_error``).
    ``dropped_partials``: how many of a stream's partials the node dropped
    because this client was not reading them fast enough (PROTOCOL §10); ``text``
    is whole regardless. ``degrade_reason``: why the model did not answer when
    ``degraded`` (the node's reasons, PROTOCOL §7.3, or with ``served_by:
    "local"`` the defensive client's, ``broker.kinds.LocalDegradeReason``).
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
    degrade_reason: str | None = None

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Reply:
        """Build from a reply body with ``status: ok``."""
        reason = body.get("degrade_reason")
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
            degrade_reason=reason if isinstance(reason, str) else None,
        )


class Stream:
    """The text pieces of a streamed request, as they come.

    Iterating yields each ``partial`` reply's text (str) and stops after the
    final ``ok``, which sets ``result``; an error reply raises its typed
    exception from the iteration (``Cancelled`` after ``Client.cancel(stream.id)``).
    Iteration can pause and resume on one iterator (``it = iter(stream)``; ``next(it)``
    a few times, a ``ping``, more).

    Leaving the stream before its end cancels the request on the node (a ``cancel``
    sent without waiting; its 499 is dropped): ``break`` out of ``for piece in
    stream`` (the loop's iterator is closed), ``close()``, the end of a ``with
    stream:`` block, dropping the last reference to the stream, or an exception
    raised while it waits for a reply (Ctrl-C, a signal handler's). An iteration
    after that yields nothing and ``result`` stays None.

    A client that does not read a stream as fast as it comes loses pieces: the
    node drops partials it cannot queue for it (never the final reply). Then
    ``dropped_partials`` counts them, and the pieces yielded do not add up to
    the text: ``result.text`` is always the whole output. A defensive client's
    local answer comes as one piece if the node sent none, else only as ``result``.

    Attributes:
        id: the request's id: the ``id=`` given, else the one the client made up.
        result: the final ``Reply``; None until the stream ends with ``ok``.
        dropped_partials: partials of this stream the node dropped so far (0 if none).
    """

    def __init__(
        self,
        bodies: Iterator[dict[str, Any]],
        rid: RequestId,
        abandon: Callable[[], None] = lambda: None,
    ) -> None:
        # ``abandon``: cancels the request on the node unless it has ended (idempotent).
        self._bodies = bodies
        self._abandon = abandon
        self.id = rid
        self.result: Reply | None = None
        self.dropped_partials = 0

    def __iter__(self) -> Iterator[str]:
        try:
            for body in self._bodies:
                if (text := self._take(body)) is None:
                    return
                yield text
        except GeneratorExit:  # the loop was left (break) or the iterator closed
            self.close()
            raise

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading the stream; if it has not ended, cancel the request on the
        node. Idempotent; a no-op after the final reply."""
        close = getattr(self._bodies, "close", None)
        if close is not None:
            close()
        self._abandon()  # also a stream never iterated (its generator never started)

    def _take(self, body: dict[str, Any]) -> str | None:
        """A partial's text, or None after filing the final as ``result``."""
        self.dropped_partials = max(self.dropped_partials, dropped_partials(body))
        if body.get("status") == "partial":
            text = body.get("text", "")
            return text if isinstance(text, str) else ""
        self.result = Reply.from_body(body)
        return None


class AsyncStream(Stream):
    """``Stream`` for ``AsyncClient``: iterate with ``async for``.

    Cancelling the task iterating it cancels the request on the node, and so does
    leaving it before its end: ``break`` out of ``async for`` (the loop closes its
    iterator soon after, through the event loop's async generator hooks), ``await
    stream.aclose()``, the end of an ``async with stream:`` block, or dropping the
    stream. The same attributes as ``Stream``.
    """

    def __init__(
        self,
        bodies: AsyncGenerator[dict[str, Any], None],
        rid: RequestId,
        abandon: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(iter(()), rid, abandon)
        self._abodies = bodies

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[str]:
        try:
            async for body in self._abodies:
                if (text := self._take(body)) is None:
                    return
                yield text
        except GeneratorExit:  # the loop was left (break) or the iterator closed
            await self.aclose()
            raise

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """As ``Stream.close``."""
        await self._abodies.aclose()
        self._abandon()


#: The length of a z85-encoded CURVE key (bytes): 32 bytes of key, 5 characters per 4.
Z85_KEY_BYTES = 40


def check_key(name: str, key: object) -> bytes:
    """``key`` if it is a z85-encoded CURVE key (40 bytes of the z85 alphabet).

    Raises:
        ConfigError: naming ``name``, for a ``str`` (pass ``key.encode()``), None, another
            type, another length or a character outside z85.
    """
    if not isinstance(key, bytes):
        hint = " (encode it: key.encode())" if isinstance(key, str) else ""
        raise ConfigError(
            f"{name} must be a z85 CURVE key as bytes (40), not {type(key).__name__}{hint}"
        )
    if len(key) != Z85_KEY_BYTES or not set(key) <= set(Z85CHARS):
        raise ConfigError(
            f"{name} must be a z85 CURVE key: {Z85_KEY_BYTES} bytes of the z85 alphabet, "
            f"as zmq.auth.load_certificate returns (got {len(key)} bytes)"
        )
    return key


def client_socket(
    ctx: zmq.Context[Any],
    endpoint: str,
    server_public_key: bytes | None,
    client_keypair: tuple[bytes, bytes] | None,
    immediate: bool,
) -> Any:
    """A DEALER of ``ctx`` connected to ``endpoint``, with CURVE if ``server_public_key``.

    Keys are z85 (40 bytes), as ``zmq.auth.load_certificate`` returns them. Without
    ``client_keypair`` the client makes an ephemeral pair: valid CURVE (encrypted) for a
    server that accepts any client key (``zmq.auth``'s ``CURVE_ALLOW_ANY``, the guide's
    "Stonehouse"), but an edgenode node allows only listed keys ("Ironhouse") and
    never answers it (``NoReply``). ``immediate``: queue messages only on a completed connection
    (ZMQ_IMMEDIATE), so a defensive client sees at once that the node is not there
    instead of queueing requests the node would run on its return.

    Raises:
        ConfigError: ``client_keypair`` without ``server_public_key``, or a key that is
            not z85 bytes of 40 (``check_key``; the message names the argument), or a
            ``client_keypair`` that is not a (public, secret) pair.
    """
    if client_keypair is not None and server_public_key is None:
        raise ConfigError("client_keypair needs server_public_key (the node's CURVE public key)")
    if server_public_key is not None:
        server_public_key = check_key("server_public_key", server_public_key)
    if client_keypair is not None:
        if not isinstance(client_keypair, tuple) or len(client_keypair) != 2:
            raise ConfigError("client_keypair must be a (public, secret) tuple of z85 keys")
        client_keypair = (
            check_key("client_keypair[0] (public)", client_keypair[0]),
            check_key("client_keypair[1] (secret)", client_keypair[1]),
        )
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT and names that resolve to IPv6
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if server_public_key is not None:
        public, secret = client_keypair if client_keypair is not None else zmq.curve_keypair()
        sock.curve_serverkey = server_public_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.connect(endpoint)
    return sock


class _Base:
    """What both clients hold: the endpoint, the conversation and the guard."""

    def __init__(
        self,
        endpoint: str,
        timeout_ms: int | None,
        wait_ms: int,
        max_body_bytes: int,
        fallback: LocalFallback | None,
        breaker: BreakerSettings | None,
    ) -> None:
        self.endpoint = endpoint
        self.guard = make_guard(fallback, breaker, timeout_ms)
        self.closed = False
        guarded = self.guard is not None
        self._conv = Conversation(
            timeout_ms=timeout_ms,
            wait_ms=timeout_ms if guarded and timeout_ms is not None else wait_ms,
            max_body_bytes=max_body_bytes,
            slack_ms=0 if guarded else REPLY_SLACK_MS,
        )

    def _check_open(self) -> None:
        """Raises ``ClientClosed`` once ``close`` was called."""
        if self.closed:
            raise ClientClosed(f"the client of {self.endpoint} is closed", reason="client_closed")

    def _no_send(self, sent: Sent) -> NoReply:
        """The ``NoReply`` of a request the socket did not take within its wait."""
        return NoReply(
            f"could not send to {self.endpoint} within {sent.wait_ms} ms (is the node running?)"
        )

    def _begin(self, body: dict[str, Any], guarded: bool) -> Call:
        """A ``Call`` for ``body``, not sent yet. ``guarded``: a ``generate``/``chat``
        that a guard may answer locally (it takes the breaker's permit now; None: open).

        Raises:
            ClientClosed: the client is closed.
        """
        self._check_open()
        now = time.monotonic()
        if self.guard is None or not guarded:
            sent = self._conv.prepare(body)
            self._conv.open(sent)
            return Call(self._conv, sent, now)
        sent = self._conv.prepare(body)
        permit = self.guard.admit(now)
        call = Call(self._conv, sent, now, self.guard, permit)
        if permit is not None:
            self._conv.open(sent)
        return call


class ClientInUse(ProtocolError):
    """A ``Client`` was called from a second thread while another thread's call was
    using its socket. A ``Client`` is not thread-safe (one ZeroMQ socket, which must
    not be used from two threads at once; shared, replies get lost): give each thread
    its own ``Client``. ``reason`` is ``"client_in_use"``; never sent on the wire."""


class Client(_Base):
    """Talks to a node's frontend endpoint over one DEALER socket.

    Args:
        endpoint: e.g. ``ipc:///tmp/edgenode-0/frontend.sock`` or ``tcp://127.0.0.1:5555``.
        timeout_ms: default request budget sent as ``timeout_ms`` (None: the node's default).
        wait_ms: how long to wait for each reply of a request that has no budget; with
            a budget, ``timeout_ms + REPLY_SLACK_MS`` (with a fallback: ``timeout_ms``).
            Past it, the call raises ``NoReply`` ("no reply ... is the node running?").
        max_body_bytes: the node's ``broker.max_body_bytes`` (bytes). A larger body
            raises ``TooLarge`` here, before anything is sent, in the node's own words
            (``body is N bytes, the limit is M``): above the node's socket cap
            libzmq drops the connection without a reply (PROTOCOL §2.3).
        server_public_key: the node's CURVE public key (z85, 40 bytes), for a node that
            requires CURVE (``[security]``); None: plain connection.
        client_keypair: this client's CURVE ``(public, secret)`` (z85, as
            ``zmq.auth.load_certificate`` returns); its public key must be in the node's
            allowed keys. None with a server key: an ephemeral pair, which a node
            (it allows only listed keys) never answers; only a server that accepts any
            key (``zmq.auth.CURVE_ALLOW_ANY``) would.
        fallback: answers ``generate``/``chat`` locally when the node does not within
            the request's ``timeout_ms`` or the breaker is open (``broker.client_guard``;
            e.g. ``fallback.engine.RuleEngine.from_file(rules)``). Needs ``timeout_ms``,
            which must exceed the node's own latency budget plus transport: a node's
            degraded answer comes at its ``routing.ttft_budget_ms`` (default 200) plus a
            few ms, so a client with ``timeout_ms`` equal to it always times out and
            opens its breaker against a healthy node (e.g. node 150 ms, client 200 ms).
            The fallback is warmed up here and its answer time kept out of the node's
            share of the budget (``NodeGuard.reserve_ms``).
        breaker: the client's breaker over the node (default
            ``broker.client_guard.CLIENT_BREAKER``); only with ``fallback``.

    The request methods take the protocol's fields as keywords (PROTOCOL §3.1):
    ``id`` (str of 1-128 characters or int in [0, 2**63); default ``"<pid in hex>-<n>"``;
    another raises ``ProtocolError`` before anything is sent),
    ``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
    ``json_schema``, ``timeout_ms`` (ms), ``route``, ``priority``, ``cache_prompt``
    (bool; False: no prompt prefix reuse, for reproducible greedy answers). An ``id`` that
    is still in flight on this client raises ``ProtocolError`` with ``reason``
    ``"duplicate_id"`` before anything is sent.

    Every call waits for the socket to take its request at most its budget
    (``timeout_ms``, else ``wait_ms``) and raises ``NoReply`` past it: with a fallback
    the socket sends only on a live connection, so a node that is missing or frozen is
    seen at once. After ``close`` every call raises ``ClientClosed`` (a ``Cancelled``).

    Raises:
        ConfigError: keys or fallback settings that do not go together, or a key that
            is not 40 bytes of z85 (``client_socket``, ``make_guard``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int | None = None,
        wait_ms: int = 120_000,
        max_body_bytes: int = p.DEFAULT_MAX_BODY_BYTES,
        server_public_key: bytes | None = None,
        client_keypair: tuple[bytes, bytes] | None = None,
        fallback: LocalFallback | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_ms, wait_ms, max_body_bytes, fallback, breaker)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] = client_socket(
            self._ctx, endpoint, server_public_key, client_keypair, self.guard is not None
        )
        # Held while a call uses the socket; reentrant: a finalizer of this thread (a
        # dropped stream's cancel) may send between two of its own reads.
        self._using = threading.RLock()
        self._user: str | None = None

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the socket for this thread.

        Raises:
            ClientInUse: another thread's call is using it now.
        """
        if not self._using.acquire(blocking=False):
            raise ClientInUse(
                f"the Client of {self.endpoint} was called from thread "
                f"{threading.current_thread().name!r} while thread {self._user!r} was using "
                "it: a Client is not thread-safe; give each thread its own Client",
                reason="client_in_use",
            )
        outer, self._user = self._user, threading.current_thread().name
        try:
            yield
        finally:
            self._user = outer
            self._using.release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket (pending replies are dropped; requests still run on the node).

        Idempotent. Afterwards every call, and the iteration of a stream still open,
        raises ``ClientClosed``.
        """
        if self.closed:
            return
        self.closed = True
        self._sock.close(0)
        self._conv.clear()

    # ------------------------------------------------------------------ ops

    def generate(self, prompt: str, **fields: Any) -> Reply:
        """Complete ``prompt`` and return the final reply (``Reply.id`` is the request's id).

        ``fields`` are protocol fields (see the class docstring). Raises the typed
        exception of an error reply, ``NoReply`` when no reply comes in time (with a
        fallback: answers locally instead, see the class docstring).
        """
        return self._final({"op": "generate", "prompt": prompt, **fields})

    def chat(self, messages: list[dict[str, str]], **fields: Any) -> Reply:
        """Answer a chat (``[{"role": "user", "content": ...}]``) with the model's template.

        As ``generate`` otherwise.
        """
        return self._final({"op": "chat", "messages": messages, **fields})

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
            NoReply: the socket did not take it within its wait (no connection).
            ClientClosed: the client is closed.
        """
        self._check_open()
        sent = self._conv.prepare(body, keep=False)
        if not self._post(sent, time.monotonic() + sent.wait_ms / 1000):
            raise self._no_send(sent)
        return sent.id, sent.wait_ms

    def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body`` and return its final reply body; raises on error replies.

        Never answered locally, even with a fallback (its wait is ``timeout_ms`` then).
        """
        bodies = self._bodies(self._begin(body, guarded=False))
        return [b for b in bodies if b.get("status") != "partial"][-1]

    def _final(self, body: dict[str, Any]) -> Reply:
        for item in self._bodies(self._begin(body, guarded=True)):
            if item.get("status") != "partial":
                return Reply.from_body(item)
        raise AssertionError("unreachable")  # pragma: no cover

    def _stream(self, body: dict[str, Any]) -> Stream:
        call = self._begin(body, guarded=True)
        bodies = self._bodies(call)
        abandon = functools.partial(self._abandon, call)
        stream = Stream(bodies, call.sent.id, abandon)
        # A stream dropped before it was ever iterated has no generator to close:
        # its inbox and permit go with the stream object, and its request is cancelled.
        weakref.finalize(stream, abandon)
        return stream

    def _abandon(self, call: Call) -> None:
        """Cancel ``call`` on the node if it has not ended, and end it."""
        if not call.done and not call.ended and not self.closed:
            self._cancel_on_node(call.sent.id)
        call.end(time.monotonic())

    def _cancel_on_node(self, target: RequestId) -> None:
        """Send ``cancel`` for ``target`` without waiting: its reply, and the target's
        499, go to no inbox and are dropped."""
        try:
            with self._exclusive():
                sent = self._conv.prepare({"op": "cancel", "target": target}, keep=False)
                self._sock.send_multipart(sent.frames(), zmq.NOBLOCK)
        except (zmq.ZMQError, EdgeNodeError):
            # No connection (the node ends the request at its deadline), or another
            # thread holds the socket (not ours to touch: the same).
            pass

    def _bodies(self, call: Call) -> Iterator[dict[str, Any]]:
        """Send ``call``'s request (at once: before the first ``next``, for streams) and
        return the iterator of its reply bodies, the final last (the node's or a local
        answer)."""
        try:
            first = self._send(call)
        except EdgeNodeError:  # not sent: the socket did not take it in time
            call.end(time.monotonic())
            raise
        except BaseException:
            # Ctrl-C (or a signal handler's exception) during the send: pyzmq may
            # raise it after the frames went out, so the request may be on the node
            # (2 in 150 interrupted calls ran to max_tokens; break-it pass, session
            # 19). A cancel for an id the node never got is answered 404, dropped.
            self._abandon(call)
            raise
        return self._course(call, first)

    def _send(self, call: Call) -> list[dict[str, Any]]:
        """Send the request; the bodies to hand out at once (a local answer) if not.

        Raises:
            NoReply: an unguarded call the socket did not take within its budget.
        """
        if call.guard is not None and call.permit is None:
            return call.local("breaker_open", time.monotonic())
        if self._post(call.sent, call.send_deadline()):
            return []
        if call.guard is None:
            raise self._no_send(call.sent)
        return call.unreachable(time.monotonic())

    def _post(self, sent: Sent, until: float) -> bool:
        """Send ``sent`` once the socket takes it, waiting until ``until`` (monotonic s)
        at most; False if it did not. A blocking send could wait forever: a guarded
        socket queues only on a live connection (ZMQ_IMMEDIATE), any socket stops at
        its high-water mark."""
        left_ms = max(0, math.ceil((until - time.monotonic()) * 1000))
        with self._exclusive():
            try:
                if self._sock.poll(left_ms, zmq.POLLOUT):
                    self._sock.send_multipart(sent.frames(), zmq.NOBLOCK)
                    return True
            except zmq.Again:
                pass
        return False

    def _course(self, call: Call, first: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        try:
            yield from first
            while not call.done:
                try:
                    reply = self._next(call)
                except ClientInUse:
                    raise  # this thread's misuse, not the node's answer
                except EdgeNodeError as exc:
                    yield from call.failed(exc, time.monotonic())
                    continue
                now = time.monotonic()
                if reply is None:
                    yield from call.timed_out(now, self.endpoint)
                else:
                    yield from call.replied(reply, now)
        except BaseException:
            # Closed before its end (the stream was left: GeneratorExit), or the app's
            # own exception arrived during the wait (Ctrl-C, a signal handler's): the
            # request is cancelled on the node, unless it ended (the node's error
            # reply raised here). Before ``finally`` ends the call: after it, nothing
            # would cancel it, and it held its slot to max_tokens.
            self._abandon(call)
            raise
        finally:
            call.end(time.monotonic())

    def _next(self, call: Call) -> dict[str, Any] | None:
        """The next reply of ``call``, reading the socket until one arrives; None at its
        deadline (replies for other ids do not count).

        Raises:
            ClientClosed: the client was closed (a stream read after ``close``).
            ClientInUse: another thread is using the client.
        """
        self._check_open()
        deadline = call.deadline(time.monotonic())
        with self._exclusive():
            while (reply := self._conv.take(call.sent)) is None:
                left_ms = math.ceil((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not self._sock.poll(left_ms):
                    return None
                self._conv.file(self._sock.recv_multipart())
        return reply


class AsyncClient(_Base):
    """``Client`` for asyncio (pyzmq's ``zmq.asyncio``): the same arguments, ops and errors.

    ``generate``, ``chat``, ``cancel``, ``ping``, ``status`` and ``request`` are
    coroutines; ``stream_generate``/``stream_chat`` send at once and return an
    ``AsyncStream`` (``async for piece in stream``). Cancelling the task that awaits
    ``generate``/``chat`` or iterates a stream sends the node a ``cancel`` for the
    request (the node's worker stops it), then re-raises ``CancelledError``.

    Use it from one event loop; ``async with AsyncClient(...) as node`` closes it. A
    task of its own reads the socket and files each reply under its request's id.

    ``close()`` is a plain method (it needs no await; ``async with`` calls it):
    every task still waiting for a reply, or for the socket to take its request,
    raises ``ClientClosed`` at its next turn of the loop, and every later call raises
    it too. ``aclose()`` closes and also waits for the reader task to end.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: int | None = None,
        wait_ms: int = 120_000,
        max_body_bytes: int = p.DEFAULT_MAX_BODY_BYTES,
        server_public_key: bytes | None = None,
        client_keypair: tuple[bytes, bytes] | None = None,
        fallback: LocalFallback | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        super().__init__(endpoint, timeout_ms, wait_ms, max_body_bytes, fallback, breaker)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket = client_socket(
            self._ctx, endpoint, server_public_key, client_keypair, self.guard is not None
        )
        self._arrived: dict[RequestId, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None
        # Set by ``close``: wakes the calls waiting for the socket to take a request.
        self._closing = asyncio.Event()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading and close the socket (pending replies are dropped; requests
        still run on the node).

        Idempotent; not a coroutine. Every task awaiting a reply of this client (or
        iterating its stream) raises ``ClientClosed`` at once, as does every later call.
        """
        if self.closed:
            return
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._closing.set()
        for arrived in self._arrived.values():
            arrived.set()  # the waiting call sees ``closed`` and raises
        self._sock.close(0)
        self._conv.clear()

    async def aclose(self) -> None:
        """``close``, then wait for the reader task to end (asyncio's ``aclose``)."""
        reader = self._reader
        self.close()
        if reader is not None:
            await asyncio.wait({reader})

    # ------------------------------------------------------------------ ops

    async def generate(self, prompt: str, **fields: Any) -> Reply:
        """As ``Client.generate``; cancelling the awaiting task cancels it on the node."""
        return await self._final({"op": "generate", "prompt": prompt, **fields})

    async def chat(self, messages: list[dict[str, str]], **fields: Any) -> Reply:
        """As ``Client.chat``; cancelling the awaiting task cancels it on the node."""
        return await self._final({"op": "chat", "messages": messages, **fields})

    async def stream_generate(self, prompt: str, **fields: Any) -> AsyncStream:
        """As ``Client.stream_generate``: sent when awaited, read with ``async for``."""
        return await self._stream({"op": "generate", "prompt": prompt, "stream": True, **fields})

    async def stream_chat(self, messages: list[dict[str, str]], **fields: Any) -> AsyncStream:
        """As ``Client.stream_chat``: sent when awaited, read with ``async for``."""
        return await self._stream({"op": "chat", "messages": messages, "stream": True, **fields})

    async def cancel(self, target: RequestId) -> None:
        """As ``Client.cancel``.

        Raises:
            NotFound: ``target`` is not in flight on this connection.
        """
        await self.request({"op": "cancel", "target": target})

    async def ping(self) -> dict[str, Any]:
        """As ``Client.ping``."""
        return await self.request({"op": "ping"})

    async def status(self) -> dict[str, Any]:
        """As ``Client.status``."""
        node: dict[str, Any] = (await self.request({"op": "status"}))["node"]
        return node

    async def request(self, body: dict[str, Any]) -> dict[str, Any]:
        """As ``Client.request``: the final reply body; raises on error replies."""
        return await self._last(self._begin(body, guarded=False))

    # ------------------------------------------------------------------ plumbing

    async def _final(self, body: dict[str, Any]) -> Reply:
        return Reply.from_body(await self._last(self._begin(body, guarded=True)))

    async def _last(self, call: Call) -> dict[str, Any]:
        """``call``'s final reply body (its partials skipped)."""
        bodies = await self._bodies(call)
        try:
            async for item in bodies:
                if item.get("status") != "partial":
                    return item
        finally:
            await bodies.aclose()  # now, not when the loop collects it
        raise AssertionError("unreachable")  # pragma: no cover

    async def _stream(self, body: dict[str, Any]) -> AsyncStream:
        call = self._begin(body, guarded=True)
        bodies = await self._bodies(call)
        abandon = functools.partial(self._abandon, call, self._arrived[call.sent.id])
        stream = AsyncStream(bodies, call.sent.id, abandon)
        # Never iterated, its generator has no ``finally`` to run: the stream's end does
        # it, and cancels the request.
        weakref.finalize(stream, abandon)
        return stream

    def _abandon(self, call: Call, arrived: asyncio.Event) -> None:
        """Cancel ``call`` on the node if it has not ended, and forget it."""
        if not call.done and not call.ended and not self.closed:
            self._cancel_on_node(call.sent.id)
        self._forget(call, arrived)

    async def _bodies(self, call: Call) -> AsyncGenerator[dict[str, Any], None]:
        """Send ``call``'s request now and return the iterator of its reply bodies."""
        arrived = self._arrived[call.sent.id] = asyncio.Event()
        try:
            first = await self._send(call)
        except BaseException:
            self._forget(call, arrived)
            raise
        return self._course(call, first, arrived)

    async def _send(self, call: Call) -> list[dict[str, Any]]:
        """As ``Client._send``.

        Raises:
            ClientClosed: the client was closed while the call waited to send.
        """
        self._start_reader()
        if call.guard is not None and call.permit is None:
            return call.local("breaker_open", time.monotonic())
        if await self._post(call.sent, call.send_deadline()):
            return []
        if call.guard is None:
            raise self._no_send(call.sent)
        return call.unreachable(time.monotonic())

    async def _post(self, sent: Sent, until: float) -> bool:
        """As ``Client._post``; ``close`` ends the wait (``ClientClosed``).

        Each wait is bounded by ``asyncio.wait``'s timeout, not only by the poll's own,
        so the call is back on time whatever the poller does. Several tasks may wait
        for the socket at once: a send queued behind another task's wait is withdrawn
        (``_send_now``) and this one waits again, until ``until``."""
        while not self._send_now(sent):
            left = until - time.monotonic()
            if left <= 0:
                return False
            # pyzmq's stub lacks the flags argument its asyncio poll has, and types the
            # result as the Poller's.
            polled = self._sock.poll(math.ceil(left * 1000), zmq.POLLOUT)  # type: ignore[call-arg]
            poll = asyncio.ensure_future(cast("Awaitable[int]", polled))
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                waits: set[asyncio.Future[Any]] = {poll, closing}
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                poll.cancel()
                closing.cancel()
            if poll.done() and not poll.cancelled():
                poll.exception()  # retrieved: a failed poll is one more turn, to the deadline
            self._check_open()
        return True

    def _send_now(self, sent: Sent) -> bool:
        """Send ``sent`` without waiting; False if the socket cannot take it now.

        Through the asyncio socket, not a shadow: with ``NOBLOCK`` it sends at once
        (no await: a task being cancelled can send its ``cancel``) and then wakes its
        reader for anything the send let in, which a shadow's send would leave unseen
        (the socket's file descriptor is edge-triggered). While another task waits
        for the socket (its poll is a pending send of pyzmq's), the send is queued
        instead: it is withdrawn, as not sent."""
        # The stub types the result as a plain Awaitable; it is an asyncio Future.
        done = cast("asyncio.Future[Any]", self._sock.send_multipart(sent.frames(), zmq.NOBLOCK))
        if not done.done():
            done.cancel()  # a cancelled send event is skipped by pyzmq, never sent
            return False
        try:
            done.result()
        except zmq.Again:
            return False
        return True

    async def _course(
        self, call: Call, first: list[dict[str, Any]], arrived: asyncio.Event
    ) -> AsyncGenerator[dict[str, Any], None]:
        try:
            for item in first:
                yield item
            while not call.done:
                try:
                    reply = await self._next(call, arrived)
                except EdgeNodeError as exc:
                    for item in call.failed(exc, time.monotonic()):
                        yield item
                    continue
                now = time.monotonic()
                items = (
                    call.timed_out(now, self.endpoint)
                    if reply is None
                    else call.replied(reply, now)
                )
                for item in items:
                    yield item
        except BaseException:  # task cancelled, stream left, or the app's own exception
            self._abandon(call, arrived)  # as in Client._course
            raise
        finally:
            self._forget(call, arrived)

    def _forget(self, call: Call, arrived: asyncio.Event) -> None:
        # Only this call's event: a newer request may have its id by now.
        if self._arrived.get(call.sent.id) is arrived:
            del self._arrived[call.sent.id]
        call.end(time.monotonic())

    def _cancel_on_node(self, target: RequestId) -> None:
        """Send ``cancel`` for ``target`` without waiting: its reply, and the target's
        499, go to no inbox and are dropped."""
        try:
            # Only on a running loop (a stream dropped outside one, e.g. collected after
            # its loop stopped, is not cancelled): pyzmq would make a loop to send on.
            asyncio.get_running_loop()
            sent = self._conv.prepare({"op": "cancel", "target": target}, keep=False)
            self._send_now(sent)
        except (zmq.ZMQError, EdgeNodeError, RuntimeError):
            # No connection (or, finalized late, no loop): the node ends the request
            # at its deadline.
            pass

    async def _next(self, call: Call, arrived: asyncio.Event) -> dict[str, Any] | None:
        """As ``Client._next``, woken by the reader task (or ``close``) through ``arrived``.

        Raises:
            ClientClosed: the client is, or was meanwhile, closed.
        """
        deadline = call.deadline(time.monotonic())
        while True:
            self._check_open()
            if (reply := self._conv.take(call.sent)) is not None:
                return reply
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            arrived.clear()
            try:
                await asyncio.wait_for(arrived.wait(), left)
            except asyncio.TimeoutError:  # the builtin TimeoutError only from 3.11
                return None

    def _start_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        """File every reply under its id and wake the call waiting for it; ends quietly
        when the client is closed."""
        while not self.closed:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError:
                if self.closed:
                    return  # closed under the pending receive
                raise
            rid = self._conv.file(frames)
            if rid is not None and (arrived := self._arrived.get(rid)) is not None:
                arrived.set()
