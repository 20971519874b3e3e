"""The admission gate: what may wait, in which order, and what is shed at once.

``AdmissionGate.check`` is the one place a request is admitted or refused, by
the ordered checks of README "Admission and backpressure", cheapest and most
certain first: validation (a duplicate id; a draining node; the model's
circuit breaker open for a request only the model may serve) -> size (413) ->
memory / CPU pressure -> a bounded queue per engine (with priority eviction) ->
per-client in-flight cap (429) -> deadline feasibility (503
``deadline_unmeetable``; on an idle pool, one such request per
``PROBE_AFTER_S`` is admitted to test the estimate). A refused request gets a
typed ``Shed`` (HTTP 400, 413, 429 or 503 semantics) with ``retry_after_ms``
where retrying can succeed — unlike llama.cpp's server, which queues without
bound, or Ollama/TGI, which refuse without saying when to come back. A hedged model request (degrade
mode, the model already too late) that the model cannot take goes to the
rules instead, as for the model's failures.

The queue and the per-client counts are ``broker.queue``'s; the gate reads them.
The request is judged on one snapshot of the pool (``broker.snapshot.PoolView``,
built once per request and shared with routing): per engine, its slots, free
credit, context and when the request would start. Deadline feasibility and
``retry_after_ms`` rest on the one service-time estimator
(``broker.service_time.ServiceEstimator``). An admitted request's verdict carries
its deadline (``Admit.deadline``), computed here with the deadline check.

The memory and CPU pressure levels are ``broker.pressure.PressureLevels``'s (the
broker sets them; the gate reads them): which classes they shed, the queue's
bound. Under ``critical`` memory pressure the broker also cancels sheddable
requests in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from broker.client_request import ClientRequest
from broker.errors import ErrorCode
from broker.jobs import JobTable
from broker.kinds import EngineKind, ShedReason
from broker.pressure import PressureLevels
from broker.queue import ClientCounts, RequestQueue
from broker.records import BrokerSettings, Job
from broker.routing import Route
from broker.service_time import ServiceEstimator
from broker.snapshot import EnginePool, PoolView, engine_slots
from broker.token_count import TokenCounter, byte_bound
from broker.workers import WorkerRegistry

#: How long (s) an estimate that refuses requests goes untested before an idle
#: slot admits one of them as a probe (``AdmissionGate._probe``): as a breaker's
#: half-open wait, short enough that a wrong estimate heals within seconds, long
#: enough that a right one costs one 504 per 2 s of an idle slot, not one per call.
PROBE_AFTER_S = 2.0


@dataclass(frozen=True)
class Shed:
    """Why a request is refused: the wire code, a machine reason and advice."""

    code: ErrorCode
    reason: ShedReason
    message: str
    retry_after_ms: int | None = None


#: The answer while the node stops, to new requests and to those still queued: none
#: of them started, so the client may send it again, to this node after its
#: restart or to another one.
DRAINING = Shed(ErrorCode.UNAVAILABLE, "draining", "node is shutting down", 1000)


@dataclass(frozen=True)
class Admit:
    """An admitted request: the ``route`` it takes (the one asked for, or the rules
    for a hedged request the model refused), its ``deadline`` (the broker's clock,
    s: now + its ``timeout_ms``, or the default, at most the maximum), the queued
    lower-priority ``evict`` job that must be answered 503 to make room (None if
    none) with that answer's ``evict_retry_ms`` (``retry_after``), and its
    ``prompt_tokens`` as counted or estimated, for ``Job.prompt_tokens``."""

    route: Route
    deadline: float
    evict: Job | None = None
    prompt_tokens: float | None = None
    evict_retry_ms: int | None = None


@dataclass(frozen=True)
class _Counted:
    """What the size check established about a prompt: at least ``low`` and at most
    ``high`` tokens (equal when counted exactly; ``high`` None: no bound)."""

    low: int = 0
    high: int | None = None


class AdmissionGate:
    """The ordered checks on a new request.

    Args:
        settings: ``max_queue`` (0 = 8 per pool slot), ``max_in_flight_per_client``,
            ``default_max_tokens``.
        estimator: the broker's service-time estimator, for ``retry_after_ms``, for
            refusing requests that could not meet their deadline and for the pool
            snapshot's waits.
        jobs: the broker's job table (a reference): duplicate ids, and the running
            requests whose remaining work delays a new one.
        queue: the broker's queue (a reference): its bound per engine, the jobs a
            new request waits behind, and whom to evict.
        clients: the broker's per-client counts of open requests (a reference).
        workers: the broker's worker registry (a reference): the engines' slots and
            which worker a free slot belongs to, hence the batch level a request
            would start at, for ``retry_after_ms``.
        levels: the broker's pressure levels (a reference): which classes they
            shed, the queue's bound.
        count_tokens: prompt tokens of a request, or None to skip the size check
            (workers still refuse prompts that do not fit with 413); asked only for
            what its budget allows (``TokenCounter.bounded``).
    """

    def __init__(
        self,
        settings: BrokerSettings,
        estimator: ServiceEstimator,
        jobs: JobTable,
        queue: RequestQueue,
        clients: ClientCounts,
        workers: WorkerRegistry,
        levels: PressureLevels,
        count_tokens: TokenCounter | None = None,
    ) -> None:
        self.settings = settings
        self.estimator = estimator
        self.jobs = jobs
        self.queue = queue
        self.clients = clients
        self.workers = workers
        self.levels = levels
        self.count_tokens = count_tokens

    # ------------------------------------------------------------------ the gate

    def check(
        self,
        client: bytes,
        req: ClientRequest,
        route: Route,
        pool: PoolView,
        now: float,
        owner: bytes | None = None,
    ) -> Shed | Admit:
        """Decide on a new request, by the ordered checks of the module docstring.

        Args:
            client: the requester's routing identity (its ids are unique per connection).
            owner: who the per-client cap counts (``Job.owner``: the client's
                authenticated key); None: ``client``.
            req: the request; its ``timeout_ms`` (clamped) is its budget.
            route: where the router sends it; ``route.hedge``: if the model cannot
                take it, the rules answer it (``degraded`` ``latency_budget``).
            pool: the snapshot of the pool this request was routed on.
            now: the broker's clock (s).

        Returns:
            An ``Admit`` (with its deadline, and a queued job to evict first, if
            any), or a ``Shed``.
        """
        shed = self._valid(client, req, pool) or self._circuit(route)
        if shed is not None:
            return shed
        counted = client if owner is None else owner
        verdict = self._engine(counted, req, route, pool, now)
        late = isinstance(verdict, Shed) and verdict.reason == "deadline_unmeetable"
        if isinstance(verdict, Shed) and (route.hedge or (late and route.rules_if_late)):
            # The model cannot take it at all (too large for it, or too late): then the
            # rules answer, whatever they say, as for the model's failures. An idle
            # model too slow for the deadline too: before, an idle node refused what a
            # busy one gave the rules (break-it pass, session 19).
            hedge = Route("rules", degraded="latency_budget")
            return self._engine(counted, req, hedge, pool, now)
        return verdict

    def _budget_s(self, req: ClientRequest) -> float:
        """``req``'s budget (s): its ``timeout_ms`` or the default, at most the maximum."""
        timeout_ms = min(
            req.timeout_ms or self.settings.default_timeout_ms, self.settings.max_timeout_ms
        )
        return timeout_ms / 1000

    def _valid(self, client: bytes, req: ClientRequest, pool: PoolView) -> Shed | None:
        """400 for an id this client has in flight; 503 while the node drains."""
        if self.jobs.of_client(client, req.id) is not None:
            message = f"id {req.id!r} is already in flight"
            return Shed(ErrorCode.BAD_REQUEST, "duplicate_id", message)
        if pool.draining:
            return DRAINING
        return None

    def _circuit(self, route: Route) -> Shed | None:
        """503 for a request only the model may serve while its breaker is open."""
        if route.circuit_open_ms is None:
            return None
        message = "the model pool is failing (circuit breaker open)"
        return Shed(ErrorCode.UNAVAILABLE, "circuit_open", message, route.circuit_open_ms)

    def _engine(
        self, client: bytes, req: ClientRequest, route: Route, pool: PoolView, now: float
    ) -> Shed | Admit:
        """The checks on ``route.kind``'s engine: size and pressure (the model only:
        the rule engine needs neither a context nor memory worth protecting), the
        queue bound, the client cap and the deadline."""
        engine = pool.of(route.kind)
        counted = _Counted()
        if route.kind == "llm":
            found = self._size(req, engine.n_ctx)
            if isinstance(found, Shed):
                return found
            counted = found
            shed = self._pressure(req, engine.slots, now)
            if shed is not None:
                return shed
        evict: Job | None = None
        # Each engine has its own bound: a model backlog must not shut out the rules, the
        # fallback meant for that time (test_a_model_backlog_leaves_the_rules_their_own_queue).
        if self.queue.of_kind(route.kind) >= self._queue_bound(engine.slots):
            evict = self.queue.eviction_victim(req.priority, route.kind)
            if evict is None:
                return self._shed_queue_full(engine.slots, route.kind, now)
        cap = self.settings.max_in_flight_per_client
        if self.clients.of(client) >= cap:
            message = f"{cap} requests of this client are already in flight"
            return Shed(
                ErrorCode.OVERLOADED,
                "client_cap",
                message,
                self.retry_after(engine.slots, now, route.kind),
            )
        tokens = self.estimator.prompt_tokens(req, route.kind, counted.low, counted.high)
        budget_s = self._budget_s(req)
        # A probe would make a request the rules can answer wait for its deadline.
        probe = not route.rules_if_late
        shed = self._deadline(req, tokens, route.kind, engine, budget_s, now, probe)
        if shed is not None:
            return shed
        evict_retry_ms = None
        if evict is not None:  # its advice, on the queue it still waits in
            evict_retry_ms = self.retry_after(self.workers.slots(evict.kind), now, evict.kind)
        return Admit(route, now + budget_s, evict, tokens, evict_retry_ms)

    def retry_after(
        self,
        slots: int,
        now: float,
        kind: EngineKind = "llm",
        fits: Callable[[int], bool] | None = None,
    ) -> int:
        """Advice for a shed client (ms, clamped): when a request queued last for
        ``kind`` would start on ``slots`` (``ServiceEstimator.retry_after_ms``;
        ``fits``: at a batch level it accepts)."""
        busy = engine_slots(kind, slots, 0, self.workers, self.jobs)
        return self.estimator.retry_after_ms(list(self.queue), busy, now, fits)

    # ------------------------------------------------------------------ the checks

    def _size(self, req: ClientRequest, n_ctx: int | None) -> Shed | _Counted:
        """413 if ``req``'s prompt tokens + ``max_tokens`` exceed ``n_ctx`` (tokens);
        else what was learned of its prompt tokens.

        Tokenizing runs on the broker's loop, so it is the last resort: a prompt
        whose bytes bound it inside the context is not counted, and the counter
        stops as soon as its lower bound exceeds what fits, or when its budget is
        spent; the worker then decides (and refuses with 413 at once).
        """
        if self.count_tokens is None or n_ctx is None:
            return _Counted()
        max_tokens = req.max_tokens or self.settings.default_max_tokens
        limit = n_ctx - max_tokens  # prompt tokens that fit
        if byte_bound(req) <= limit:
            return _Counted()  # fits for sure: skip tokenizing (milliseconds on the loop)
        found = self.count_tokens.bounded(req, limit)
        if found.tokens <= limit:
            return _Counted(found.tokens, found.tokens if found.exact else limit)
        prompt = f"prompt {found.tokens}" if found.exact else f"prompt at least {found.tokens}"
        return Shed(
            ErrorCode.TOO_LARGE,
            "too_large",
            f"{prompt} tokens + max_tokens {max_tokens} = {found.tokens + max_tokens} exceeds "
            f"the context of {n_ctx} tokens",
        )

    def _pressure(self, req: ClientRequest, slots: int, now: float) -> Shed | None:
        if req.priority in self.levels.memory_sheds():
            return Shed(
                ErrorCode.UNAVAILABLE,
                "memory_pressure",
                f"memory pressure is {self.levels.level}: {req.priority} work is shed",
                self.retry_after(slots, now),
            )
        if self.levels.cpu_sheds(req.priority):
            return Shed(
                ErrorCode.UNAVAILABLE,
                "cpu_pressure",
                "the host's CPU is under pressure: sheddable work is shed",
                self.retry_after(slots, now),
            )
        return None

    def _shed_queue_full(self, slots: int, kind: EngineKind, now: float) -> Shed:
        return Shed(
            ErrorCode.UNAVAILABLE,
            "queue_full",
            f"queue is full ({self._queue_bound(slots)} waiting)",
            self.retry_after(slots, now, kind),
        )

    def _deadline(
        self,
        req: ClientRequest,
        tokens: float | None,
        kind: EngineKind,
        engine: EnginePool,
        deadline_s: float,
        now: float,
        probe: bool = True,
    ) -> Shed | None:
        """503 ``deadline_unmeetable`` if ``req`` could not be done by ``deadline_s``
        (s from now) after its wait on ``engine``: sized, finish in time (a stream:
        its first token) at the batch level it would start at; by the mean, start
        in time. Without workers or a measured service time there is no basis to
        refuse. ``retry_after_ms`` only if an idle pool could do it in time. A
        request refused only by its own estimate on an idle pool may be admitted
        as a probe of that estimate (``_probe``), if ``probe``."""
        level = engine.level
        own_s = self.estimator.due_s(req, tokens or 0.0, kind, level)
        if not engine.slots or not self.estimator.samples(kind):
            return None
        if engine.wait_s + own_s <= deadline_s:
            return None
        what = "first token" if req.stream else "service"
        budget = f"the {deadline_s * 1000:.0f} ms budget"
        alone_s = own_s if level == 1 else self.estimator.due_s(req, tokens or 0.0, kind, 1)
        if alone_s > deadline_s and probe and self._probe(kind, engine, now):
            return None
        if alone_s > deadline_s:  # even an idle pool could not: retrying cannot help
            message = f"expected {what} {alone_s * 1000:.0f} ms alone exceeds {budget}"
            return Shed(ErrorCode.UNAVAILABLE, "deadline_unmeetable", message)
        message = f"expected wait {engine.wait_s * 1000:.0f} ms"
        if own_s:
            message += f" + {what} {own_s * 1000:.0f} ms"
        if level > 1:
            message += f" at batch level {level}"

        def fits(at: int) -> bool:
            return self.estimator.due_s(req, tokens or 0.0, kind, at) <= deadline_s

        return Shed(
            ErrorCode.UNAVAILABLE,
            "deadline_unmeetable",
            f"{message} exceeds {budget}",
            self.retry_after(engine.slots, now, kind, fits),
        )

    def _probe(self, kind: EngineKind, engine: EnginePool, now: float) -> bool:
        """Whether to admit, as a probe, a request the estimate alone refuses.

        The rule: when ``kind`` has a free slot and nothing waits for it, and its
        estimate was not tested for ``PROBE_AFTER_S`` (no request of it finished
        ``ok`` nor was probed since), admit this one. Why: refused requests teach the
        estimate nothing, so one inflated by something it did not catch (a pause,
        ``broker.service_model``) would refuse short budgets for good; an idle slot
        can test it at the cost of one request per ``PROBE_AFTER_S`` that, if the
        estimate was right, ends 504 at its deadline instead of 503 at once.
        """
        tested = self.estimator.tested_at(kind)
        if engine.free <= 0 or engine.wait_s > 0 or self.queue.of_kind(kind):
            return False
        if tested is not None and now - tested < PROBE_AFTER_S:
            return False
        self.estimator.mark_tested(kind, now)
        return True

    # ------------------------------------------------------------------ pressure

    def _queue_bound(self, slots: int) -> int:
        """How many requests for one engine of ``slots`` may wait now."""
        return self.levels.queue_bound(slots, self.settings.max_queue)

    def shed_for_pressure(self) -> list[Job]:
        """Queued jobs the current memory pressure no longer admits (to answer 503)."""
        queued = (j for p in self.levels.memory_sheds() for j in self.queue.queued(p))
        return [j for j in queued if j.kind == "llm"]  # the rules need no memory to speak of

    def shed_for_cpu(self) -> list[Job]:
        """Queued sheddable model jobs while the host's CPU is under pressure (to answer 503)."""
        if self.levels.cpu == "ok":
            return []
        return [j for j in self.queue.queued("sheddable") if j.kind == "llm"]
