"""Safe retry: the final replies kept a short while per (client, id), bounded.

A client that timed out may resend its ``generate``/``chat`` with the same id
and ``retry: true`` (PROTOCOL §3.5). The broker then answers the resend from
here if that request was answered within ``retry_ttl_ms``, or attaches it to
the running request (``broker.core``), so that a retried request never runs
twice. ``ReplyCache`` owns the kept replies: each with the fingerprint of the
request it answered (a resend must ask for the same thing), its size and its
expiry. It is bounded three ways, oldest out first: by age (``ttl_ms``), by
count (``max_entries``) and by the bytes of the kept bodies (``max_bytes``),
so a client cycling through ids costs the broker at most those bounds. The
time is an argument (monotonic seconds), as everywhere in the broker core.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from broker import protocol as p
from broker.client_request import ClientRequest

#: A kept reply's key: the client's routing identity and its request id.
ReplyKey = tuple[bytes, str | int]
#: Bytes an entry costs beside its body (key, fingerprint, dict slot): a rough
#: figure, so that many tiny replies are bounded by ``max_bytes`` too.
ENTRY_OVERHEAD_BYTES = 256


#: Fields that do not decide the answer: a resend may change them (a client
#: retrying with a budget of its own) and is still the same request.
NOT_FINGERPRINTED = ("id", "retry", "timeout_ms", "priority")


#: The fields that do, in ``ClientRequest``'s order.
FINGERPRINTED = tuple(
    f.name for f in dataclasses.fields(ClientRequest) if f.name not in NOT_FINGERPRINTED
)


def fingerprint(req: ClientRequest) -> bytes:
    """16 bytes that tell whether two requests ask for the same answer: a
    BLAKE2b digest of every field but ``NOT_FINGERPRINTED`` (their values
    msgpack-encoded in field order; a resend sends the same body, so the same
    ``json_schema`` order). The values are read as they are: the fields are
    immutable or, for ``json_schema``, never changed (``dataclasses.asdict``'s
    deep copy cost about a tenth of the core's time per request)."""
    fields = {name: getattr(req, name) for name in FINGERPRINTED}
    return hashlib.blake2b(p.pack(fields), digest_size=16).digest()


@dataclass(frozen=True)
class Kept:
    """One kept final reply: ``body`` (as sent), the ``fingerprint`` of the request
    it answered, its cost in ``size`` bytes and when it expires (``expires``, s)."""

    body: dict[str, Any]
    fingerprint: bytes
    size: int
    expires: float


class ReplyCache:
    """Final replies by (client, id), for ``ttl_ms`` after they were sent.

    Args:
        ttl_ms: how long a reply is kept (ms); 0 keeps none (safe retry off:
            a resend then runs again unless its request is still running).
        max_entries: most replies kept at once.
        max_bytes: most bytes kept at once: each reply's msgpack size plus
            ``ENTRY_OVERHEAD_BYTES``. A reply larger than this is not kept.
    """

    def __init__(self, ttl_ms: int, max_entries: int, max_bytes: int) -> None:
        self.ttl_s = ttl_ms / 1000
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._kept: OrderedDict[ReplyKey, Kept] = OrderedDict()  # oldest first
        self.bytes = 0
        #: Replies dropped before their time (over a bound) or never kept (too large).
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: ReplyKey, req: ClientRequest, body: dict[str, Any], now: float) -> None:
        """Keep ``body``, the final reply to ``req`` sent to ``key`` at ``now``;
        the oldest replies make room for it (counted in ``evicted``)."""
        if self.ttl_s <= 0 or self.max_entries <= 0:
            return
        self._drop(key)
        size = len(p.pack(body)) + ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            self.evicted += 1
            return
        self.expire(now)
        while self._kept and (
            len(self._kept) >= self.max_entries or self.bytes + size > self.max_bytes
        ):
            _, old = self._kept.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        # A copy: the I/O loop may still mark the one it sends (``dropped_partials``).
        self._kept[key] = Kept(dict(body), fingerprint(req), size, now + self.ttl_s)
        self.bytes += size

    def find(self, key: ReplyKey, now: float) -> Kept | None:
        """The reply kept for ``key``, unless it expired by ``now``."""
        self.expire(now)
        return self._kept.get(key)

    def expire(self, now: float) -> None:
        """Drop the replies whose time is up (all have the same TTL: the oldest first)."""
        while self._kept:
            key, oldest = next(iter(self._kept.items()))
            if oldest.expires > now:
                return
            self._drop(key)

    def forget_client(self, client: bytes) -> None:
        """Drop every reply kept for ``client`` (its connection is gone: a new one
        gets a new routing id, so nobody could ask for them)."""
        for key in [k for k in self._kept if k[0] == client]:
            self._drop(key)

    def snapshot(self) -> dict[str, int]:
        """Its ``status`` entry: replies and bytes kept, the bounds, evictions."""
        return {
            "entries": len(self._kept),
            "bytes": self.bytes,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
            "ttl_ms": round(self.ttl_s * 1000),
            "evicted": self.evicted,
        }

    def _drop(self, key: ReplyKey) -> None:
        kept = self._kept.pop(key, None)
        if kept is not None:
            self.bytes -= kept.size
