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
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from broker import protocol as p
from broker.connections import Connections
from broker.core import Broker
from broker.delivery import Fate, GoneCause, Offer, Outgoing
from broker.outbox import Effects

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
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, max_msg: int
) -> zmq.Socket[bytes]:
    """A bound ROUTER with the house socket options; ``max_msg`` is its
    ZMQ_MAXMSGSIZE in bytes (``broker.protocol.MessageLimits.frame_bytes``)."""
    sock = ctx.socket(zmq.ROUTER)
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
    ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]
) -> zmq.Socket[bytes]:
    """A PAIR socket receiving ``sock``'s ``MONITOR_EVENTS`` (``zmq_socket_monitor``).

    Its receive HWM is unlimited: libzmq drops monitor events silently when the
    pipe is full, and a lost ACCEPTED could make a live client look gone
    (``broker.connections``). The loop drains it every turn; an event is a few
    dozen bytes. A connection accepted between the bind and this call is
    handled as one whose ACCEPTED was lost: it counts as open.
    """
    endpoint = f"inproc://monitor-{id(sock):x}"
    sock.monitor(endpoint, MONITOR_EVENTS)
    pair = ctx.socket(zmq.PAIR)
    pair.setsockopt(zmq.RCVHWM, 0)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(endpoint)
    return pair


class BrokerLoop:
    """Runs a ``Broker`` on two ROUTER sockets until ``stop()`` is called.

    Args:
        broker: the sans-I/O core.
        frontend: client endpoint, e.g. ``ipc:///run/edgenode/frontend.sock``.
        backend: worker endpoint.
        on_effects: receives each batch taken from the broker's outbox, once its
            frames are sent: the node acts on its ``events`` (the supervisor),
            ``records`` (the migration log) and ``transitions`` (the breaker's).
        on_tick: called every loop turn with monotonic seconds (supervisor reaping).
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        broker: Broker,
        frontend: str,
        backend: str,
        on_effects: Callable[[Effects], None] | None = None,
        on_tick: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.clock = clock
        self._on_effects = on_effects
        self._on_tick = on_tick
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # One cap for both sides (PROTOCOL §2.3): what a client may send fits a
        # REQUEST, and what a worker may send back fits a reply.
        max_msg = p.message_limits(broker.settings.max_body_bytes).frame_bytes
        self.frontend = make_router(self.ctx, frontend, max_msg)
        self.connections = Connections()
        self.monitor = watch_connections(self.ctx, self.frontend)
        self.backend = make_router(self.ctx, backend, max_msg)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.backend, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._extra: dict[int, Callable[[], None]] = {}
        self._running = False
        #: Messages to workers that could not be sent (the worker left or stalled).
        self.dropped = 0

    def add_fd(self, fd: int, callback: Callable[[], None]) -> None:
        """Also wake up when ``fd`` is readable (e.g. a signal wakeup pipe)."""
        self._extra[fd] = callback
        self.poller.register(fd, zmq.POLLIN)

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
        self.poller.register(self.frontend, frontend_flags)
        ready = dict(self.poller.poll(max(0, int(wait_s * 1000))))
        if self.backend in ready:
            self._drain(self.backend, self.broker.handle_worker)
        if ready.get(self.frontend, 0) & zmq.POLLIN:
            self._drain_clients()
            # Read what workers sent meanwhile, so liveness judges fresh news.
            self._drain(self.backend, self.broker.handle_worker)
        # After the clients' messages: the events that preceded them are in.
        self._read_monitor()
        for fd, callback in self._extra.items():
            if fd in ready:
                callback()
        now = self.clock()
        self.broker.tick(now)
        if self._on_tick is not None:
            self._on_tick(now)
        writable = bool(ready.get(self.frontend, 0) & zmq.POLLOUT)
        if writable or delivery.due(now):
            self._retry_backlog(now, writable)
        self.flush()

    def flush(self) -> None:
        """Send every frame the core queued, then hand the rest to ``on_effects``;
        again while that queued more (a supervisor event may)."""
        while effects := self.broker.outbox.take():
            for frames in effects.workers:
                self._send(self.backend, frames)
            for out in effects.clients:
                self._send_client(out)
            if self._on_effects is not None:
                self._on_effects(effects)

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
        ended = self.broker.client_gone(client, cause, self.clock())
        if ended:
            log.info(
                "client %s is gone (%s): %d request(s) ended", client.hex(), cause.value, ended
            )

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
            fd = parts[0].get(zmq.SRCFD)
            if isinstance(fd, int) and fd >= 0:
                self.connections.seen(frames[0], fd)
            self.broker.handle_client(frames, self.clock())
            if self.clock() >= stop_at:
                return  # the rest waits for the next turn (poll returns at once)

    def _read_monitor(self) -> None:
        """Apply the frontend's connection events; end the work of closed ones."""
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.connections.accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections.disconnected(fd)
        for client in self.connections.settle():
            self._client_gone(client, GoneCause.DISCONNECTED)

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
        self.frontend.close(linger_ms)
        self.backend.close(0)
        self.ctx.term()
