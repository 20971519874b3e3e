"""Delivery of replies to clients: what waits, what is dropped, who is gone.

The frontend ROUTER sends without blocking (``ROUTER_MANDATORY``): a send to a
client whose pipe is full fails with EAGAIN, one to a client that is gone with
EHOSTUNREACH. ``Delivery`` decides what each outcome means, without any I/O:

* a **final** reply that cannot be sent now waits in its client's backlog
  (bounded: ``client_backlog`` finals) and is sent, in order, when the pipe
  drains; a client whose backlog overflows is judged gone;
* a **partial** reply that cannot be sent now is dropped (so is one for a
  client with a backlog: the room is the finals'); the next message of that
  request that is sent carries ``dropped_partials``, the number of the
  request's partials dropped so far (PROTOCOL §10);
* a client that is unreachable is gone.

A gone client's requests are the broker's to end (``Broker.client_gone``).
The I/O loop owns the socket: it offers each message, tries the send, and
reports the outcome (``settle``); it retries the backlog when the frontend
polls writable or ``next_retry`` comes. Times are monotonic seconds.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from enum import Enum
from typing import Any

from broker import protocol as p
from broker.kinds import FinalOutcome

#: Interval of backlog rounds by time (s). The loop also tries when the
#: frontend polls writable, but POLLOUT on a ROUTER means that *some* peer has
#: room (libzmq ``router_t::xhas_out`` with ``ROUTER_MANDATORY``): with other
#: clients idle it stays set while the slow client's pipe is full, so a round
#: that finds it so stops listening to POLLOUT, and the timer keeps the loop
#: from spinning. 20 ms: a reader that resumes waits at most that long.
RETRY_S = 0.02


class ReplyKind(Enum):
    """Whether a reply ends its request (``final``) or is a streamed chunk."""

    PARTIAL = "partial"
    FINAL = "final"


class Fate(Enum):
    """What became of one try to send a reply."""

    SENT = "sent"
    #: EAGAIN: the client's pipe is at its high-water mark (it is not reading).
    FULL = "full"
    #: EHOSTUNREACH: the ROUTER has no pipe to that routing id (it disconnected).
    GONE = "gone"


class Offer(Enum):
    """What ``Delivery.offer`` makes of a new reply."""

    #: Try to send it now.
    SEND = "send"
    #: Not now: a final waits in its client's backlog, a partial was dropped.
    HELD = "held"
    #: A final was queued and its client's backlog overflowed: the client is gone.
    OVERFLOW = "overflow"


class GoneCause(Enum):
    """Why a client is treated as disconnected (``Broker.client_gone``)."""

    #: The frontend's socket monitor saw its connection close.
    DISCONNECTED = "disconnected"
    #: A send found no pipe to it (EHOSTUNREACH).
    UNREACHABLE = "unreachable"
    #: More finals waited for it than ``client_backlog``.
    BACKLOG_OVERFLOW = "backlog_overflow"


@dataclass
class Outgoing:
    """One reply for the client ``client`` (its ROUTER routing id).

    The body is packed only when sent, so a ``dropped_partials`` marker can
    still be added to it. ``counted``: the outcome (``FinalOutcome``) a final was counted
    under (e.g. ``ok``); if it never reaches its client, it counts as
    ``client_gone`` instead.
    """

    client: bytes
    body: dict[str, Any]
    kind: ReplyKind = ReplyKind.FINAL
    counted: FinalOutcome | None = None

    @property
    def request(self) -> tuple[bytes, Any]:
        """The client's request this reply belongs to: (routing id, ``id``)."""
        return self.client, self.body.get("id")


class Delivery:
    """Per-client backlogs of finals, dropped-partial counts, and the verdicts.

    Args:
        max_backlog: finals one client may have waiting (>= 1); one more and
            the client is judged gone (``GoneCause.BACKLOG_OVERFLOW``).
        counters: where to count (the broker's outcome counters, shown by
            ``status``): ``partials_delivered``, ``partials_dropped``,
            ``finals_delivered``, ``finals_backlogged`` (finals that had to
            wait), ``finals_undeliverable`` (finals that never reached their
            client: it was gone, or its backlog overflowed; the outcome such a
            final was counted under moves to ``client_gone``), ``backlog_overflows``.
        retry_s: pause after a backlog round that sent nothing (s).
    """

    def __init__(self, max_backlog: int, counters: Counter[str], retry_s: float = RETRY_S) -> None:
        self.max_backlog = max_backlog
        self.counters = counters
        self.retry_s = retry_s
        self._backlog: dict[bytes, deque[Outgoing]] = {}
        self._dropped: dict[tuple[bytes, Any], int] = {}
        #: When the next backlog round is due by time alone (monotonic s).
        self._next_round = 0.0
        #: Whether POLLOUT on the frontend may mean room for a backlog (RETRY_S).
        self._pollout_useful = True

    # ------------------------------------------------------------------ new replies

    def offer(self, out: Outgoing) -> Offer:
        """A new reply from the broker: ``SEND`` it now, or it is ``HELD``: a
        final waits behind its client's backlog, a partial for a client with a
        backlog is dropped (the room is the finals'). ``OVERFLOW``: the final
        was queued and the backlog is now over its bound: the client is gone."""
        if not self._backlog.get(out.client):
            return Offer.SEND
        if out.kind is ReplyKind.PARTIAL:
            self._drop_partial(out)
            return Offer.HELD
        self._queue(out)
        return Offer.OVERFLOW if self._overflowed(out.client) else Offer.HELD

    def frames(self, out: Outgoing) -> list[bytes]:
        """The frames to send for ``out``, with its request's ``dropped_partials``
        (the count so far) added when some of its partials were dropped."""
        dropped = self._dropped.get(out.request)
        if dropped:
            out.body["dropped_partials"] = dropped
        return p.client_frames(out.client, out.body)

    def settle(self, out: Outgoing, fate: Fate) -> GoneCause | None:
        """Record what became of a try to send ``out`` (new or a backlog's head).

        Returns the verdict on its client when this try shows it is gone
        (unreachable, or its backlog overflowed); the caller then ends the
        client's requests and calls ``forget``.
        """
        backlogged = self._head_is(out)
        if fate is Fate.SENT:
            if backlogged:
                self._pop_head(out.client)
            self._delivered(out)
            return None
        if fate is Fate.GONE:
            if not backlogged:  # a backlog's finals are counted by ``forget``
                self._lost(out)
            return GoneCause.UNREACHABLE
        # FULL: the client is not reading.
        if out.kind is ReplyKind.PARTIAL:
            self._drop_partial(out)
            return None
        if not backlogged:
            self._queue(out)
        return GoneCause.BACKLOG_OVERFLOW if self._overflowed(out.client) else None

    def forget(self, client: bytes) -> int:
        """``client`` is gone: its waiting finals will never be delivered (counted
        ``finals_undeliverable``; an overflowing backlog also counts one
        ``backlog_overflows``) and its dropped-partial counts go. Returns how
        many finals were discarded."""
        waiting = self._backlog.pop(client, deque())
        if len(waiting) > self.max_backlog:
            self.counters["backlog_overflows"] += 1
        for out in waiting:
            self._lost(out)
        for key in [k for k in self._dropped if k[0] == client]:
            del self._dropped[key]
        return len(waiting)

    # ------------------------------------------------------------------ the backlog

    def has_backlog(self) -> bool:
        """Whether any final waits for its client."""
        return bool(self._backlog)

    def clients(self) -> list[bytes]:
        """The clients with finals waiting, oldest backlog first."""
        return list(self._backlog)

    def head(self, client: bytes) -> Outgoing | None:
        """``client``'s oldest waiting final, the next to try (None: none waits)."""
        waiting = self._backlog.get(client)
        return waiting[0] if waiting else None

    def wants_pollout(self) -> bool:
        """Whether the loop should also wake when the frontend polls writable:
        a backlog exists and POLLOUT has not just proven to be about other peers."""
        return bool(self._backlog) and self._pollout_useful

    def due(self, now: float) -> bool:
        """Whether a backlog round is due by time (``retry_s`` after the last)."""
        return bool(self._backlog) and now >= self._next_round

    def next_retry(self, now: float) -> float | None:
        """Seconds until a backlog round is due by time (None: no backlog)."""
        return max(0.0, self._next_round - now) if self._backlog else None

    def round_done(self, sent: int, now: float, woken_by_pollout: bool) -> None:
        """A backlog round ended having sent ``sent`` finals. The next is due by
        time ``retry_s`` later. One that sent nothing although the frontend
        polled writable shows that the room is some other peer's: POLLOUT is
        then ignored until a round sends something again."""
        self._next_round = now + self.retry_s
        if sent:
            self._pollout_useful = True
        elif woken_by_pollout:
            self._pollout_useful = False

    def snapshot(self) -> dict[str, int]:
        """For ``status``: ``backlog`` (finals waiting now, over all clients) and
        ``backlog_clients`` (clients with finals waiting)."""
        return {
            "backlog": sum(len(q) for q in self._backlog.values()),
            "backlog_clients": len(self._backlog),
            "max_backlog": self.max_backlog,
        }

    # ------------------------------------------------------------------ internals

    def _queue(self, out: Outgoing) -> None:
        self._backlog.setdefault(out.client, deque()).append(out)
        self.counters["finals_backlogged"] += 1

    def _overflowed(self, client: bytes) -> bool:
        return len(self._backlog.get(client, ())) > self.max_backlog

    def _lost(self, out: Outgoing) -> None:
        """``out`` found its client gone: it is never delivered."""
        if out.kind is ReplyKind.PARTIAL:
            self.counters["partials_dropped"] += 1
            return
        self.counters["finals_undeliverable"] += 1
        if out.counted is not None:  # an answer its client never got is not an ``ok``
            self.counters[out.counted] -= 1
            self.counters["client_gone"] += 1

    def _head_is(self, out: Outgoing) -> bool:
        waiting = self._backlog.get(out.client)
        return waiting is not None and bool(waiting) and waiting[0] is out

    def _pop_head(self, client: bytes) -> None:
        waiting = self._backlog[client]
        waiting.popleft()
        if not waiting:
            del self._backlog[client]

    def _drop_partial(self, out: Outgoing) -> None:
        self._dropped[out.request] = self._dropped.get(out.request, 0) + 1
        self.counters["partials_dropped"] += 1

    def _delivered(self, out: Outgoing) -> None:
        if out.kind is ReplyKind.PARTIAL:
            self.counters["partials_delivered"] += 1
        else:
            self.counters["finals_delivered"] += 1
            self._dropped.pop(out.request, None)  # the request is over
