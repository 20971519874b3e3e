"""How long requests take: the one service-time estimator behind admission.

``ServiceEstimator`` owns everything learned about service times and answers
the three questions admission asks (``broker.admission``): when a new request
would *start* (``wait``: the queue ahead played forward on the workers' slots),
how long it would *take* (``service_s``/``due_s``), and when a refused client
should *come back* (``retry_after_ms``). It predicts in one of two ways:

* **by size** (``broker.service_estimate = "size"``, the default, once an
  engine has a measured request): each request from its prompt tokens and
  ``max_tokens`` at the batch level it would run at (``broker.service_model``);
* **by the mean** (before the first measured request, and always with
  ``"mean"``, which benchmarks compare): one EWMA of dispatch-to-final time
  per engine kind and class (``ServiceClass``: ``json_schema`` or not); a
  request is then only asked to *start* in time.

The per-token rates by batch level are ``broker.service_model.ServiceModel``'s;
each worker's batch level over time is ``broker.batch_levels.BatchLevels``'s.
The estimator owns one of each, and the mean service time per engine kind and class.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from broker.batch_levels import BatchLevels
from broker.client_request import ClientRequest
from broker.kinds import EngineKind
from broker.records import Job
from broker.service_model import ALPHA, ServiceModel

#: Bounds of any ``retry_after_ms`` we advertise: below 50 ms a client would
#: hammer the node; above 30 s the advice is useless (callers should give up).
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 30_000

#: The mean service time (s) assumed before any measurement; the first one replaces it.
INITIAL_SERVICE_S = 1.0

#: What a mean service time is kept per: the engine kind and whether the request is
#: constrained by a ``json_schema``. Its grammar slows every decode step several
#: times over (docs/bench/figures.md, broker.service_model), so the size model learns
#: nothing from such requests; one mean over both let four long schema prompts
#: (7.4 s) price a flood of short plain ones at 7.4 s each: 503s advising 26-30 s for
#: a backlog that cleared in 14 s (break-it finding D2, tests/unit/test_admission_retry.py).
ServiceClass = tuple[EngineKind, bool]

#: The pool as the estimator plays it forward: per worker, when each of its
#: usable slots is free (s from now; a heap).
Pool = list[list[float]]


@dataclass(frozen=True)
class Slots:
    """One engine kind's slots at a moment, as the estimator plays a queue onto them.

    ``slots``: sequences its workers run at once; ``free``: of them usable now
    (the broker's free credit, fewer under memory pressure); ``running``: its
    jobs holding a slot (a cancelled one until its worker acks); ``credit``: per
    worker identity, its free credit, so that free slots are spread over the
    workers as ``WorkerRegistry.pick`` does (without it every free slot counts as
    a worker of its own).
    """

    kind: EngineKind
    slots: int
    free: int
    running: Sequence[Job] = ()
    credit: Mapping[bytes, int] = field(default_factory=dict)


class ServiceEstimator:
    """Service times of both engine kinds: learned, predicted and advised.

    Args:
        by_size: predict each request from its size once a kind has a measured
            request (``service_estimate = "size"``); False: always by the mean.
        default_max_tokens: the ``max_tokens`` of a request that sets none.

    ``sizes`` holds the per-token rates by batch level (``ServiceModel``);
    ``levels`` follows each worker's running requests over time (``levels.running``
    on every change of a worker's running set: dispatch, ``on_final``, a lost
    worker; ``levels.first_token`` on a request's first token) to tell each
    finished request's batch level. The mean is one EWMA per kind: a rule answer (milliseconds)
    must not dilute the model's (seconds), nor the model's make rules look slow; and within
    a kind one per class (``ServiceClass``): a grammar-bound request must not price plain ones.
    """

    def __init__(self, by_size: bool = True, default_max_tokens: int = 128) -> None:
        self.by_size = by_size
        self.default_max_tokens = default_max_tokens
        self.sizes = ServiceModel()
        self.levels = BatchLevels()
        self._mean: dict[ServiceClass, float] = {}
        self._samples: Counter[ServiceClass] = Counter()
        self._tested_at: dict[EngineKind, float] = {}

    # ------------------------------------------------------------------ learning

    def observe_service(
        self, seconds: float, kind: EngineKind = "llm", constrained: bool = False
    ) -> None:
        """Fold one request's dispatch-to-final time (s) into the mean of ``kind``'s
        plain requests, or with ``constrained`` of its ``json_schema`` ones."""
        seconds = max(0.0, seconds)
        klass = (kind, constrained)
        self._samples[klass] += 1
        if self._samples[klass] == 1:
            self._mean[klass] = seconds  # the first measurement beats the guess
        else:
            self._mean[klass] += ALPHA * (seconds - self._mean[klass])

    def on_final(
        self,
        worker: bytes,
        running: Collection[int],
        now: float,
        measured: Job | None = None,
        usage: object = None,
    ) -> None:
        """A FINAL came from ``worker`` at ``now``; it now runs ``running`` (its
        running set without the finished request).

        ``measured``: the job it answered ``ok`` (dispatched): its dispatch-to-final
        time joins the mean; with a first token and the worker's ``usage``, its
        prefill and decode times teach ``sizes`` at the batch levels it ran at
        (``levels``, read before the worker's running set drops it). Then the
        worker's batch level moves on (``levels.running``).
        """
        if measured is not None:
            self._observe_final(measured, usage, now)
        self.levels.running(worker, running, now)

    def _observe_final(self, job: Job, usage: object, now: float) -> None:
        """Learn from ``job``'s successful FINAL at ``now`` (``on_final``); its
        ``max_tokens`` is the worker's limit (the default if it set none)."""
        assert job.dispatched_at is not None
        total_s = now - job.dispatched_at
        self.observe_service(total_s, job.kind, _constrained(job))
        if job.first_token_at is not None:
            ttft_s = job.first_token_at - job.dispatched_at
            at = (1.0, 1.0) if job.worker is None else self.levels.levels(job.worker, job.rid, now)
            max_tokens = job.req.max_tokens or self.default_max_tokens
            self.sizes.observe(
                job.kind, job.req, max_tokens, ttft_s, total_s, usage, *at, job.dispatched_at
            )
        self._tested_at[job.kind] = now

    # ------------------------------------------------------------------ reading

    def mean_s(self, kind: EngineKind, constrained: bool = False) -> float:
        """Mean service time (s) of ``kind``'s plain requests, or with ``constrained``
        of its ``json_schema`` ones; ``INITIAL_SERVICE_S`` until that class is
        measured (not the other class's: that is the skew ``ServiceClass`` avoids)."""
        return self._mean.get((kind, constrained), INITIAL_SERVICE_S)

    def _mean_of(self, jobs: Sequence[Job], kind: EngineKind) -> float:
        """The mean service time (s) of ``jobs`` (of ``kind``), each by its class's
        mean; of ``kind``'s plain requests if there are none."""
        if not jobs:
            return self.mean_s(kind)
        return sum(self.mean_s(kind, _constrained(job)) for job in jobs) / len(jobs)

    def tested_at(self, kind: EngineKind) -> float | None:
        """When (the broker's clock, s) ``kind``'s estimate was last tested: a request
        of it finished ``ok`` (taught it) or was admitted as ``mark_tested`` says;
        None if never."""
        return self._tested_at.get(kind)

    def mark_tested(self, kind: EngineKind, now: float) -> None:
        """A request of ``kind`` was admitted at ``now`` to test the estimate
        (admission's probe): the next probe waits from here."""
        self._tested_at[kind] = now

    def samples(self, kind: EngineKind) -> int:
        """How many service times of ``kind`` were observed (both classes)."""
        return self._samples[(kind, False)] + self._samples[(kind, True)]

    def sized(self, kind: EngineKind) -> bool:
        """Whether ``kind``'s requests are predicted by size (else by the mean)."""
        return self.by_size and self.sizes.ready(kind)

    def snapshot(self) -> dict[str, dict[str, float | int | dict[str, float] | None]]:
        """For ``status``, per engine kind observed: ``mean_ms`` (dispatch to final)
        and ``samples`` of its plain requests (``INITIAL_SERVICE_S`` and 0 before
        one), ``json_schema`` (``{"mean_ms": ..., "samples": ...}``) once such a
        request was measured, the learned per-token rates (``ServiceModel.snapshot``:
        ``prefill_ms_per_token``, ``decode_ms_per_token``, ...) once they exist,
        and ``decode_ms_per_token_by_level`` (``{"1": 31.0, "4": 85.0}``) once a
        level above 1 was measured."""
        return {
            kind: {
                "mean_ms": round(self.mean_s(kind) * 1000, 1),
                "samples": self._samples[(kind, False)],
                **self._constrained_snapshot(kind),
                **(self.sizes.snapshot(kind) or {}),
                **self._by_level(kind),
            }
            for kind in sorted({kind for kind, _ in self._mean})
        }

    def _constrained_snapshot(self, kind: EngineKind) -> dict[str, dict[str, float]]:
        """``json_schema``: the mean (ms) and samples of ``kind``'s constrained
        requests, once one was measured."""
        if not self._samples[(kind, True)]:
            return {}
        mean_ms = round(self.mean_s(kind, True) * 1000, 1)
        return {"json_schema": {"mean_ms": mean_ms, "samples": self._samples[(kind, True)]}}

    def _by_level(self, kind: EngineKind) -> dict[str, dict[str, float]]:
        """``decode_ms_per_token_by_level`` of ``kind`` once a level above 1 was
        measured (a one-slot pool's status stays as it was)."""
        by_level = self.sizes.decode_by_level(kind)
        if not any(level != "1" for level in by_level):
            return {}
        return {"decode_ms_per_token_by_level": by_level}

    # ------------------------------------------------------------------ one request

    def prompt_tokens(
        self, req: ClientRequest, kind: EngineKind, low: int = 0, high: int | None = None
    ) -> float | None:
        """``req``'s prompt tokens for predicting its service: ``low`` if the size
        check counted them exactly (``low == high``), else, when sized, the
        estimate from its bytes within the bounds the size check found (a prompt
        over the context is refused by its worker at once, so it never costs more
        than the largest prompt that fits); None if neither."""
        if low == high:
            return low
        if not self.sized(kind):
            return None
        estimate = self.sizes.prompt_tokens(kind, req)
        if estimate is None:
            return None
        return max(low, estimate if high is None else min(estimate, high))

    def service_s(
        self, req: ClientRequest, tokens: float | None, kind: EngineKind, level: int = 1
    ) -> float:
        """Predicted service (s) of ``req`` with ``tokens`` prompt tokens (None:
        estimate them) at batch ``level``; 0.0 when not sized (the mean asks only
        when it starts)."""
        if not self.sized(kind):
            return 0.0
        if tokens is None:
            tokens = self.prompt_tokens(req, kind) or 0.0
        max_tokens = req.max_tokens or self.default_max_tokens
        return self.sizes.predict_s(kind, tokens, max_tokens, level)

    def due_s(
        self, req: ClientRequest, tokens: float | None, kind: EngineKind, level: int = 1
    ) -> float:
        """How much of ``req`` must be done by its deadline, as predicted service (s)
        once started at batch ``level``: all of it, or for ``stream: true`` its
        first token (prefill and one decode step): a streaming client uses the
        tokens as they come, and the deadline then ends it with 504 and the text
        so far. 0.0 when not sized."""
        if not req.stream:
            return self.service_s(req, tokens, kind, level)
        if not self.sized(kind):
            return 0.0
        if tokens is None:
            tokens = self.prompt_tokens(req, kind) or 0.0
        return self.sizes.first_token_s(kind, tokens, level)

    def _job_service_s(self, job: Job, level: int = 1) -> float:
        """Predicted service (s) of a queued or running ``job`` at batch ``level``;
        a job queued before the first measurement gets its estimate now."""
        if job.prompt_tokens is None:
            job.prompt_tokens = self.prompt_tokens(job.req, job.kind)
        return self.service_s(job.req, job.prompt_tokens, job.kind, level)

    # ------------------------------------------------------------------ the queue

    def wait(self, ahead: Sequence[Job], slots: Slots, now: float) -> tuple[float, int]:
        """When a new request queued behind ``ahead`` (in dispatch order) would
        start on ``slots`` (s from now) and at which batch level.

        Sized: ``ahead`` is played forward on the workers' slots (``_play``); it
        starts on the slot that frees first, at the level of that slot's worker
        then. By the mean: ``(ahead - free + 1) / slots`` mean service times
        (Little's law) of the jobs ahead, each by its class (``_mean_of``), level 1
        (unused: the mean ignores levels).
        """
        if not self.sized(slots.kind):
            if slots.free > len(ahead):
                return 0.0, 1
            rounds = (len(ahead) - slots.free + 1) / max(1, slots.slots)
            return rounds * self._mean_of(ahead, slots.kind), 1
        slot = _next_slot(self._play(ahead, slots, now))
        return (0.0, 1) if slot is None else slot[:2]

    def retry_after_ms(
        self,
        queued: Sequence[Job],
        slots: Slots,
        now: float,
        fits: Callable[[int], bool] | None = None,
    ) -> int:
        """Advice for a shed client (ms, clamped): when a request queued last on
        ``slots`` would start, by the same estimate as the deadline check.

        Sized: ``slots.kind``'s part of ``queued`` (the whole queue, in dispatch
        order) is played forward on its idle slots; with ``fits``, until a slot
        is free on a worker at a batch level ``fits`` accepts (a request refused
        only for the load beside it retries once that eased). By the mean:
        ``mean_retry_after_ms`` over ``slots.kind``'s part of the queue, by the
        mean of that kind's running and queued jobs, each by its class (a shed
        rule request retries in milliseconds, not after the model's seconds; a
        plain one not after the ``json_schema`` ones' seconds).
        """
        mine = [j for j in queued if j.kind == slots.kind]
        if not self.sized(slots.kind):
            mean_s = self._mean_of([*slots.running, *mine], slots.kind)
            return self.mean_retry_after_ms(len(mine), slots.slots, slots.kind, mean_s)
        idle = max(0, slots.slots - len(slots.running))
        pool = self._play(mine, replace(slots, free=idle), now)
        estimate = _first_fit(pool, fits or (lambda _level: True)) * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))

    def mean_retry_after_ms(
        self, queued: int, slots: int, kind: EngineKind = "llm", mean_s: float | None = None
    ) -> int:
        """Time until ``queued`` requests ahead would have drained on ``slots``
        sequences (>= 1), in ms, clamped: Little's law over the pool, ``queued /
        slots`` rounds of ``mean_s`` (s; None: ``kind``'s plain requests' mean),
        plus the round in progress."""
        mean_s = self.mean_s(kind) if mean_s is None else mean_s
        estimate = (queued / max(1, slots) + 1) * mean_s * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))

    def _play(self, ahead: Sequence[Job], slots: Slots, now: float) -> Pool:
        """The pool once ``ahead`` (in dispatch order) has started: list scheduling
        on the workers' slots, which free up when a running request's predicted
        work is done (at once if answered: its cancel ack is due) or now
        (``slots.free`` of them, spread over the workers by their credit). Each job
        runs at the batch level of the worker whose slot it takes when it starts
        (``_next_slot``); a running job at its worker's level now."""
        by_worker: dict[bytes | int, list[Job]] = {}
        for job in slots.running:
            assert job.worker is not None
            by_worker.setdefault(job.worker, []).append(job)
        pool: dict[bytes | int, list[float]] = {
            worker: [self._left_s(job, now, len(jobs)) for job in jobs]
            for worker, jobs in by_worker.items()
        }
        credit = dict(slots.credit)
        for n in range(slots.free):
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


def _constrained(job: Job) -> bool:
    """Whether ``job`` is grammar-bound (a ``json_schema``): its ``ServiceClass``."""
    return job.req.json_schema is not None
