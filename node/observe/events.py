"""Counters and histograms fed by the broker's effects (``broker.observations``,
the breaker's ``Transition``s), as the I/O loop hands them to the node.

Every label value comes from a typed vocabulary of ``broker.kinds`` (engine,
outcome, reason) or ``broker.breaker.BreakerState``: the cardinality is bounded,
and no request or client id is ever a label.

Buckets are in seconds and sized for this node: a 270M-parameter model on a few
ARM/x86 cores (decode ~20-60 tokens/s, so 15-50 ms a token; a first token in
~0.05-0.5 s for short prompts, seconds for long ones) beside a rule engine that
answers in well under a millisecond, with a 60 s default request timeout
(``broker.default_timeout_ms``). Each histogram's edges are written next to it
with the figure they straddle.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from broker.breaker import Transition
from broker.kinds import ENGINE_KINDS, SHED_REASONS
from broker.observations import Ended, Observation, TokenGap

#: Waiting for a slot: ~0 when idle, one service time (0.1-10 s) behind a busy
#: model, up to the 60 s default timeout; ms steps for the rules.
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
#: To the first token: 0.2 is degrade mode's default latency budget
#: (``routing.ttft_budget_ms``), so the share above it is the share hedged.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 1, 2, 5, 10, 30, 60)
#: Between two tokens: 15-50 ms is a single sequence's decode here; larger
#: values are batching (more slots share one forward pass) or CPU pressure.
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1,
    2.5,
)
#: Acceptance to the final reply: the rules' ms to the model's seconds, with
#: edges at the 60 s default timeout and 120 s (half the 600 s maximum: beyond it
#: only an operator's longer timeouts reach).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120)
#: How late a deadline answer left after its deadline: the goal is <= 5 ms
#: (issue 13), so the edges are fine below it and coarse above.
OVERSHOOT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class EventMetrics:
    """The metrics that move with each request's end, each token and each breaker move:
    the request counts, the request latencies, and the breaker's transitions.

    Args:
        registry: where they are registered (the node's own, never the global one).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counts = RequestCounts(registry)
        self.latencies = RequestLatencies(registry)
        self.transitions = Counter(
            "edgenode_breaker_transitions",
            "The model pool's circuit breaker state changes.",
            ("from_state", "to_state"),
            registry=registry,
        )

    def observe(self, observations: list[Observation], transitions: list[Transition]) -> None:
        """Record what one ``Outbox.take`` held."""
        for item in observations:
            if isinstance(item, TokenGap):
                self.latencies.token_gap(item)
            else:
                self.counts.ended(item)
                self.latencies.ended(item)
        for t in transitions:
            self.transitions.labels(t.old.value, t.new.value).inc()


class RequestCounts:
    """How requests ended (engine, outcome, reason; sheds and fallbacks by reason) and
    the tokens of those answered ok.

    Args:
        registry: where they are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "edgenode_requests",
            "Client requests ended, by engine, outcome (ok or error_<code>) and reason.",
            ("engine", "outcome", "reason"),
            registry=registry,
        )
        self.shed = Counter(
            "edgenode_shed",
            "Requests refused or ended 4xx/5xx by admission or pressure, by reason.",
            ("engine", "reason"),
            registry=registry,
        )
        self.fallbacks = Counter(
            "edgenode_fallbacks",
            "Requests the rules answered in the model's place, by degrade reason.",
            ("reason",),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "edgenode_prompt_tokens",
            "Prompt tokens of requests answered ok (the worker's usage).",
            ("engine",),
            registry=registry,
        )
        self.generation_tokens = Counter(
            "edgenode_generation_tokens",
            "Tokens generated for requests answered ok (the worker's usage).",
            ("engine",),
            registry=registry,
        )
        # Per engine series exist from the start (at zero): a rate() over a series
        # that appears only with its first event misses that event.
        for kind in ENGINE_KINDS:
            self.prompt_tokens.labels(kind)
            self.generation_tokens.labels(kind)

    def ended(self, e: Ended) -> None:
        """Count one request's end."""
        self.requests.labels(e.engine, e.outcome, e.reason).inc()
        if e.outcome != "ok" and e.reason in SHED_REASONS:
            self.shed.labels(e.engine, e.reason).inc()
        if e.engine == "rules" and e.degraded is not None:
            self.fallbacks.labels(e.degraded).inc()
        if e.prompt_tokens:
            self.prompt_tokens.labels(e.engine).inc(e.prompt_tokens)
        if e.completion_tokens:
            self.generation_tokens.labels(e.engine).inc(e.completion_tokens)


class RequestLatencies:
    """The requests' times (s), per engine: queue, first token, between tokens, the
    whole request (also by outcome) and a deadline answer's overshoot.

    Args:
        registry: where they are registered.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        engine = ("engine",)
        self.queue = Histogram(
            "edgenode_queue_seconds",
            "Acceptance to dispatch onto a worker.",
            engine,
            buckets=QUEUE_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            "edgenode_time_to_first_token_seconds",
            "Acceptance to the first token.",
            engine,
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token = Histogram(
            "edgenode_inter_token_seconds",
            "Time between two tokens of one request, as the broker receives them.",
            engine,
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        self.duration = Histogram(
            "edgenode_request_duration_seconds",
            "Acceptance to the final reply (end-to-end inside the node), by outcome.",
            ("engine", "outcome"),
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.overshoot = Histogram(
            "edgenode_deadline_overshoot_seconds",
            "How late a deadline_exceeded reply left after the request's deadline.",
            engine,
            buckets=OVERSHOOT_BUCKETS,
            registry=registry,
        )
        # At zero from the start, as RequestCounts' (duration has an outcome label too).
        for kind in ENGINE_KINDS:
            for metric in (self.queue, self.ttft, self.inter_token, self.overshoot):
                metric.labels(kind)

    def token_gap(self, gap: TokenGap) -> None:
        """One interval between two tokens of a request."""
        self.inter_token.labels(gap.engine).observe(gap.seconds)

    def ended(self, e: Ended) -> None:
        """The times of one request's end, those it has (one never dispatched has no queue time)."""
        if e.queue_s is not None:
            self.queue.labels(e.engine).observe(e.queue_s)
        if e.ttft_s is not None:
            self.ttft.labels(e.engine).observe(e.ttft_s)
        if e.total_s is not None:
            self.duration.labels(e.engine, e.outcome).observe(e.total_s)
        if e.overshoot_s is not None:
            self.overshoot.labels(e.engine).observe(e.overshoot_s)
