"""The broker's view of its workers: who is registered, with what credit.

A ``WorkerState`` carries both the credit fields (``slots``, ``active``: moved
by ``broker.dispatch``) and the liveness fields (``last_seen``, ``progress``:
judged by ``broker.liveness``). The registry picks who gets the next request.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from broker.errors import ProtocolError
from broker.kinds import DispatchOrder, EngineKind, RegisteredState


@dataclass
class WorkerState:
    """One registered worker incarnation, keyed by its socket identity.

    Attributes:
        identity: the DEALER's routing id (fresh per incarnation).
        worker_id: the logical name the supervisor gave it (e.g. ``llm-0``).
        kind: engine kind, ``llm`` or ``rules``; routing filters on it.
        slots: credit limit, i.e. how many sequences it runs at once.
        active: broker request ids dispatched to it and not yet acked by FINAL.
        last_seen: monotonic seconds of its last message of any kind.
        progress: the last progress counter it reported (tokens processed).
        progress_at: monotonic seconds when ``progress`` last changed or it went busy.
        info: READY fields shown in ``status`` (pid, model, n_ctx, cpus, cgroup).
        started: requests this incarnation says it has started, from its last
            HEARTBEAT (its own count, not the broker's: what it really ran); None
            until a heartbeat carried one.
        host: the remote host agent that runs it (READY's ``host``), or None for
            a worker of this node's own pool; ``pick`` prefers local ones.
        compute_threads: the threads its engine computes with now, from its last
            HEARTBEAT (a llama worker drops to 1 while the host starves them); None
            until a heartbeat carried one.
    """

    identity: bytes
    worker_id: str
    kind: EngineKind
    slots: int
    last_seen: float
    progress: int = 0
    progress_at: float = 0.0
    last_dispatch: float = 0.0
    active: set[int] = field(default_factory=set)
    info: dict[str, Any] = field(default_factory=dict)
    started: int | None = None
    host: str | None = None
    compute_threads: int | None = None

    @property
    def remote(self) -> bool:
        """Whether a remote host agent runs it (not this node's pool)."""
        return self.host is not None

    def note_started(self, value: object) -> None:
        """A HEARTBEAT's ``started`` count; anything but a non-negative int is ignored."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            self.started = value

    def note_compute_threads(self, value: object) -> None:
        """A HEARTBEAT's ``compute_threads``; anything but a positive int is ignored."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            self.compute_threads = value

    @property
    def credit(self) -> int:
        """Free credit: how many more requests may be dispatched to it now."""
        return max(0, self.slots - len(self.active))

    @property
    def state(self) -> RegisteredState:
        """``busy`` while it holds any request, else ``ready``."""
        return "busy" if self.active else "ready"

    def snapshot(self, now: float) -> dict[str, Any]:
        """Its ``status`` entry (msgpack-ready)."""
        return {
            "worker_id": self.worker_id,
            "kind": self.kind,
            "state": self.state,
            "credit": self.credit,
            "slots": self.slots,
            "active": len(self.active),
            "started": self.started,
            "compute_threads": self.compute_threads,
            "last_seen_ms": max(0, round((now - self.last_seen) * 1000)),
            "host": self.host,
            "remote": self.remote,
            **self.info,
        }


#: A host agent's name in READY's ``host``: a host name's first label (no dot), at
#: most 64 characters, so ``<host>.llm-0`` is a safe file and cgroup name on the
#: agent's board and the dot alone separates the host.
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def parse_ready(identity: bytes, body: dict[str, Any], now: float) -> WorkerState:
    """Build a ``WorkerState`` from a READY body.

    A remote host agent's worker says ``host`` (its agent's name, ``HOST_NAME``)
    and its ``worker_id`` must be ``<host>.<name>``: ids are unique across
    hosts, and a remote worker can never take the place of one of the node's
    own (a READY replaces the registered worker of the same id). A worker
    without ``host`` is the node's own and its id has no ``.``.

    Raises:
        ProtocolError: a required field (``worker_id``, ``engine``, ``slots``) is
            missing or mistyped, or ``host`` and ``worker_id`` do not agree.
    """
    worker_id = body.get("worker_id")
    kind = body.get("engine")
    slots = body.get("slots")
    if not isinstance(worker_id, str) or not worker_id:
        raise ProtocolError("READY needs a non-empty string 'worker_id'")
    if kind not in ("llm", "rules", "test"):
        raise ProtocolError("READY 'engine' must be llm, rules or test")
    if not isinstance(slots, int) or isinstance(slots, bool) or not 1 <= slots <= 256:
        raise ProtocolError("READY 'slots' must be an integer in [1, 256]")
    host = _host(body.get("host"), worker_id)
    shown = ("pid", "model", "n_ctx", "cpus", "cgroup", "threads")
    info: dict[str, Any] = {k: body[k] for k in shown if k in body}
    return WorkerState(
        identity=identity,
        worker_id=worker_id,
        # A test engine stands in for the model in integration tests: route it as llm.
        kind="rules" if kind == "rules" else "llm",
        slots=slots,
        last_seen=now,
        progress_at=now,
        info={"engine": kind, **info},
        host=host,
    )


def _host(host: object, worker_id: str) -> str | None:
    """READY's ``host``, checked against ``worker_id`` (see ``parse_ready``).

    Raises:
        ProtocolError: a malformed host, or an id without (or with a foreign) prefix.
    """
    if host is None:
        if "." in worker_id:
            raise ProtocolError("READY 'worker_id' with '.' needs the 'host' that prefixes it")
        return None
    if not isinstance(host, str) or HOST_NAME.fullmatch(host) is None:
        raise ProtocolError(f"READY 'host' must match {HOST_NAME.pattern}")
    prefix, dot, name = worker_id.partition(".")
    if not dot or not name or prefix != host:
        raise ProtocolError(f"READY 'worker_id' of host {host!r} must be '{host}.<name>'")
    return host


class WorkerRegistry:
    """Registered workers by identity, and the choice of who gets the next request."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, WorkerState] = {}

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._by_identity.values()))

    def get(self, identity: bytes) -> WorkerState | None:
        """The worker with this socket identity, if registered."""
        return self._by_identity.get(identity)

    def by_worker_id(self, worker_id: str) -> WorkerState | None:
        """The registered incarnation of a logical worker, if any."""
        for w in self._by_identity.values():
            if w.worker_id == worker_id:
                return w
        return None

    def add(self, worker: WorkerState) -> None:
        """Register an incarnation (the caller removes any older one first)."""
        self._by_identity[worker.identity] = worker

    def remove(self, identity: bytes) -> WorkerState | None:
        """Unregister and return the worker, or None if it was not registered."""
        return self._by_identity.pop(identity, None)

    def pick(self, kind: EngineKind, order: DispatchOrder = "local_first") -> WorkerState | None:
        """The worker of ``kind`` that takes the next request.

        ``local_first``: a local worker (not ``remote``) with free credit before
        any remote one; among those, the most free credit, least recently used
        on ties. ``credit``: the most free credit anywhere, then least recently used.
        Returns None when no worker of that kind has credit: the request waits.
        """
        best: WorkerState | None = None
        best_key: tuple[bool, int, float] | None = None
        for w in self._by_identity.values():
            if w.kind != kind or w.credit == 0:
                continue
            key = (order == "local_first" and not w.remote, w.credit, -w.last_dispatch)
            if best_key is None or key > best_key:
                best, best_key = w, key
        return best

    def of_kind(self, kind: EngineKind) -> list[WorkerState]:
        """The registered workers of ``kind`` (``llm`` or ``rules``)."""
        return [w for w in self._by_identity.values() if w.kind == kind]

    def min_n_ctx(self, kind: EngineKind) -> int | None:
        """The smallest context (tokens) among workers of ``kind``, if any reported one."""
        sizes = [
            w.info["n_ctx"]
            for w in self._by_identity.values()
            if w.kind == kind and isinstance(w.info.get("n_ctx"), int)
        ]
        return min(sizes) if sizes else None

    def slots(self, kind: EngineKind) -> int:
        """Sequences the workers of ``kind`` run at once."""
        return sum(w.slots for w in self._by_identity.values() if w.kind == kind)

    def total_slots(self) -> int:
        """Sequences the registered pool runs at once (0 when no worker is registered)."""
        return sum(w.slots for w in self._by_identity.values())

    def total_credit(self) -> int:
        """Free credit summed over all workers."""
        return sum(w.credit for w in self._by_identity.values())
