"""The broker's I/O loop: the only broker module that touches zmq sockets.

It binds a frontend ROUTER (clients) and a backend ROUTER (workers), feeds the
sans-I/O ``Broker`` with frames and monotonic time, and flushes its outbox
(``broker.outbox``): frames go out on the sockets, everything else (worker
events, migration records, breaker transitions) to the node's ``on_effects``.
Sends are non-blocking with ``ROUTER_MANDATORY``, so a vanished or congested
peer never blocks the loop. What a failed send to a client means (a final waits
in a backlog, a partial is dropped, the client is gone) is
``broker.delivery``'s decision; which client connections closed is told by the
frontend's socket monitor (``broker.connections``). A gone client's requests
are ended by ``Broker.client_gone``.

With CURVE (``broker.security.CurveServer`` for a side), that ROUTER is a CURVE
server and every peer must prove a key in its allowlist (Ironhouse). The ZAP
handler that says yes or no (``ZapHandler``) is pyzmq's ``zmq.auth``
``Authenticator`` driven by this loop: its socket is polled with the others,
so authentication runs on the broker's one thread, between turns, with no
lock and no second thread (``zmq.auth.thread.ThreadAuthenticator`` would add
both). Refused handshakes are counted from the socket monitors
(``Stats.refuse``), every one; refused keys are logged within a bound
(``broker.refusal_log``: a flood must not fill the disk); an accepted
client's key reaches the core with each of its messages (the ``User-Id``
message property ZAP set), as its ``principal``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.base import Authenticator
from zmq.utils.monitor import recv_monitor_message

from broker import protocol as p
from broker.connections import Connections
from broker.core import Broker
from broker.delivery import Fate, GoneCause, Offer, Outgoing
from broker.kinds import Refusal, Side
from broker.outbox import Effects
from broker.refusal_log import RefusalLog
from broker.security import CurveServer

log = logging.getLogger(__name__)

#: Per-peer high-water marks. Credit bounds what a worker is sent; the client
#: side is bounded by the queue, so these only cap replies to slow readers.
SNDHWM = 1000
RCVHWM = 1000
#: Upper bound on messages read from one socket before others get a turn.
BATCH = 256
#: Client messages handled per turn, and the time they may take (s): admitting
#: one may tokenize a long prompt (measured: docs/bench/figures.md, "broker.loop"),
#: and workers' heartbeats must not wait behind a burst of them.
CLIENT_BATCH = 16
CLIENT_TIME_S = 0.05
#: The frontend connection events the loop follows (``broker.connections``).
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
#: The handshake failures of a CURVE socket, and the refusal each one counts as
#: (libzmq >= 4.3's stable events; AUTH is the ZAP handler's 400).
REFUSAL_EVENTS: dict[int, Refusal] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key_not_allowed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake_failed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake_failed",
}
HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def zap_domain(side: Side) -> str:
    """The ZAP domain of a side's socket: the ZAP handler keeps one allowlist per domain."""
    return f"edgenode.{side}"


def secure_ipc_dir(endpoint: str) -> None:
    """Create the directory of an ``ipc://`` endpoint with mode 0700.

    Only this user may then connect, so a foreign process cannot register as a
    worker and receive users' prompts.
    """
    if not endpoint.startswith("ipc://"):
        return
    directory = Path(endpoint[len("ipc://") :]).parent
    directory.mkdir(parents=True, exist_ok=True)
    if stat.S_IMODE(directory.stat().st_mode) != 0o700:
        os.chmod(directory, 0o700)


def make_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    max_msg: int,
    curve: CurveServer | None = None,
    side: Side = "frontend",
) -> zmq.Socket[bytes]:
    """A bound ROUTER with the house socket options; ``max_msg`` is its
    ZMQ_MAXMSGSIZE in bytes (``broker.protocol.MessageLimits.frame_bytes``).
    With ``curve`` it is a CURVE server whose peers the ZAP handler judges
    under ``side``'s domain (set before the bind: no peer gets in without it)."""
    sock = ctx.socket(zmq.ROUTER)
    if curve is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, zap_domain(side).encode())
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SNDHWM)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    # IPv6 addresses bind too; a wildcard then listens on IPv4 and IPv6 alike.
    sock.setsockopt(zmq.IPV6, 1)
    secure_ipc_dir(endpoint)
    sock.bind(endpoint)
    return sock


def watch_connections(
    ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], events: int = MONITOR_EVENTS
) -> zmq.Socket[bytes]:
    """A PAIR socket receiving ``sock``'s ``events`` (``zmq_socket_monitor``).

    Its receive HWM is unlimited: libzmq drops monitor events silently when the
    pipe is full, and a lost ACCEPTED could make a live client look gone
    (``broker.connections``). The loop drains it every turn; an event is a few
    dozen bytes. A connection accepted between the bind and this call is
    handled as one whose ACCEPTED was lost: it counts as open.
    """
    endpoint = f"inproc://monitor-{id(sock):x}"
    sock.monitor(endpoint, events)
    pair = ctx.socket(zmq.PAIR)
    pair.setsockopt(zmq.RCVHWM, 0)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(endpoint)
    return pair


class _Allowlist:
    """A ``zmq.auth`` credentials provider: one side's allowed keys."""

    def __init__(
        self, side: Side, server: CurveServer, refusals: RefusalLog, clock: Callable[[], float]
    ) -> None:
        self.side = side
        self.server = server
        self.refusals = refusals
        self.clock = clock

    def callback(self, domain: str, key: bytes) -> bool:
        """Whether ``key`` (Z85) may connect; a refusal is logged with the key if
        ``refusals`` says so (the monitor counts every one). A refused peer does not
        retry (libzmq stops on ZAP 400)."""
        if self.server.allows(key):
            return True
        if self.refusals.refused(key, self.clock()):
            log.warning(
                "%s: refused a CURVE key not in the allowlist: %s (further refusals within %.0f s"
                " are counted and summed up, not logged one by one)",
                self.side,
                key.decode(),
                self.refusals.window_s,
            )
        return False


class ZapHandler:
    """The ZAP handler (ZeroMQ RFC 27) of the loop's context, polled by the loop.

    pyzmq's ``Authenticator`` with one credentials provider per side's ZAP
    domain (``zap_domain``). Its ``handle_zap_message`` is a coroutine in
    pyzmq >= 25 that never waits on anything with a plain provider; a private
    event loop runs it to completion on the broker's thread. Refused keys are
    logged within ``broker.refusal_log``'s bound (one ``RefusalLog`` for both
    sides), the rest summed up once a window is over (``tick``).

    Args:
        clock: monotonic seconds (the loop's).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        servers: dict[Side, CurveServer],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._auth = Authenticator(ctx, log=logging.getLogger("edgenode.zap"))
        self._auth.start()  # bound before any CURVE socket: none accepts a peer unjudged
        self.clock = clock
        self.refusals = RefusalLog()
        for side, server in servers.items():
            provider = _Allowlist(side, server, self.refusals, clock)
            self._auth.configure_curve_callback(zap_domain(side), provider)
        self._aio = asyncio.new_event_loop()
        self.socket: zmq.Socket[bytes] = self._auth.zap_socket

    def handle(self) -> None:
        """Answer every ZAP request waiting (each gets exactly one reply)."""
        self.tick(self.clock())  # a window over is summed up before a new one starts
        while True:
            try:
                msg = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            result = self._auth.handle_zap_message(msg)
            if inspect.isawaitable(result):  # pyzmq >= 25; before, it ran already
                self._aio.run_until_complete(result)

    def tick(self, now: float) -> None:
        """Log the summary of a window over at ``now`` (s) if refusals went unlogged."""
        summary = self.refusals.summary(now)
        if summary is not None:
            unlogged, refusals = summary
            log.warning(
                "%d CURVE key refusal(s) in the last %.0f s not logged (%d in all; status"
                " counts every one)",
                unlogged,
                self.refusals.window_s,
                refusals,
            )

    def close(self) -> None:
        """Close the ZAP socket and the private event loop."""
        self._auth.stop()
        self._aio.close()


def _readable(sock: zmq.Socket[bytes]) -> bool:
    """Whether ``sock`` has a message to read now (``ZMQ_EVENTS``): the loop asks
    before a read that most often finds nothing, since a failed ``NOBLOCK`` read
    raises ``zmq.Again``, and raising it cost twice this question (measured with
    pyzmq 27: ~24 µs against ~10 µs on the loaded development VM)."""
    events = sock.getsockopt(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def _source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection ``frame`` came on, or -1 when libzmq has none
    for it: a message from a ZMTP/1.0 peer (no greeting, so no metadata) raises EINVAL,
    which reached the loop and stopped the node (a new user's five raw bytes)."""
    try:
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return -1
    return fd if isinstance(fd, int) else -1


class BrokerLoop:
    """Runs a ``Broker`` on two ROUTER sockets until ``stop()`` is called.

    Args:
        broker: the sans-I/O core.
        frontend: client endpoint, e.g. ``ipc:///run/edgenode/frontend.sock``.
        backend: worker endpoint.
        on_effects: receives each batch taken from the broker's outbox, just before
            its frames are sent: the node acts on its ``events`` (the supervisor),
            ``records`` (the migration log) and ``transitions`` (the breaker's).
        on_tick: called every loop turn with monotonic seconds (supervisor reaping).
        clock: monotonic seconds; injectable for tests.
        frontend_curve, backend_curve: CURVE keys and allowlist of that side, or
            None for a plaintext socket (``broker.security``).
    """

    def __init__(
        self,
        broker: Broker,
        frontend: str,
        backend: str,
        on_effects: Callable[[Effects], None] | None = None,
        on_tick: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        frontend_curve: CurveServer | None = None,
        backend_curve: CurveServer | None = None,
    ) -> None:
        self.broker = broker
        self.clock = clock
        self._on_effects = on_effects
        self._on_tick = on_tick
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # One cap for both sides (PROTOCOL §2.3): what a client may send fits a
        # REQUEST, and what a worker may send back fits a reply.
        max_msg = p.message_limits(broker.settings.max_body_bytes).frame_bytes
        servers: dict[Side, CurveServer] = {}
        if frontend_curve is not None:
            servers["frontend"] = frontend_curve
        if backend_curve is not None:
            servers["backend"] = backend_curve
        self.zap = ZapHandler(self.ctx, servers, clock) if servers else None
        self.curve_frontend = frontend_curve is not None
        self.frontend = make_router(self.ctx, frontend, max_msg, frontend_curve, "frontend")
        self.connections = Connections()
        events = MONITOR_EVENTS | (HANDSHAKE_EVENTS if self.curve_frontend else 0)
        self.monitor = watch_connections(self.ctx, self.frontend, events)
        self.backend = make_router(self.ctx, backend, max_msg, backend_curve, "backend")
        #: The backend's handshake failures, with CURVE only (nothing else is watched there).
        self.backend_monitor = (
            None
            if backend_curve is None
            else watch_connections(self.ctx, self.backend, HANDSHAKE_EVENTS)
        )
        #: Each client routing id's authenticated key (CURVE), for the logs.
        self.principals: dict[bytes, bytes] = {}
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self._frontend_flags = zmq.POLLIN
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        if self.zap is not None:
            self.poller.register(self.zap.socket, zmq.POLLIN)
        if self.backend_monitor is not None:
            self.poller.register(self.backend_monitor, zmq.POLLIN)
        self._extra: dict[int, Callable[[], None]] = {}
        self._running = False
        #: Messages to workers that could not be sent (the worker left or stalled).
        self.dropped = 0

    def add_fd(self, fd: int, callback: Callable[[], None]) -> None:
        """Also wake up when ``fd`` is readable (e.g. a signal wakeup pipe)."""
        self._extra[fd] = callback
        self.poller.register(fd, zmq.POLLIN)

    def remove_fd(self, fd: int) -> None:
        """Stop watching ``fd`` (from ``add_fd``); before the caller closes it."""
        if self._extra.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def stop(self) -> None:
        """Make ``run`` return after the current turn."""
        self._running = False

    def run(self, max_wait_s: float = 1.0) -> None:
        """Serve until ``stop()``; ``max_wait_s`` caps one poll so ``on_tick`` runs."""
        self._running = True
        while self._running:
            self.turn(max_wait_s)

    def turn(self, max_wait_s: float = 1.0) -> None:
        """One poll, read, tick and flush cycle."""
        now = self.clock()
        delivery = self.broker.delivery
        wait_s = min(self.broker.next_wakeup(now), max_wait_s)
        retry_s = delivery.next_retry(now)
        if retry_s is not None:
            wait_s = min(wait_s, retry_s)
        frontend_flags = zmq.POLLIN | (zmq.POLLOUT if delivery.wants_pollout() else 0)
        if frontend_flags != self._frontend_flags:
            self.poller.register(self.frontend, frontend_flags)
            self._frontend_flags = frontend_flags
        ready = dict(self.poller.poll(max(0, int(wait_s * 1000))))
        if self.zap is not None and self.zap.socket in ready:
            self.zap.handle()
        if self.backend_monitor is not None and self.backend_monitor in ready:
            self._read_refusals(self.backend_monitor, "backend")
        if self.backend in ready:
            self._drain(self.backend, self.broker.handle_worker)
        clients_read = bool(ready.get(self.frontend, 0) & zmq.POLLIN)
        if clients_read:
            self._drain_clients()
            # Read what workers sent meanwhile, so liveness judges fresh news.
            if _readable(self.backend):
                self._drain(self.backend, self.broker.handle_worker)
        # After the clients' messages: the events that preceded them are in. A turn
        # without client messages reads only events the poll saw (a failed read costs
        # as much as a message; a later event wakes the next poll).
        if (clients_read and _readable(self.monitor)) or self.monitor in ready:
            self._read_monitor()
        for fd, callback in self._extra.items():
            if fd in ready:
                callback()
        now = self.clock()
        self.broker.tick(now)
        if self.zap is not None:
            self.zap.tick(now)
        if self._on_tick is not None:
            self._on_tick(now)
        writable = bool(ready.get(self.frontend, 0) & zmq.POLLOUT)
        if writable or delivery.due(now):
            self._retry_backlog(now, writable)
        self.flush()

    def flush(self) -> None:
        """Hand what the core queued to ``on_effects``, then send its frames (also
        when ``on_effects`` raises); again while that queued more (a supervisor
        event may). In this order a client that reads the metrics once its FINAL
        has arrived finds its request counted."""
        outbox = self.broker.outbox
        while outbox:  # most turns queue nothing: no empty batch is built for them
            effects = outbox.take()
            try:
                if self._on_effects is not None:
                    self._on_effects(effects)
            finally:
                for frames in effects.workers:
                    self._send(self.backend, frames)
                for out in effects.clients:
                    self._send_client(out)

    def _send_client(self, out: Outgoing) -> None:
        """Offer one reply to ``delivery``, and send it if it says so."""
        offer = self.broker.delivery.offer(out)
        if offer is Offer.SEND:
            self._try_client(out)
        elif offer is Offer.OVERFLOW:
            self._client_gone(out.client, GoneCause.BACKLOG_OVERFLOW)

    def _try_client(self, out: Outgoing) -> Fate:
        """One non-blocking send of ``out``; its fate goes to ``delivery``."""
        delivery = self.broker.delivery
        try:
            self.frontend.send_multipart(delivery.frames(out), zmq.NOBLOCK)
            fate = Fate.SENT
        except zmq.Again:
            fate = Fate.FULL  # its pipe is at the high-water mark: it is not reading
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                fate = Fate.GONE  # no pipe to that routing id: the client left
            else:
                # Not seen in practice; the loop must not die of it. Treated as a
                # full pipe: a final waits (bounded), a partial is dropped.
                log.warning("send to client %s failed: %s", out.client.hex(), exc)
                fate = Fate.FULL
        verdict = delivery.settle(out, fate)
        if verdict is not None:
            self._client_gone(out.client, verdict)
        return fate

    def _retry_backlog(self, now: float, writable: bool) -> None:
        """Try each waiting client's finals, oldest first, until its pipe is full."""
        delivery = self.broker.delivery
        sent = 0
        for client in delivery.clients():
            while (out := delivery.head(client)) is not None:
                if self._try_client(out) is not Fate.SENT:
                    break
                sent += 1
        delivery.round_done(sent, now, writable)

    def _client_gone(self, client: bytes, cause: GoneCause) -> None:
        """End the requests of a client that is gone (``Broker.client_gone``)."""
        self.connections.forget(client)
        key = self.principals.pop(client, None)
        ended = self.broker.client_gone(client, cause, self.clock())
        if ended:
            who = client.hex() if key is None else f"{client.hex()} (key {key.decode()})"
            log.info("client %s is gone (%s): %d request(s) ended", who, cause.value, ended)

    def _drain_clients(self) -> None:
        """Read client messages (a bounded batch), noting each one's connection."""
        stop_at = self.clock() + CLIENT_TIME_S
        for _ in range(CLIENT_BATCH):
            try:
                parts = self.frontend.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [part.bytes for part in parts]
            # ZMQ_SRCFD: the descriptor of the connection it came on (deprecated
            # in libzmq for ZMQ_MSG_PROPERTY_PEER_ADDRESS, which cannot tell two
            # ipc peers apart, yet still served by 4.3).
            fd = _source_fd(parts[0])
            if fd >= 0:
                self.connections.seen(frames[0], fd)
            principal = None
            if self.curve_frontend:
                # The key ZAP accepted for this connection: the client, whatever
                # routing id it has (RFC 27: the handler's User-Id reply).
                principal = str(parts[0].get("User-Id")).encode()
                if self.principals.get(frames[0]) != principal:
                    # debug: a probe connecting every few seconds made a line each time
                    log.debug("client %s is key %s", frames[0].hex(), principal.decode())
                    self.principals[frames[0]] = principal
            self.broker.handle_client(frames, self.clock(), principal)
            if self.clock() >= stop_at:
                return  # the rest waits for the next turn (poll returns at once)

    def _read_monitor(self) -> None:
        """Apply the frontend's connection events; end the work of closed ones."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            refusal = REFUSAL_EVENTS.get(event["event"])
            if refusal is not None:
                self.broker.stats.refuse("frontend", refusal)
                continue
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.connections.accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections.disconnected(fd)
        for client in self.connections.settle():
            self._client_gone(client, GoneCause.DISCONNECTED)

    def _read_refusals(self, monitor: zmq.Socket[bytes], side: Side) -> None:
        """Count the refused handshakes a side's monitor reported."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            refusal = REFUSAL_EVENTS.get(event["event"])
            if refusal is not None:
                self.broker.stats.refuse(side, refusal)

    def _drain(
        self,
        sock: zmq.Socket[bytes],
        handle: Callable[[list[bytes], float], None],
        batch: int = BATCH,
        budget_s: float | None = None,
    ) -> None:
        stop_at = None if budget_s is None else self.clock() + budget_s
        for _ in range(batch):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(frames, self.clock())
            if stop_at is not None and self.clock() >= stop_at:
                return  # the rest waits for the next turn (poll returns at once)

    def _send(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the worker left; EAGAIN: it stopped reading. Either
            # way the message has nowhere to go and the loop must not block
            # (liveness judges the worker).
            self.dropped += 1
            log.debug("dropped a message to %r: %s", frames[0][:8], exc)

    def close(self, linger_ms: int = 0) -> None:
        """Close both sockets and the context.

        Args:
            linger_ms: how long replies already queued for clients may still be
                delivered (ms); 0 drops them at once. Closing blocks at most this
                long, however slowly clients read; messages to workers are
                always dropped.
        """
        delivery = self.broker.delivery
        if delivery.has_backlog():  # a last try; what still waits is lost
            self._retry_backlog(self.clock(), writable=False)
            for client in delivery.clients():
                log.info(
                    "%d final reply(s) to %s undelivered at close",
                    delivery.forget(client),
                    client.hex(),
                )
        self.frontend.disable_monitor()
        self.monitor.close(0)
        if self.backend_monitor is not None:
            self.backend.disable_monitor()
            self.backend_monitor.close(0)
        self.frontend.close(linger_ms)
        self.backend.close(0)
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()
