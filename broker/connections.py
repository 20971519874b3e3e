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
failed send), never a live client taken for gone.

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

    def __len__(self) -> int:
        """Routing ids bound to open connections."""
        return len(self._where)

    def seen(self, identity: bytes, fd: int) -> None:
        """A message from ``identity`` arrived on descriptor ``fd``."""
        where = self._where.get(identity)
        if where is None or where[0] != fd:
            self._pending[identity] = fd

    def accepted(self, fd: int) -> None:
        """A new connection was accepted on descriptor ``fd``."""
        self._generation[fd] = self._generation.get(fd, 0) + 1
        self._open.add(fd)

    def disconnected(self, fd: int) -> list[bytes]:
        """The connection on ``fd`` closed; returns the routing ids it carried."""
        self._open.discard(fd)
        gone = self._ids.pop((fd, self._generation.get(fd, 0)), set())
        for identity in gone:
            del self._where[identity]
        return sorted(gone)

    def settle(self) -> list[bytes]:
        """Bind the ids ``seen`` since the last call to their connections, after
        the events that arrived with them were applied. Returns the ids whose
        connection has already closed (gone before they were bound)."""
        gone = []
        for identity, fd in self._pending.items():
            self.forget(identity)
            # A descriptor never seen accepted (an event lost) counts as open:
            # only a connection known to have closed makes a client gone.
            if fd in self._open or fd not in self._generation:
                where = (fd, self._generation.get(fd, 0))
                self._where[identity] = where
                self._ids.setdefault(where, set()).add(identity)
            else:
                gone.append(identity)
        self._pending.clear()
        return gone

    def forget(self, identity: bytes) -> None:
        """Stop tracking ``identity`` (it was found gone some other way)."""
        where = self._where.pop(identity, None)
        if where is not None:
            ids = self._ids.get(where)
            if ids is not None:
                ids.discard(identity)
                if not ids:
                    del self._ids[where]
