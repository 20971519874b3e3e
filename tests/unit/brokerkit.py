"""A fake-clock harness around the sans-I/O ``broker.core.Broker``.

No sockets, no processes, no clock: the harness builds frames with the
``broker.protocol`` helpers, passes plain floats as ``now`` and drains what the
broker wants to send. It also keeps the ledger behind the central invariant of
the protocol (DESIGN.md section 3): every request a client sends gets exactly
one final (non-partial) reply. ``assert_each_answered_once`` checks it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker import protocol as p
from broker.breaker import BreakerSettings
from broker.client_request import ClientRequest, request_id_of
from broker.core import Broker
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings, WorkerEvent
from broker.routing import RoutingSettings
from broker.token_count import TokenCount

CLIENT = b"client-a"
OTHER_CLIENT = b"client-b"
W1 = b"worker-ident-1"
W2 = b"worker-ident-2"
RULES = b"rules-ident"

#: Test timings (ms): heartbeats every 100 ms x 3 misses = 0.3 s of silence is
#: death, 1 s without progress while busy is a stall, 0.2 s to ack a CANCEL.
FAST = BrokerSettings(
    max_body_bytes=4096,
    max_queue=4,
    default_timeout_ms=10_000,
    max_timeout_ms=60_000,
    default_max_tokens=16,
    heartbeat_interval_ms=100,
    heartbeat_liveness=3,
    stall_timeout_ms=1000,
    cancel_grace_ms=200,
)

FINAL_STATUSES = ("ok", "error")
RequestKey = tuple[bytes, Any]


@dataclass(frozen=True)
class ToWorker:
    """One decoded message the broker wants sent on the backend."""

    identity: bytes
    command: WorkerCommand
    body: dict[str, Any]


def generate(rid: str | int, prompt: str = "hello", **fields: Any) -> dict[str, Any]:
    """A valid ``generate`` request body."""
    return {"id": rid, "op": "generate", "prompt": prompt, **fields}


def bodies(out: list[ToWorker], identity: bytes, command: WorkerCommand) -> list[dict[str, Any]]:
    """The bodies of ``command`` messages addressed to ``identity``."""
    return [m.body for m in out if m.identity == identity and m.command is command]


class BrokerHarness:
    """Drives one ``Broker`` and records every reply it sends to clients.

    ``routing`` and ``breaker`` default to the broker's own defaults (mode ``degrade``).
    """

    def __init__(
        self,
        settings: BrokerSettings = FAST,
        routing: RoutingSettings | None = None,
        breaker: BreakerSettings | None = None,
    ) -> None:
        self.broker = Broker(settings, routing=routing, breaker=breaker)
        self.expected: Counter[RequestKey] = Counter()
        self.finals: Counter[RequestKey] = Counter()
        self.history: list[tuple[bytes, dict[str, Any]]] = []
        self.violations: list[str] = []
        self.progress: dict[bytes, int] = {}

    # ------------------------------------------------------------------ clients

    def send(
        self,
        body: dict[str, Any],
        now: float,
        client: bytes = CLIENT,
        principal: bytes | None = None,
    ) -> None:
        """A well-framed client message; its reply is expected under its id.
        ``principal``: the key its connection authenticated with (CURVE)."""
        self.send_frames(p.client_frames(client, body), now, request_id_of(body), principal)

    def send_frames(
        self,
        frames: list[bytes],
        now: float,
        expect_id: str | int | None,
        principal: bytes | None = None,
    ) -> None:
        """Any client message; exactly one final reply is expected with ``expect_id``."""
        self.expected[(frames[0], expect_id)] += 1
        self.broker.handle_client(frames, now, principal)

    def drain_replies(self) -> list[tuple[bytes, dict[str, Any]]]:
        """Decode and clear the outbox's client replies, recording finals in the ledger."""
        out: list[tuple[bytes, dict[str, Any]]] = []
        for sent in self.broker.outbox.clients:
            # Through the wire format, as the I/O loop sends it.
            client, raw = p.split_client_frames(p.client_frames(sent.client, sent.body))
            body = p.unpack_map(raw)
            self._record(client, body)
            out.append((client, body))
        self.broker.outbox.clients.clear()
        return out

    def replies(self) -> list[dict[str, Any]]:
        """Reply bodies (to any client) since the last drain."""
        return [body for _, body in self.drain_replies()]

    def _record(self, client: bytes, body: dict[str, Any]) -> None:
        key = (client, body.get("id"))
        self.history.append((client, body))
        status = body.get("status")
        if status == "partial":
            if self.finals[key] >= self.expected[key]:
                self.violations.append(f"partial after the final reply for {key}")
        elif status in FINAL_STATUSES:
            self.finals[key] += 1
        else:
            self.violations.append(f"reply with unknown status {status!r}: {body}")

    def assert_each_answered_once(self) -> None:
        """The invariant: one final reply per request sent, nothing left pending."""
        self.drain_replies()
        assert not self.violations, self.violations
        wrong = {
            key: (self.finals[key], n) for key, n in self.expected.items() if self.finals[key] != n
        }
        assert not wrong, f"(finals, expected) per (client, id): {wrong}"
        unasked = sorted(str(k) for k in self.finals if k not in self.expected)
        assert not unasked, f"final replies nobody asked for: {unasked}"
        assert self.broker.pending_jobs() == 0, "the scenario left requests unanswered"

    # ------------------------------------------------------------------ workers

    def ready(
        self,
        identity: bytes,
        now: float,
        *,
        slots: int = 1,
        worker_id: str | None = None,
        engine: str = "llm",
    ) -> None:
        """A worker incarnation registers (READY)."""
        self.progress[identity] = 0
        body = {
            "worker_id": worker_id or identity.decode(),
            "engine": engine,
            "slots": slots,
            "pid": 4242,
            "n_ctx": 2048,
        }
        self.worker_send(identity, WorkerCommand.READY, body, now)

    def worker_send(
        self, identity: bytes, command: WorkerCommand, body: dict[str, Any], now: float
    ) -> None:
        """Any worker message, framed as the backend ROUTER receives it."""
        self.broker.handle_worker([identity, *p.worker_frames(command, body)], now)

    def heartbeat(self, identity: bytes, now: float, *, advance: int = 0) -> None:
        """A worker heartbeat; ``advance`` > 0 moves its progress counter."""
        self.progress[identity] = self.progress.get(identity, 0) + advance
        body = {"state": "busy", "progress": self.progress[identity]}
        self.worker_send(identity, WorkerCommand.HEARTBEAT, body, now)

    def partial(self, identity: bytes, rid: int, text: str, now: float) -> None:
        """One generated chunk (a token is progress)."""
        self.progress[identity] = self.progress.get(identity, 0) + 1
        body = {"rid": rid, "text": text, "progress": self.progress[identity]}
        self.worker_send(identity, WorkerCommand.PARTIAL, body, now)

    def final(
        self, identity: bytes, rid: int, now: float, *, status: str = "ok", **fields: Any
    ) -> None:
        """The worker's FINAL for ``rid`` (also its ack of a CANCEL)."""
        if status == "ok":
            fields.setdefault("text", "done")
        self.worker_send(
            identity, WorkerCommand.FINAL, {"rid": rid, "status": status, **fields}, now
        )

    def drain_workers(self, *, heartbeats: bool = False) -> list[ToWorker]:
        """Decode and clear the outbox's worker frames (broker HEARTBEATs dropped by default)."""
        out: list[ToWorker] = []
        for frames in self.broker.outbox.workers:
            command, body = p.parse_worker_frames(frames[1:])
            if heartbeats or command is not WorkerCommand.HEARTBEAT:
                out.append(ToWorker(frames[0], command, body))
        self.broker.outbox.workers.clear()
        return out

    def requests(self, identity: bytes) -> list[dict[str, Any]]:
        """Drain the backend and return the REQUEST bodies sent to ``identity``.

        Fails if anything else but broker HEARTBEATs was sent, so nothing goes unseen.
        """
        out = self.drain_workers()
        others = [
            m for m in out if m.identity != identity or m.command is not WorkerCommand.REQUEST
        ]
        assert not others, f"unexpected backend traffic: {others}"
        return [m.body for m in out]

    def drain_events(self) -> list[WorkerEvent]:
        """Clear and return the supervisor events."""
        events = list(self.broker.outbox.events)
        self.broker.outbox.events.clear()
        return events

    def tick(self, now: float, *, keepalive: tuple[bytes, ...] = ()) -> None:
        """Heartbeats (without progress) from ``keepalive`` workers, then ``broker.tick``."""
        for identity in keepalive:
            self.heartbeat(identity, now)
        self.broker.tick(now)

    def credit(self, identity: bytes) -> int:
        """Free credit of a registered worker."""
        worker = self.broker.workers.get(identity)
        assert worker is not None, f"{identity!r} is not registered"
        return worker.credit


class Exact:
    """A ``broker.token_count.TokenCounter`` from a plain count: its bounded
    answer is the exact count (as ``node.engine.WordCounter``'s)."""

    def __init__(self, count: Callable[[ClientRequest], int]) -> None:
        self.count = count

    def __call__(self, req: ClientRequest) -> int:
        return self.count(req)

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        return TokenCount(self.count(req), exact=True)
