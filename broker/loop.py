"""The broker's I/O loop: the only broker module that touches zmq sockets.

It binds a frontend ROUTER (clients) and a backend ROUTER (workers), feeds the
sans-I/O ``Broker`` with frames and monotonic time, and flushes what it wants
sent. Sends are non-blocking with ``ROUTER_MANDATORY``, so a vanished or
congested peer costs one dropped message, never a blocked loop.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import zmq

from broker import protocol as p
from broker.core import Broker, WorkerEvent

log = logging.getLogger(__name__)

#: Per-peer high-water marks. Credit bounds what a worker is sent; the client
#: side is bounded by the queue, so these only cap replies to slow readers.
SNDHWM = 1000
RCVHWM = 1000
#: Upper bound on messages read from one socket before others get a turn.
BATCH = 256
#: Client messages handled per turn, and the time they may take (s): admitting
#: one may tokenize a long prompt (~7 µs per token here), and workers' heartbeats
#: must not wait behind a burst of them.
CLIENT_BATCH = 16
CLIENT_TIME_S = 0.05


def secure_ipc_dir(endpoint: str) -> None:
    """Create the directory of an ``ipc://`` endpoint with mode 0700.

    Only this user may then connect, so a foreign process cannot register as a
    worker and receive users' prompts (DESIGN.md §7).
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
    secure_ipc_dir(endpoint)
    sock.bind(endpoint)
    return sock


class BrokerLoop:
    """Runs a ``Broker`` on two ROUTER sockets until ``stop()`` is called.

    Args:
        broker: the sans-I/O core.
        frontend: client endpoint, e.g. ``ipc:///run/edgenode/frontend.sock``.
        backend: worker endpoint.
        on_event: receives worker ``ready``/``lost`` events (the supervisor).
        on_tick: called every loop turn with monotonic seconds (supervisor reaping).
        clock: monotonic seconds; injectable for tests.
    """

    def __init__(
        self,
        broker: Broker,
        frontend: str,
        backend: str,
        on_event: Callable[[WorkerEvent], None] | None = None,
        on_tick: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.clock = clock
        self._on_event = on_event
        self._on_tick = on_tick
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        # One cap for both sides (PROTOCOL §2.3): what a client may send fits a
        # REQUEST, and what a worker may send back fits a reply.
        max_msg = p.message_limits(broker.settings.max_body_bytes).frame_bytes
        self.frontend = make_router(self.ctx, frontend, max_msg)
        self.backend = make_router(self.ctx, backend, max_msg)
        self.poller = zmq.Poller()
        self.poller.register(self.frontend, zmq.POLLIN)
        self.poller.register(self.backend, zmq.POLLIN)
        self._extra: dict[int, Callable[[], None]] = {}
        self._running = False
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
        timeout_ms = int(min(self.broker.next_wakeup(now), max_wait_s) * 1000)
        ready = dict(self.poller.poll(max(0, timeout_ms)))
        if self.backend in ready:
            self._drain(self.backend, self.broker.handle_worker)
        if self.frontend in ready:
            self._drain(self.frontend, self.broker.handle_client, CLIENT_BATCH, CLIENT_TIME_S)
            # Read what workers sent meanwhile, so liveness judges fresh news.
            self._drain(self.backend, self.broker.handle_worker)
        for fd, callback in self._extra.items():
            if fd in ready:
                callback()
        now = self.clock()
        self.broker.tick(now)
        if self._on_tick is not None:
            self._on_tick(now)
        self.flush()

    def flush(self) -> None:
        """Send everything the core queued, then hand worker events on."""
        b = self.broker
        while b.to_workers or b.to_clients or b.events:
            out_w, b.to_workers = b.to_workers, []
            out_c, b.to_clients = b.to_clients, []
            events, b.events = b.events, []
            for frames in out_w:
                self._send(self.backend, frames)
            for frames in out_c:
                self._send(self.frontend, frames)
            for event in events:
                if self._on_event is not None:
                    self._on_event(event)

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
            # EHOSTUNREACH: the peer left; EAGAIN: it stopped reading. Either
            # way the message has nowhere to go and the loop must not block.
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
        self.frontend.close(linger_ms)
        self.backend.close(0)
        self.ctx.term()
