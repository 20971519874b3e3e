"""The admission gate: what may wait, in which order, and what is shed at once.

Checks run in this order, cheapest and most certain first (DESIGN.md §4):
size -> memory / CPU pressure -> bounded queue (with priority eviction) -> per-client
cap -> deadline feasibility. A refused request gets a typed ``Shed`` (HTTP 413,
429 or 503 semantics) with ``retry_after_ms`` where retrying can succeed —
unlike llama.cpp's server, which queues without bound, or Ollama/TGI, which
refuse without saying when to come back.

Deadline feasibility and ``retry_after_ms`` rest on one estimate. With
``service_estimate = "size"`` (the default) each request's service time is
predicted from its prompt tokens and ``max_tokens`` (``broker.service``), and
the queue ahead is played forward on the pool's slots: a request that could
not *finish* by its deadline is refused. A worker with several slots decodes
its running requests together, each the slower the more there are, so every
request is predicted at its *batch level*: a request starting on a worker with
k others running runs at level k + 1 (once the queue is played forward onto a
full pool, that is the worker's slot count). Until the first measured request
of an engine (and with ``"mean"``), one mean service time per engine estimates
when a request could *start*, as before.

Pressure levels come from outside (the node reads its cgroup); the gate only
reacts: ``high`` sheds sheddable work, halves the queue and the credit the
broker uses; ``critical`` admits only critical work and asks the broker to
cancel sheddable requests in flight. ``ok`` restores everything. The host's CPU
pressure (``cpu``, PSI read by the node: ``node.pressure``) has one level above
``ok``: ``high`` sheds sheddable model work as memory's ``high`` does; it leaves
the queue and the credit alone (they bound memory, not CPU time).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from broker.errors import ErrorCode
from broker.jobs import JobTable
from broker.kinds import PRIORITIES, CpuLevel
from broker.protocol import ClientRequest
from broker.service import byte_bound
from broker.stats import RETRY_AFTER_MAX_MS, RETRY_AFTER_MIN_MS, Stats
from broker.token_count import BoundedTokenCounter, TokenCount, TokenCounter
from broker.workers import WorkerRegistry

if TYPE_CHECKING:
    from broker.records import BrokerSettings, Job

#: The pool as admission plays it forward: per worker, when each of its usable
#: slots is free (s from now; a heap).
Pool = list[list[float]]


@dataclass(frozen=True)
class Shed:
    """Why a request is refused: the wire code, a machine reason and advice."""

    code: ErrorCode
    reason: str
    message: str
    retry_after_ms: int | None = None


class AdmissionGate:
    """One FIFO per priority, per-client in-flight counts and the pressure level.

    Args:
        settings: ``max_queue`` (0 = 8 per pool slot), ``max_in_flight_per_client``,
            ``service_estimate``, ``default_max_tokens``.
        stats: the broker's service-time estimates, used for ``retry_after_ms``
            and for refusing requests that could not meet their deadline.
        jobs: the broker's job table (references): the running requests whose
            remaining work delays a new one.
        count_tokens: prompt tokens of a request, or None to skip the size check
            (workers still refuse prompts that do not fit with 413). A
            ``BoundedTokenCounter`` is asked only for what its budget allows.
        workers: the broker's worker registry (a reference): which worker a free
            slot belongs to, hence the batch level a request would start at.
            Without it every free slot counts as a worker of its own.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        stats: Stats,
        jobs: JobTable,
        count_tokens: TokenCounter | None = None,
        workers: WorkerRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.stats = stats
        self.jobs = jobs
        self.count_tokens = count_tokens
        self.workers = workers if workers is not None else WorkerRegistry()
        self.pressure = "ok"
        self.cpu: CpuLevel = "ok"
        self._queues: dict[str, OrderedDict[int, Job]] = {p: OrderedDict() for p in PRIORITIES}
        self._per_client: dict[bytes, int] = {}
        # What the size check established about the request it last saw, for its
        # job: (request, at least, at most) prompt tokens; equal when counted exactly.
        self._counted: tuple[ClientRequest, int, int] | None = None

    # ------------------------------------------------------------------ queue

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __iter__(self) -> Iterator[Job]:
        """Queued jobs in dispatch order: by priority, then arrival."""
        for priority in PRIORITIES:
            yield from list(self._queues[priority].values())

    def push(self, job: Job, *, front: bool = False) -> None:
        """Queue ``job``; ``front`` puts it first in its class (a re-dispatch)."""
        if job.prompt_tokens is None:
            job.prompt_tokens = self._prompt_tokens(job.req, job.kind)
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
        """How many requests for one engine may wait: configured (or 8 per slot),
        halved under pressure."""
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
        now: float,
        kind: str = "llm",
    ) -> Shed | Job | None:
        """Decide on a new request.

        Args:
            client: the requester's routing identity.
            n_ctx: the smallest context (tokens) among workers that could serve it.
            slots: sequences the pool runs at once; ``free``: of them idle now.
            deadline_s: the request's budget in seconds.
            now: the broker's clock (s), for the work left on running requests.
            kind: the engine it is routed to; the rule engine needs neither a
                context nor memory worth protecting, so size and pressure do not
                apply to it.

        Returns:
            None to admit; a ``Shed`` to refuse; or a queued lower-priority
            ``Job`` that must be evicted (answered 503) to make room, after
            which the request is admitted.
        """
        if kind == "llm":
            shed = self._size(req, n_ctx) or self._pressure(req, slots, now)
            if shed is not None:
                return shed
        evict: Job | None = None
        # Each engine has its own bound: a model backlog must not shut out the
        # rules, the fallback meant for exactly that time (break-it session).
        if sum(j.kind == kind for j in self) >= self.queue_bound(slots):
            evict = self._eviction_victim(req.priority, kind)
            if evict is None:
                return self._shed_queue_full(slots, now)
        if self._per_client.get(client, 0) >= self.settings.max_in_flight_per_client:
            return Shed(
                ErrorCode.OVERLOADED,
                "client_cap",
                f"{self.settings.max_in_flight_per_client} requests of this client are "
                "already in flight",
                self.retry_after(slots, now),
            )
        wait_s, level = self._start(req.priority, slots, free, now, kind)
        # Sized, a request must finish in time (a stream: its first token) at the
        # batch level it would start at; by the mean, start in time (as before).
        own_s = self._due_s(req, kind, level)
        # Without workers or a measured service time there is no basis to refuse.
        if slots and self.stats.samples_of(kind) and wait_s + own_s > deadline_s:
            what = "first token" if req.stream else "service"
            own = (what, own_s, level)
            return self._shed_deadline(req, wait_s, own, deadline_s, slots, now, kind)
        return evict

    def expected_wait_s(
        self, priority: str, slots: int, free: int, now: float, kind: str = "llm"
    ) -> float:
        """Seconds until a new request of ``priority`` for ``kind``'s workers would
        start (``_start``)."""
        return self._start(priority, slots, free, now, kind)[0]

    def _start(
        self, priority: str, slots: int, free: int, now: float, kind: str
    ) -> tuple[float, int]:
        """When a new request of ``priority`` for ``kind``'s workers would start (s
        from now) and at which batch level.

        Sized: the requests queued ahead of it (its class and those above, same
        kind) are played forward on the workers' slots (``_play``); it starts on
        the slot that frees first, at the level of that slot's worker then. By the
        mean (before any measurement): ``(ahead - free + 1) / slots`` mean service
        times (Little's law), level 1 (unused: the mean ignores levels).
        """
        ahead = [
            j
            for p in PRIORITIES[: PRIORITIES.index(priority) + 1]
            for j in self._queues[p].values()
            if j.kind == kind
        ]
        if not self._sized(kind):
            if free > len(ahead):
                return 0.0, 1
            return (len(ahead) - free + 1) / max(1, slots) * self.stats.service_time(kind), 1
        slot = _next_slot(self._play(ahead, free, now, kind))
        return (0.0, 1) if slot is None else slot[:2]

    def retry_after(
        self, slots: int, now: float, kind: str = "llm", fits: Callable[[int], bool] | None = None
    ) -> int:
        """Advice for a shed client (ms, clamped): when a request queued last for
        ``kind`` would start, by the same estimate as the deadline check (the mean
        one: ``Stats.retry_after_ms`` over the whole queue). With ``fits`` (sized
        only): when it would start on a worker at a batch level ``fits`` accepts
        (a request refused only for the load beside it retries once that eased)."""
        if not self._sized(kind):
            return self.stats.retry_after_ms(len(self), slots)
        queued = [j for j in self if j.kind == kind]
        idle = max(0, slots - len(self._running(kind)))
        pool = self._play(queued, idle, now, kind)
        estimate = _first_fit(pool, fits or (lambda _level: True)) * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))

    # ------------------------------------------------------------------ estimates

    def _sized(self, kind: str) -> bool:
        """Whether ``kind``'s requests are estimated by size (else by the mean)."""
        return self.settings.service_estimate == "size" and self.stats.sizes.ready(kind)

    def _prompt_tokens(self, req: ClientRequest, kind: str) -> float | None:
        """The size check's exact count of ``req`` if it made one, else, when sized,
        the estimate from its bytes (within the bounds the size check found: a
        prompt over the context is refused by its worker at once, so it never costs
        more than the largest prompt that fits); None if neither."""
        low: int = 0
        high: int | None = None
        if self._counted is not None and self._counted[0] is req:
            _, low, high = self._counted
            if low == high:
                return low
        if not self._sized(kind):
            return None
        estimate = self.stats.sizes.prompt_tokens(kind, req)
        if estimate is None:
            return None
        return max(low, estimate if high is None else min(estimate, high))

    def _service_s(
        self, req: ClientRequest, tokens: float | None, kind: str, level: int = 1
    ) -> float:
        """Predicted service (s) of ``req`` with ``tokens`` prompt tokens (None: count
        or estimate them) at batch ``level``; 0.0 when not sized (the mean asks
        only when it starts)."""
        if not self._sized(kind):
            return 0.0
        if tokens is None:
            tokens = self._prompt_tokens(req, kind) or 0.0
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        return self.stats.sizes.predict_s(kind, tokens, max_tokens, level)

    def _due_s(self, req: ClientRequest, kind: str, level: int = 1) -> float:
        """How much of ``req`` must be done by its deadline, as predicted service (s)
        once started at batch ``level``: all of it, or for ``stream: true`` its
        first token (prefill and one decode step): a streaming client uses the
        tokens as they come, and the deadline then ends it with 504 and the text
        so far. 0.0 when not sized."""
        if not req.stream:
            return self._service_s(req, None, kind, level)
        if not self._sized(kind):
            return 0.0
        tokens = self._prompt_tokens(req, kind) or 0.0
        return self.stats.sizes.first_token_s(kind, tokens, level)

    def _job_service_s(self, job: Job, level: int = 1) -> float:
        if job.prompt_tokens is None:  # queued before the first measurement
            job.prompt_tokens = self._prompt_tokens(job.req, job.kind)
        return self._service_s(job.req, job.prompt_tokens, job.kind, level)

    def _running(self, kind: str) -> list[Job]:
        """``kind``'s jobs holding a slot (a cancelled one until its worker acks)."""
        return [
            j
            for j in self.jobs
            if j.kind == kind and j.worker is not None and j.dispatched_at is not None
        ]

    def _play(self, ahead: list[Job], free: int, now: float, kind: str) -> Pool:
        """The pool once ``ahead`` (in dispatch order) has started: list scheduling
        on the workers' slots, which free up when a running request's predicted
        work is done (at once if answered: its cancel ack is due) or now
        (``free`` of them, spread over the workers as ``WorkerRegistry.pick``
        does). Each job runs at the batch level of the worker whose slot it takes
        when it starts (``_next_slot``); a running job at its worker's level now."""
        by_worker: dict[bytes | int, list[Job]] = {}
        for job in self._running(kind):
            assert job.worker is not None
            by_worker.setdefault(job.worker, []).append(job)
        pool: dict[bytes | int, list[float]] = {
            worker: [self._left_s(job, now, len(jobs)) for job in jobs]
            for worker, jobs in by_worker.items()
        }
        credit = {w.identity: w.credit for w in self.workers.of_kind(kind)}
        for n in range(free):
            best = max(credit, key=lambda identity: credit[identity], default=None)
            if best is None or credit[best] <= 0:
                pool[n] = [0.0]  # credit the registry does not show: a slot of its own
                continue
            credit[best] -= 1
            pool.setdefault(best, []).append(0.0)
        heaps = list(pool.values())
        for heap in heaps:
            heapq.heapify(heap)
        for job in ahead:
            slot = _next_slot(heaps)
            if slot is None:
                break  # no slot at all: nothing to wait for that can be estimated
            start, level, heap = slot
            heapq.heapreplace(heap, start + self._job_service_s(job, level))
        return heaps

    def _left_s(self, job: Job, now: float, level: int) -> float:
        """Predicted work left (s) of the running ``job`` at batch ``level``."""
        if job.settled:
            return 0.0
        started = now if job.dispatched_at is None else job.dispatched_at
        return max(0.0, self._job_service_s(job, level) - (now - started))

    def _shed_deadline(
        self,
        req: ClientRequest,
        wait_s: float,
        own: tuple[str, float, int],
        deadline_s: float,
        slots: int,
        now: float,
        kind: str,
    ) -> Shed:
        """503 ``deadline_unmeetable``; ``own``: what of the request was due, its
        predicted time (``"service"`` or ``"first token"``, s) and the batch level
        it was predicted at."""
        what, own_s, level = own
        budget = f"the {deadline_s * 1000:.0f} ms budget"
        alone_s = own_s if level == 1 else self._due_s(req, kind, 1)
        if alone_s > deadline_s:  # even an idle pool could not: retrying cannot help
            message = f"expected {what} {alone_s * 1000:.0f} ms alone exceeds {budget}"
            return Shed(ErrorCode.UNAVAILABLE, "deadline_unmeetable", message)
        message = f"expected wait {wait_s * 1000:.0f} ms"
        if own_s:
            message += f" + {what} {own_s * 1000:.0f} ms"
        if level > 1:
            message += f" at batch level {level}"

        def fits(at: int) -> bool:
            return self._due_s(req, kind, at) <= deadline_s

        return Shed(
            ErrorCode.UNAVAILABLE,
            "deadline_unmeetable",
            f"{message} exceeds {budget}",
            self.retry_after(slots, now, kind, fits),
        )

    def _size(self, req: ClientRequest, n_ctx: int | None) -> Shed | None:
        """413 if ``req``'s prompt tokens + ``max_tokens`` exceed ``n_ctx`` (tokens).

        Tokenizing runs on the broker's loop, so it is the last resort: a prompt
        whose bytes bound it inside the context is not counted, and a bounded
        counter stops as soon as its lower bound exceeds what fits, or when its
        budget is spent; the worker then decides (and refuses with 413 at once).
        """
        if self.count_tokens is None or n_ctx is None:
            return None
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        limit = n_ctx - max_tokens  # prompt tokens that fit
        if byte_bound(req) <= limit:
            return None  # fits for sure: skip tokenizing (milliseconds on the loop)
        if isinstance(self.count_tokens, BoundedTokenCounter):
            found = self.count_tokens.bounded(req, limit)
        else:
            found = TokenCount(self.count_tokens(req), exact=True)
        if found.tokens <= limit:
            self._counted = (req, found.tokens, found.tokens if found.exact else limit)
            return None
        prompt = f"prompt {found.tokens}" if found.exact else f"prompt at least {found.tokens}"
        return Shed(
            ErrorCode.TOO_LARGE,
            "too_large",
            f"{prompt} tokens + max_tokens {max_tokens} = {found.tokens + max_tokens} exceeds "
            f"the context of {n_ctx} tokens",
        )

    def _pressure(self, req: ClientRequest, slots: int, now: float) -> Shed | None:
        refused = (self.pressure == "high" and req.priority == "sheddable") or (
            self.pressure == "critical" and req.priority != "critical"
        )
        if refused:
            return Shed(
                ErrorCode.UNAVAILABLE,
                "memory_pressure",
                f"memory pressure is {self.pressure}: {req.priority} work is shed",
                self.retry_after(slots, now),
            )
        if self.cpu == "high" and req.priority == "sheddable":
            return Shed(
                ErrorCode.UNAVAILABLE,
                "cpu_pressure",
                "the host's CPU is under pressure: sheddable work is shed",
                self.retry_after(slots, now),
            )
        return None

    def _eviction_victim(self, priority: str, kind: str) -> Job | None:
        """The newest queued ``kind`` job of a lower class than ``priority``, if any."""
        rank = PRIORITIES.index(priority)
        for p in reversed(PRIORITIES[rank + 1 :]):
            victim = next((j for j in reversed(self._queues[p].values()) if j.kind == kind), None)
            if victim is not None:
                return victim
        return None

    def _shed_queue_full(self, slots: int, now: float) -> Shed:
        return Shed(
            ErrorCode.UNAVAILABLE,
            "queue_full",
            f"queue is full ({self.queue_bound(slots)} waiting)",
            self.retry_after(slots, now),
        )

    def shed_for_pressure(self) -> list[Job]:
        """Queued jobs the current pressure no longer admits (to answer 503)."""
        classes = {"ok": (), "high": ("sheddable",), "critical": ("normal", "sheddable")}
        queued = (j for p in classes[self.pressure] for j in self._queues[p].values())
        return [j for j in queued if j.kind == "llm"]  # the rules need no memory to speak of

    def shed_for_cpu(self) -> list[Job]:
        """Queued sheddable model jobs while the host's CPU is under pressure (to answer 503)."""
        if self.cpu == "ok":
            return []
        return [j for j in self._queues["sheddable"].values() if j.kind == "llm"]


def _next_slot(pool: Pool) -> tuple[float, int, list[float]] | None:
    """The slot the next request would take: the earliest to free (s from now),
    on a tie the worker's with the most slots free then (``WorkerRegistry.pick``);
    with its batch level (the worker's slots still busy then, plus itself) and
    its worker's heap. None if the pool has no slot."""
    best: tuple[float, int, list[float]] | None = None
    most_free = 0
    for heap in pool:
        if not heap:
            continue
        free = sum(1 for t in heap if t <= heap[0])
        if best is None or (heap[0], -free) < (best[0], -most_free):
            best, most_free = (heap[0], len(heap) - free + 1, heap), free
    return best


def _first_fit(pool: Pool, fits: Callable[[int], bool]) -> float:
    """The first time (s from now) a slot is free on a worker whose batch level
    then (``_next_slot``'s rule) ``fits`` accepts; once every slot is free the
    level is 1. 0.0 for a pool without slots."""
    for t in sorted({0.0, *(x for heap in pool for x in heap)}):
        free_then = [(sum(1 for x in h if x <= t), len(h)) for h in pool if h and h[0] <= t]
        if free_then:
            free, size = max(free_then)
            if fits(size - free + 1):
                return t
    return max((x for heap in pool for x in heap), default=0.0)
