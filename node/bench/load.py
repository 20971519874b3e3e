"""Load from one raw DEALER: closed loop (a fixed number in flight) and open loop (a fixed
rate), each reply timed from its request's send. Shared by the broker-overhead and the
overload scenarios; the socket is this module's, the node or relay is the caller's."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import zmq

from broker import protocol as p

#: Wait for the stragglers of an open-loop run at most this long after its window (s).
DRAIN_S = 120.0


@dataclass(frozen=True)
class Reply:
    """A final reply, its round-trip time (ms, from the request's send) and when it came
    (s since the run's first send)."""

    body: dict[str, Any]
    rtt_ms: float
    at_s: float

    @property
    def ok(self) -> bool:
        """The request was served (not shed, not an error)."""
        return self.body.get("status") == "ok"


@dataclass(frozen=True)
class Run:
    """The replies of one load run; ``sent`` requests over ``window_s`` seconds of sending
    (closed loop: until the last reply), ``elapsed_s`` until the last reply."""

    replies: list[Reply]
    sent: int
    window_s: float
    elapsed_s: float

    @property
    def lost(self) -> int:
        """Requests sent that got no final reply."""
        return self.sent - len(self.replies)

    def served_per_s(self) -> float:
        """Goodput: ``ok`` replies per second, over the sending window or until the last
        ``ok`` reply if that came later (the backlog served after the window counts, and
        so does the time it took)."""
        ok = [r.at_s for r in self.replies if r.ok]
        return len(ok) / max([self.window_s, *ok])


class Dealer:
    """One DEALER to ``endpoint``; ``tagged``: the node's client frames (``EDGE/C1``), else
    the raw relay's ``[b"", body]``. Not thread-safe; close it."""

    def __init__(self, endpoint: str, tagged: bool) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.head = [b"", p.CLIENT_TAG] if tagged else [b""]
        self.sent: dict[str, float] = {}
        self.start = time.monotonic()  # the run's start; reset by the loops

    def send(self, body: dict[str, Any]) -> None:
        """Send ``body`` (must carry a unique ``id``) and note when."""
        self.sent[body["id"]] = time.monotonic()
        self.sock.send_multipart([*self.head, p.pack(body)])

    def receive(self, timeout_ms: int) -> Reply | None:
        """The next final reply within ``timeout_ms``; None if none came (partial replies
        are read and dropped)."""
        if not self.sock.poll(timeout_ms):
            return None
        body = p.unpack_map(self.sock.recv_multipart()[-1])
        if body.get("status") == "partial":
            return None
        rid = body.get("id")
        start = self.sent.pop(rid, None) if isinstance(rid, str) else None
        if start is None:
            return None  # not ours (a late duplicate would show up here)
        now = time.monotonic()
        return Reply(body, (now - start) * 1000, now - self.start)

    def close(self) -> None:
        """Close the socket at once."""
        self.sock.close(0)


def closed_loop(
    endpoint: str,
    tagged: bool,
    body: dict[str, Any],
    in_flight: int,
    seconds: float,
    drain_s: float = 10.0,
) -> Run:
    """Keep ``in_flight`` copies of ``body`` outstanding for ``seconds``, then drain:
    wait at most ``drain_s`` for the replies still out (those that do not come count
    as lost, so ``drain_s`` must exceed one request's longest service time).

    Each request gets ``id`` ``c<n>``; a reply is answered at once by the next request.
    """
    dealer = Dealer(endpoint, tagged)
    replies: list[Reply] = []
    n = 0
    try:
        start = dealer.start = time.monotonic()
        for _ in range(in_flight):
            dealer.send({**body, "id": f"c{n}"})
            n += 1
        while time.monotonic() - start < seconds:
            reply = dealer.receive(100)
            if reply is not None:
                replies.append(reply)
                dealer.send({**body, "id": f"c{n}"})
                n += 1
        window = time.monotonic() - start
        replies += _drain(dealer, n - len(replies), drain_s)
        return Run(replies, n, window, time.monotonic() - start)
    finally:
        dealer.close()


def open_loop(endpoint: str, body: dict[str, Any], rate: float, seconds: float) -> Run:
    """Send ``body`` at ``rate`` per second for ``seconds`` whatever the replies (offered
    load), then wait for every reply (at most ``DRAIN_S``)."""
    dealer = Dealer(endpoint, tagged=True)
    replies: list[Reply] = []
    n = 0
    try:
        start = dealer.start = time.monotonic()
        while (now := time.monotonic()) - start < seconds:
            due = start + n / rate
            if now < due:
                reply = dealer.receive(max(0, int((due - now) * 1000)))
                if reply is not None:
                    replies.append(reply)
                continue
            dealer.send({**body, "id": f"o{n}"})
            n += 1
        window = time.monotonic() - start
        replies += _drain(dealer, n - len(replies), DRAIN_S)
        return Run(replies, n, window, time.monotonic() - start)
    finally:
        dealer.close()


def _drain(dealer: Dealer, expected: int, timeout_s: float) -> list[Reply]:
    """Up to ``expected`` more final replies, within ``timeout_s``."""
    out: list[Reply] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected and time.monotonic() < deadline:
        reply = dealer.receive(50)
        if reply is not None:
            out.append(reply)
    return out
