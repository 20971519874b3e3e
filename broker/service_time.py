"""How long requests take: the one service-time estimator behind admission.

``ServiceEstimator`` owns everything learned about service times and answers
the three questions admission asks (``broker.admission``): when a new request
would *start* (``wait``: the queue ahead played forward on the workers' slots),
how long it would *take* (``service_s``/``due_s``), and when a refused client
should *come back* (``retry_after_ms``). It predicts in one of two ways:

* **by size** (``broker.service_estimate = "size"``, the default, once an
  engine has a measured request): each request from its prompt tokens and
  ``max_tokens`` at the batch level it would run at (below);
* **by the mean** (before the first measured request, and always with
  ``"mean"``, which benchmarks compare): one EWMA of dispatch-to-final time
  per engine kind; a request is then only asked to *start* in time.

One mean service time per engine cannot tell a 1000-token
prompt from a 10-token one. A model request costs two phases that llama.cpp
times apart after every request ("prompt eval time = … ms per token" and
"eval time = … ms per token": ``llama_perf_context_print`` in the library,
``server_slot::print_timings`` in its server, whose prompt phase ends when the
first token is sampled):

* **prefill** evaluates the prompt in batches: its time grows with the prompt's
  tokens and ends when the first token is sampled;
* **decode** runs one step per generated token.

So ``service ~ prefill_s_per_token * prompt_tokens + decode_s_per_token * tokens``,
the first decode step being part of the time to the first token. Both rates are
learned, per engine kind, from the broker's own clock on finished requests
(dispatch, first PARTIAL, FINAL) and the worker's ``usage``; nothing is assumed
about the model. Each rate is an exponentially weighted *ratio of sums* (time
over tokens, like llama.cpp's "ms per token"), so long prompts, which carry
the signal, weigh more than short ones, whose time is mostly fixed overhead.

A llama slot reuses the KV cache of its previous prompt's common prefix; the
worker reports those tokens (``usage.cached_tokens``), and the prefill rate is
learned from the tokens evaluated. Predictions count the whole prompt: a
request that reuses a prefix is predicted slower than it is, never faster.

**Batch level.** A worker with S slots decodes all its running sequences in one
``llama_decode`` per step, so a sequence's ms/token depends on how many run
beside it. Each rate is therefore a small table keyed by the *batch level* b,
the number of requests running on the worker (the request itself included):
for a finished request, the time-weighted mean of that count over its prefill
and over its decode (``BatchLevels``), rounded to the nearest integer. A level
not measured yet is predicted from the nearest measured one (in ratio, the
higher on a tie): decode scaled by ``batch_cost`` (the per-sequence step time
measured with batched decoding, ``BATCH_GAIN``), prefill unscaled (see ``batch_cost``). A
worker with one slot only ever runs at level 1, which is the single rate it
always had.

Two more ratios turn a request into tokens without tokenizing it on the
broker's loop (milliseconds per request: docs/bench/figures.md, "broker.service_time"): prompt
tokens per byte of ``byte_bound`` (the exact count is used when the 413 check
made one anyway), and the share of ``max_tokens`` that requests actually
generate (most stop before the limit).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from broker.client_request import ClientRequest
from broker.kinds import EngineKind
from broker.records import Job
from broker.token_count import byte_bound

#: Prompts shorter than this teach no prefill rate: their time to the first token
#: is mostly fixed per-request overhead, not prompt evaluation, and would price long
#: prompts far too high (test_tiny_prompts_and_schema_requests_teach_no_rates).
MIN_PREFILL_TOKENS = 32

#: Weight of the newest sample, in the rates' ratios and the mean service time:
#: about the last 10 requests count.
ALPHA = 0.2

#: Bounds of any ``retry_after_ms`` we advertise: below 50 ms a client would
#: hammer the node; above 30 s the advice is useless (callers should give up).
RETRY_AFTER_MIN_MS = 50
RETRY_AFTER_MAX_MS = 30_000

#: Aggregate decode tokens/s of b sequences in one llama context, as a multiple
#: of one sequence's: the midpoints of the ranges measured with one thread
#: (measured: docs/bench/figures.md, "broker.service_time"). Two threads scale
#: further, so it errs on the slow side; it is only used for levels not measured yet.
BATCH_GAIN = ((1, 1.0), (2, 1.0), (4, 1.425), (8, 1.8), (16, 2.25))


def batch_cost(level: float) -> float:
    """One sequence's decode time per token at batch ``level``, as a multiple of
    its time alone: ``level / gain(level)``, the gain (``BATCH_GAIN``)
    interpolated linearly in log2(level) and held at its last value beyond 16
    (so the cost then grows linearly: no further gain is assumed). 2.8 at 4 and
    4.4 at 8, inside the measured per-sequence ranges (docs/bench/figures.md).

    Prefill is not scaled by it: a prompt is evaluated in chunks of up to
    ``n_batch`` tokens in the same ``llama_decode`` as the other slots' one token
    each (``node.llama.engine``'s step), which adds little to a step that is
    already compute-bound, so an unmeasured level borrows the nearest level's
    prefill rate as it is (the first request measured there corrects it).
    """
    level = max(1.0, level)
    x = math.log2(level)
    gain = BATCH_GAIN[-1][1]
    for (b0, g0), (b1, g1) in itertools.pairwise(BATCH_GAIN):
        x0, x1 = math.log2(b0), math.log2(b1)
        if x <= x1:
            gain = g0 + (g1 - g0) * (x - x0) / (x1 - x0)
            break
    return level / gain


def level_key(level: float) -> int:
    """The table key of a (time-weighted, fractional) batch level: the nearest
    integer, halves up, at least 1."""
    return max(1, int(level + 0.5))


@dataclass
class Ratio:
    """``num / den`` over recent samples: both sums decay by ``1 - ALPHA`` per new
    sample. Every sample starts with the same weight (the first one too: the
    first request after a start is often slow, its weights still being paged in)."""

    num: float = 0.0
    den: float = 0.0
    samples: int = 0

    def add(self, num: float, den: float) -> None:
        """Fold in one sample."""
        self.num = (1 - ALPHA) * self.num + num
        self.den = (1 - ALPHA) * self.den + den
        self.samples += 1

    @property
    def value(self) -> float:
        """The ratio; 0.0 before any sample with a non-zero denominator."""
        return self.num / self.den if self.den > 0 else 0.0


@dataclass
class Rates:
    """What one engine kind's finished requests taught (see the module docstring):
    prefill and decode seconds per token by batch level, and the request-to-tokens
    ratios (which do not depend on the level)."""

    prefill_s_per_token: dict[int, Ratio] = field(default_factory=dict)
    decode_s_per_token: dict[int, Ratio] = field(default_factory=dict)
    tokens_per_byte: Ratio = field(default_factory=Ratio)
    completion_share: Ratio = field(default_factory=Ratio)

    def prefill(self, level: int) -> float:
        """Prefill s/token at ``level``: measured, else the nearest measured level's."""
        return _at_level(self.prefill_s_per_token, level, scaled=False)

    def decode(self, level: int) -> float:
        """Decode s/token at ``level``: measured, else the nearest measured level's
        scaled by ``batch_cost``; 0.0 before any decode was measured."""
        return _at_level(self.decode_s_per_token, level, scaled=True)


def _at_level(table: dict[int, Ratio], level: int, *, scaled: bool) -> float:
    """``table``'s rate at ``level`` (see ``Rates.prefill`` / ``Rates.decode``)."""
    level = max(1, level)
    measured = [b for b, r in table.items() if r.den > 0]
    if not measured:
        return 0.0
    if level in measured:
        return table[level].value
    # Nearest in ratio (log distance), the higher level on a tie (the slower guess).
    nearest = min(measured, key=lambda b: (abs(math.log(b / level)), -b))
    rate = table[nearest].value
    return rate * batch_cost(level) / batch_cost(nearest) if scaled else rate


class ServiceModel:
    """Per engine kind: prefill and decode rates, and the request-to-tokens ratios."""

    def __init__(self) -> None:
        self._rates: dict[EngineKind, Rates] = {}

    def ready(self, kind: EngineKind) -> bool:
        """Whether ``kind`` has a measured request to predict from (one with a
        prompt of at least ``MIN_PREFILL_TOKENS``, at any batch level: until then
        the mean decides)."""
        rates = self._rates.get(kind)
        return rates is not None and any(r.samples for r in rates.prefill_s_per_token.values())

    def observe(
        self,
        kind: EngineKind,
        req: ClientRequest,
        max_tokens: int,
        ttft_s: float,
        total_s: float,
        usage: object,
        prefill_level: float = 1.0,
        decode_level: float = 1.0,
    ) -> bool:
        """Learn from one successful request.

        Args:
            kind: the engine that served it.
            req: the request (its prompt's ``byte_bound``).
            max_tokens: the limit the worker was given (tokens).
            ttft_s: dispatch to the first PARTIAL (s): prefill plus one decode step.
            total_s: dispatch to the FINAL (s).
            usage: the FINAL's ``usage`` map: ``prompt_tokens``, ``completion_tokens``,
                and ``cached_tokens`` (prompt tokens a slot reused: not evaluated,
                so they teach no prefill rate).
            prefill_level: requests running on its worker during its prefill
                (itself included; a time-weighted mean, ``BatchLevels``).
            decode_level: the same during its decode.

        Returns:
            False if the sample says nothing about size (no usage, no token
            generated, as from the rule engine) or would mislead it (a
            ``json_schema`` request: its grammar slows every step several times
            over, docs/bench/figures.md): nothing was learned.
        """
        if not isinstance(usage, dict) or req.json_schema is not None:
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not _count(prompt) or not _count(completion):
            return False
        assert isinstance(prompt, int) and isinstance(completion, int)
        rates = self._rates.setdefault(kind, Rates())
        at_prefill, at_decode = level_key(prefill_level), level_key(decode_level)
        if completion >= 2:
            decode = rates.decode_s_per_token.setdefault(at_decode, Ratio())
            decode.add(max(0.0, total_s - ttft_s), completion - 1)
        first_step = rates.decode(at_prefill)  # the first token ends the prefill
        # A slot's prompt prefix reuse: only the rest was evaluated.
        cached = usage.get("cached_tokens")
        reused = cached if isinstance(cached, int) and _count(cached) and cached <= prompt else 0
        evaluated = prompt - reused
        if evaluated >= MIN_PREFILL_TOKENS:
            prefill = rates.prefill_s_per_token.setdefault(at_prefill, Ratio())
            prefill.add(max(0.0, ttft_s - first_step), evaluated)
        rates.tokens_per_byte.add(prompt, byte_bound(req))
        rates.completion_share.add(completion, max(1, max_tokens))
        return True

    def prompt_tokens(self, kind: EngineKind, req: ClientRequest) -> float | None:
        """``req``'s prompt tokens estimated from its bytes, None before any sample."""
        if not self.ready(kind):
            return None
        return byte_bound(req) * self._rates[kind].tokens_per_byte.value

    def predict_s(
        self, kind: EngineKind, prompt_tokens: float, max_tokens: int, level: int = 1
    ) -> float:
        """Predicted dispatch-to-final time (s) of a request of ``prompt_tokens``
        allowed ``max_tokens``, run at batch ``level``: prefill rate x prompt
        tokens + decode rate x the tokens it is expected to generate
        (``max_tokens`` x the observed share). Call only when ``ready(kind)``."""
        rates = self._rates[kind]
        expected = max_tokens * min(1.0, rates.completion_share.value)
        return rates.prefill(level) * prompt_tokens + rates.decode(level) * expected

    def first_token_s(self, kind: EngineKind, prompt_tokens: float, level: int = 1) -> float:
        """Predicted dispatch-to-first-token time (s) at batch ``level``: the
        prefill of ``prompt_tokens`` and one decode step (llama.cpp samples the
        first token at the end of the prompt's evaluation). Call only when
        ``ready(kind)``."""
        rates = self._rates[kind]
        return rates.prefill(level) * prompt_tokens + rates.decode(level)

    def snapshot(self, kind: EngineKind) -> dict[str, float] | None:
        """The learned rates of ``kind`` in ms per token (for logs and benchmarks):
        prefill and decode at batch level 1 (measured, or derived from the nearest
        measured level as for any prediction)."""
        if not self.ready(kind):
            return None
        r = self._rates[kind]
        return {
            "prefill_ms_per_token": round(r.prefill(1) * 1000, 3),
            "decode_ms_per_token": round(r.decode(1) * 1000, 3),
            "tokens_per_byte": round(r.tokens_per_byte.value, 3),
            "completion_share": round(r.completion_share.value, 3),
        }

    def decode_by_level(self, kind: EngineKind) -> dict[str, float]:
        """The decode rate (ms per token) at every batch level measured, keyed by
        the level as a string (msgpack maps on the wire must have string keys),
        lowest first; empty before any."""
        rates = self._rates.get(kind)
        if rates is None:
            return {}
        return {
            str(level): round(ratio.value * 1000, 3)
            for level, ratio in sorted(rates.decode_s_per_token.items())
            if ratio.den > 0
        }


@dataclass
class _Clock:
    """One worker's running requests, integrated over time (``BatchLevels``).

    ``area`` is request-seconds up to ``since``; ``marks`` holds, per running
    request, (time, area, running) at its dispatch and, once seen, at its first
    token."""

    running: int = 0
    since: float = 0.0
    area: float = 0.0
    marks: dict[int, list[tuple[float, float, int]]] = field(default_factory=dict)

    def area_at(self, now: float) -> float:
        return self.area + self.running * max(0.0, now - self.since)


class BatchLevels:
    """Each worker's count of running requests over time, so that a finished
    request's batch level is known: the time-weighted mean count over its prefill
    (dispatch to first token) and over its decode (first token to FINAL).

    Cheaper than it sounds (O(1) per dispatch, token and FINAL, besides the
    worker's own running set) and better than the mean of the counts at dispatch
    and at FINAL, which cannot tell a request that ran beside three others for
    most of its life from one they joined just before it ended. Times are the
    broker's clock (s), passed in.
    """

    def __init__(self) -> None:
        self._clocks: dict[bytes, _Clock] = {}

    def running(self, worker: bytes, rids: Collection[int], now: float) -> None:
        """``worker`` runs ``rids`` from ``now`` on: call after every change of its
        running set (dispatch, FINAL; ``()`` when it is lost). A new rid is marked
        dispatched at ``now``; the marks of rids no longer running are dropped."""
        if not rids:
            self._clocks.pop(worker, None)
            return
        clock = self._clocks.setdefault(worker, _Clock(since=now))
        clock.area = clock.area_at(now)
        clock.since = now
        clock.running = len(rids)
        for rid in [r for r in clock.marks if r not in rids]:
            del clock.marks[rid]
        for rid in rids:
            if rid not in clock.marks:
                clock.marks[rid] = [(now, clock.area, clock.running)]

    def first_token(self, worker: bytes, rid: int, now: float) -> None:
        """``rid``'s first token arrived from ``worker`` at ``now``: its prefill ended."""
        clock = self._clocks.get(worker)
        marks = None if clock is None else clock.marks.get(rid)
        if clock is not None and marks is not None and len(marks) == 1:
            marks.append((now, clock.area_at(now), clock.running))

    def levels(self, worker: bytes, rid: int, now: float) -> tuple[float, float]:
        """(prefill level, decode level) of ``rid`` finishing on ``worker`` at ``now``
        (before its FINAL is taken out of the running set). (1.0, 1.0) for a
        request never marked; a phase of no duration has the count at its start."""
        clock = self._clocks.get(worker)
        marks = None if clock is None else clock.marks.get(rid)
        if clock is None or not marks:
            return 1.0, 1.0
        end = (now, clock.area_at(now), clock.running)
        first = marks[1] if len(marks) > 1 else end
        return _mean_level(marks[0], first), _mean_level(first, end)


def _mean_level(start: tuple[float, float, int], end: tuple[float, float, int]) -> float:
    """Time-weighted mean running count between two marks (time, area, running)."""
    span = end[0] - start[0]
    return (end[1] - start[1]) / span if span > 0 else float(start[2])


def _count(value: object) -> bool:
    """A positive token count (bools are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


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
        initial_service_s: the mean service time assumed before any measurement.

    ``sizes`` holds the per-token rates by batch level (``ServiceModel``);
    ``levels`` follows each worker's running requests over time (the broker calls
    ``levels.running`` on every change of a worker's running set and
    ``levels.first_token`` on a request's first token) to tell each finished
    request's batch level. The mean is one EWMA per kind: a rule answer (milliseconds)
    must not dilute the model's (seconds), nor the model's make rules look slow.
    """

    def __init__(
        self, by_size: bool = True, default_max_tokens: int = 128, initial_service_s: float = 1.0
    ) -> None:
        self.by_size = by_size
        self.default_max_tokens = default_max_tokens
        self.initial_service_s = initial_service_s
        self.sizes = ServiceModel()
        self.levels = BatchLevels()
        self._mean: dict[EngineKind, float] = {}
        self._samples: Counter[EngineKind] = Counter()

    # ------------------------------------------------------------------ learning

    def observe_service(self, seconds: float, kind: EngineKind = "llm") -> None:
        """Fold one request's dispatch-to-final time (s) into ``kind``'s mean."""
        seconds = max(0.0, seconds)
        self._samples[kind] += 1
        if self._samples[kind] == 1:
            self._mean[kind] = seconds  # the first measurement beats the guess
        else:
            self._mean[kind] += ALPHA * (seconds - self._mean[kind])

    def observe_final(self, job: Job, usage: object, now: float, max_tokens: int) -> None:
        """A successful FINAL of ``job`` (dispatched) at ``now``: its dispatch-to-final
        time joins the mean; with a first token and the worker's ``usage``, its
        prefill and decode times teach ``sizes`` at the batch levels it ran at
        (``levels``; call before its worker's running set drops it).
        ``max_tokens``: the worker's limit."""
        assert job.dispatched_at is not None
        total_s = now - job.dispatched_at
        self.observe_service(total_s, job.kind)
        if job.first_token_at is not None:
            ttft_s = job.first_token_at - job.dispatched_at
            at = (1.0, 1.0) if job.worker is None else self.levels.levels(job.worker, job.rid, now)
            self.sizes.observe(job.kind, job.req, max_tokens, ttft_s, total_s, usage, *at)

    # ------------------------------------------------------------------ reading

    def mean_s(self, kind: EngineKind) -> float:
        """Mean service time of ``kind``'s workers (s); the initial guess until measured."""
        return self._mean.get(kind, self.initial_service_s)

    def samples(self, kind: EngineKind) -> int:
        """How many service times of ``kind`` were observed."""
        return self._samples[kind]

    def sized(self, kind: EngineKind) -> bool:
        """Whether ``kind``'s requests are predicted by size (else by the mean)."""
        return self.by_size and self.sizes.ready(kind)

    def snapshot(self) -> dict[str, dict[str, float | int | dict[str, float] | None]]:
        """For ``status``, per engine kind observed: ``mean_ms`` (dispatch to final),
        ``samples``, and the learned per-token rates (``ServiceModel.snapshot``:
        ``prefill_ms_per_token``, ``decode_ms_per_token``, ...) once they exist,
        and ``decode_ms_per_token_by_level`` (``{"1": 31.0, "4": 85.0}``) once a
        level above 1 was measured."""
        return {
            kind: {
                "mean_ms": round(self._mean[kind] * 1000, 1),
                "samples": self._samples[kind],
                **(self.sizes.snapshot(kind) or {}),
                **self._by_level(kind),
            }
            for kind in sorted(self._mean)
        }

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
        (Little's law), level 1 (unused: the mean ignores levels).
        """
        if not self.sized(slots.kind):
            if slots.free > len(ahead):
                return 0.0, 1
            rounds = (len(ahead) - slots.free + 1) / max(1, slots.slots)
            return rounds * self.mean_s(slots.kind), 1
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
        ``mean_retry_after_ms`` over the whole queue, by the model's mean.
        """
        if not self.sized(slots.kind):
            # The model's mean whatever the kind, as the gate has always advised.
            return self.mean_retry_after_ms(len(queued), slots.slots)
        mine = [j for j in queued if j.kind == slots.kind]
        idle = max(0, slots.slots - len(slots.running))
        pool = self._play(mine, replace(slots, free=idle), now)
        estimate = _first_fit(pool, fits or (lambda _level: True)) * 1000
        return int(min(RETRY_AFTER_MAX_MS, max(RETRY_AFTER_MIN_MS, estimate)))

    def mean_retry_after_ms(self, queued: int, slots: int, kind: EngineKind = "llm") -> int:
        """Time until ``queued`` requests ahead would have drained on ``slots``
        sequences (>= 1), in ms, clamped: Little's law over the pool, ``queued /
        slots`` rounds of ``kind``'s mean service time, plus the round in progress."""
        estimate = (queued / max(1, slots) + 1) * self.mean_s(kind) * 1000
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
