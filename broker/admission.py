"""The admission gate: what may wait, in which order, and what is shed at once.

Checks run in this order, cheapest and most certain first (DESIGN.md §4):
size -> memory pressure -> bounded queue (with priority eviction) -> per-client
cap -> deadline feasibility. A refused request gets a typed ``Shed`` (HTTP 413,
429 or 503 semantics) with ``retry_after_ms`` where retrying can succeed —
unlike llama.cpp's server, which queues without bound, or Ollama/TGI, which
refuse without saying when to come back.

Pressure levels come from outside (the node reads its cgroup); the gate only
reacts: ``high`` sheds sheddable work, halves the queue and the credit the
broker uses; ``critical`` admits only critical work and asks the broker to
cancel sheddable requests in flight. ``ok`` restores everything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.errors import ErrorCode
from broker.protocol import ClientRequest
from broker.stats import Stats

if TYPE_CHECKING:
    from broker.core import BrokerSettings, Job

PRIORITIES = ("critical", "normal", "sheddable")  # dispatch and eviction order
PRESSURE_LEVELS = ("ok", "high", "critical")

#: Counts a request's prompt in tokens (the node injects the model's tokenizer).
TokenCounter = Callable[[ClientRequest], int]


@dataclass(frozen=True)
class Shed:
    """Why a request is refused: the wire code, a machine reason and advice."""

    code: ErrorCode
    reason: str
    message: str
    retry_after_ms: int | None = None


#: Template tokens a chat message may add around its content (role markers,
#: turn delimiters): Gemma's template uses 4-5.
CHAT_TOKENS_PER_MESSAGE = 6


def byte_bound(req: ClientRequest) -> int:
    """An upper bound on the prompt's tokens without tokenizing: every token of a
    byte-level BPE or SentencePiece (byte-fallback) vocabulary covers at least one
    byte, plus BOS and the chat template's tokens per message."""
    if req.prompt is not None:
        return len(req.prompt.encode()) + 1
    messages = req.messages or ()
    text = sum(len(content.encode()) for _, content in messages)
    return text + 1 + CHAT_TOKENS_PER_MESSAGE * len(messages)


class AdmissionGate:
    """One FIFO per priority, per-client in-flight counts and the pressure level.

    Args:
        settings: ``max_queue`` (0 = 8 per pool slot), ``max_in_flight_per_client``.
        stats: the broker's service-time estimate, used for ``retry_after_ms``
            and for refusing requests that could not start before their deadline.
        count_tokens: prompt tokens of a request, or None to skip the size check
            (workers still refuse prompts that do not fit with 413).
    """

    def __init__(
        self, settings: BrokerSettings, stats: Stats, count_tokens: TokenCounter | None = None
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.count_tokens = count_tokens
        self.pressure = "ok"
        self._queues: dict[str, OrderedDict[int, Job]] = {p: OrderedDict() for p in PRIORITIES}
        self._per_client: dict[bytes, int] = {}

    # ------------------------------------------------------------------ queue

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        """Queued jobs in dispatch order: by priority, then arrival."""
        for priority in PRIORITIES:
            yield from list(self._queues[priority].values())

    def push(self, job: Job, *, front: bool = False) -> None:
        """Queue ``job``; ``front`` puts it first in its class (a re-dispatch)."""
        queue = self._queues[job.req.priority]
        queue[job.rid] = job
        if front:
            queue.move_to_end(job.rid, last=False)

    def remove(self, job: Job) -> bool:
        """Take ``job`` out of the queue; False if it was not queued."""
        return self._queues[job.req.priority].pop(job.rid, None) is not None

    def queued(self, priority: str) -> list[Job]:
        """The queued jobs of one priority class, oldest first."""
        return list(self._queues[priority].values())

    # ------------------------------------------------------------------ clients

    def opened(self, client: bytes) -> None:
        """A request of ``client`` was accepted."""
        self._per_client[client] = self._per_client.get(client, 0) + 1

    def closed(self, client: bytes) -> None:
        """A request of ``client`` was answered."""
        left = self._per_client.get(client, 0) - 1
        if left > 0:
            self._per_client[client] = left
        else:
            self._per_client.pop(client, None)

    # ------------------------------------------------------------------ limits

    def queue_bound(self, slots: int) -> int:
        """How many may wait: configured (or 8 per slot), halved under pressure."""
        bound = self.settings.max_queue or 8 * max(1, slots)
        return bound if self.pressure == "ok" else max(1, bound // 2)

    def concurrency(self, slots: int) -> int:
        """How much of the pool's credit the broker may use now."""
        return slots if self.pressure == "ok" else max(1, slots // 2)

    # ------------------------------------------------------------------ the gate

    def check(
        self,
        client: bytes,
        req: ClientRequest,
        n_ctx: int | None,
        slots: int,
        free: int,
        deadline_s: float,
        kind: str = "llm",
    ) -> Shed | Job | None:
        """Decide on a new request.

        Args:
            client: the requester's routing identity.
            n_ctx: the smallest context (tokens) among workers that could serve it.
            slots: sequences the pool runs at once; ``free``: of them idle now.
            deadline_s: the request's budget in seconds.
            kind: the engine it is routed to; the rule engine needs neither a
                context nor memory worth protecting, so size and pressure do not
                apply to it.

        Returns:
            None to admit; a ``Shed`` to refuse; or a queued lower-priority
            ``Job`` that must be evicted (answered 503) to make room, after
            which the request is admitted.
        """
        if kind == "llm":
            shed = self._size(req, n_ctx) or self._pressure(req, slots)
            if shed is not None:
                return shed
        evict: Job | None = None
        if len(self) >= self.queue_bound(slots):
            evict = self._eviction_victim(req.priority)
            if evict is None:
                return self._shed_queue_full(slots)
        if self._per_client.get(client, 0) >= self.settings.max_in_flight_per_client:
            return Shed(
                ErrorCode.OVERLOADED,
                "client_cap",
                f"{self.settings.max_in_flight_per_client} requests of this client are "
                "already in flight",
                self.retry_after(slots),
            )
        wait_s = self.expected_wait_s(req.priority, slots, free, kind)
        # Without workers or a measured service time there is no basis to refuse.
        if slots and self.stats.samples_of(kind) and wait_s > deadline_s:
            return Shed(
                ErrorCode.UNAVAILABLE,
                "deadline_unmeetable",
                f"expected wait {wait_s * 1000:.0f} ms exceeds the {deadline_s * 1000:.0f}"
                " ms budget",
                self.retry_after(slots),
            )
        return evict

    def expected_wait_s(self, priority: str, slots: int, free: int, kind: str = "llm") -> float:
        """Seconds until a new request of ``priority`` for ``kind``'s workers would
        start (Little's law over the requests queued ahead of it for the same kind)."""
        ahead = 0
        for p in PRIORITIES:
            ahead += sum(1 for j in self._queues[p].values() if j.kind == kind)
            if p == priority:
                break
        if free > ahead:
            return 0.0
        return (ahead - free + 1) / max(1, slots) * self.stats.service_time(kind)

    def retry_after(self, slots: int) -> int:
        """Advice for a shed client, from the live service time and the queue."""
        return self.stats.retry_after_ms(len(self), slots)

    def _size(self, req: ClientRequest, n_ctx: int | None) -> Shed | None:
        if self.count_tokens is None or n_ctx is None:
            return None
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        if byte_bound(req) + max_tokens <= n_ctx:
            return None  # fits for sure: skip tokenizing (milliseconds on the loop)
        prompt = self.count_tokens(req)
        wanted = prompt + max_tokens
        if wanted <= n_ctx:
            return None
        return Shed(
            ErrorCode.TOO_LARGE,
            "too_large",
            f"prompt {prompt} tokens + max_tokens {wanted - prompt} = {wanted} exceeds the "
            f"context of {n_ctx} tokens",
        )

    def _pressure(self, req: ClientRequest, slots: int) -> Shed | None:
        refused = (self.pressure == "high" and req.priority == "sheddable") or (
            self.pressure == "critical" and req.priority != "critical"
        )
        if not refused:
            return None
        return Shed(
            ErrorCode.UNAVAILABLE,
            "memory_pressure",
            f"memory pressure is {self.pressure}: {req.priority} work is shed",
            self.retry_after(slots),
        )

    def _eviction_victim(self, priority: str) -> Job | None:
        """The newest queued job of a lower class than ``priority``, if any."""
        rank = PRIORITIES.index(priority)
        for p in reversed(PRIORITIES[rank + 1 :]):
            if self._queues[p]:
                return next(reversed(self._queues[p].values()))
        return None

    def _shed_queue_full(self, slots: int) -> Shed:
        return Shed(
            ErrorCode.UNAVAILABLE,
            "queue_full",
            f"queue is full ({self.queue_bound(slots)} waiting)",
            self.retry_after(slots),
        )

    def shed_for_pressure(self) -> list[Job]:
        """Queued jobs the current pressure no longer admits (to answer 503)."""
        classes = {"ok": (), "high": ("sheddable",), "critical": ("normal", "sheddable")}
        queued = (j for p in classes[self.pressure] for j in self._queues[p].values())
        return [j for j in queued if j.kind == "llm"]  # the rules need no memory to speak of
