"""Which client connection each routing id came on, to notice the ones that close.

libzmq's ROUTER does not tell the application that a peer left (its
``ZMQ_ROUTER_NOTIFY`` is a draft option, absent from release builds). Its socket
monitor does report ``ACCEPTED`` and ``DISCONNECTED`` with the connection's file
descriptor, and each received message carries the descriptor it came on
(``ZMQ_SRCFD``). Descriptors are reused at once (Linux hands out the lowest free
one), so a descriptor alone does not name a connection: ``Connections`` numbers
each descriptor's connections (a generation per ``ACCEPTED``) and binds a
routing id to the connection it arrived on.

Ordering: a connection's ``ACCEPTED`` event is emitted before any of its
messages arrive, and its ``DISCONNECTED`` event before its descriptor is
closed, hence before the descriptor's next ``ACCEPTED``. The loop therefore
reads messages first (``seen``) and the events after them (``accepted``,
``disconnected``), then calls ``settle``: every event that preceded a message
is then known. A routing id read from a descriptor that is closed once the
events are applied belongs to a connection that has closed: it is gone. If
the descriptor was closed and opened again within one such batch, the id is
bound to the newest connection: at worst its departure is noticed late (by a
failed send), never a live client taken for gone. The same holds for a client
that reconnects under its own routing id (``ZMQ_ROUTING_ID``): seen on an open
connection, it is not gone, and the replies for it go to the new connection.

No I/O and no clock: the loop feeds the events in order.
"""

from __future__ import annotations

#: A connection: (file descriptor, generation of that descriptor).
Connection = tuple[int, int]


class Connections:
    """Routing ids by connection, from the frontend's accept/disconnect events."""

    def __init__(self) -> None:
        self._generation: dict[int, int] = {}
        self._open: set[int] = set()
        self._where: dict[bytes, Connection] = {}
        self._ids: dict[Connection, set[bytes]] = {}
        #: Routing ids read since the last ``settle``, with their descriptor.
        self._pending: dict[bytes, int] = {}
        #: Routing ids whose connection closed since the last ``settle``.
        self._closed: set[bytes] = set()

    def __len__(self) -> int:
        """Routing ids bound to open connections."""
        return len(self._where)

    def seen(self, identity: bytes, fd: int) -> None:
        """A message from ``identity`` arrived on descriptor ``fd``."""
        # Always noted, even from the descriptor it is bound to: that number may
        # already be a new connection's (a client reconnecting under its own
        # routing id), whose ACCEPTED is not applied yet.
        self._pending[identity] = fd

    def accepted(self, fd: int) -> None:
        """A new connection was accepted on descriptor ``fd``."""
        self._generation[fd] = self._generation.get(fd, 0) + 1
        self._open.add(fd)

    def disconnected(self, fd: int) -> None:
        """The connection on ``fd`` closed: its routing ids are gone unless
        ``settle`` finds them on an open connection."""
        self._open.discard(fd)
        for identity in self._ids.pop((fd, self._generation.get(fd, 0)), set()):
            del self._where[identity]
            self._closed.add(identity)

    def settle(self) -> list[bytes]:
        """Apply what was ``seen`` since the last call, after the events that
        arrived with it. Returns the routing ids that are gone: their connection
        closed and no message of theirs came on one that is open (a client that
        reconnected under its own routing id is not gone)."""
        gone = self._closed
        for identity, fd in self._pending.items():
            self.forget(identity)
            # A descriptor never seen accepted (an event lost) counts as open:
            # only a connection known to have closed makes a client gone.
            if fd in self._open or fd not in self._generation:
                where = (fd, self._generation.get(fd, 0))
                self._where[identity] = where
                self._ids.setdefault(where, set()).add(identity)
                gone.discard(identity)
            else:
                gone.add(identity)
        self._pending.clear()
        self._closed = set()
        return sorted(gone)

    def forget(self, identity: bytes) -> None:
        """Stop tracking ``identity`` (it was found gone some other way)."""
        where = self._where.pop(identity, None)
        if where is not None:
            ids = self._ids.get(where)
            if ids is not None:
                ids.discard(identity)
                if not ids:
                    del self._ids[where]
