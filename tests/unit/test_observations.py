"""The broker core's observations for the metrics (``broker.observations``), on a
fake clock: each request's end once, with its times, and the gaps between tokens;
then the node's ``EventMetrics`` turning them into Prometheus samples."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from broker.breaker import BreakerState, Transition
from broker.delivery import GoneCause
from broker.errors import ConfigError
from broker.observations import Ended, Observation, TokenGap
from broker.outbox import Consumed
from broker.routing import RoutingSettings
from brokerkit import W1, BrokerHarness, generate
from node.observe.events import EventMetrics
from node.observe.listen import Listen, parse_listen

FULL = RoutingSettings(mode="full")


def observed(h: BrokerHarness) -> list[Observation]:
    out = list(h.broker.outbox.observations)
    h.broker.outbox.observations.clear()
    return out


def test_token_gaps_are_the_times_between_partials() -> None:
    h = BrokerHarness(routing=FULL)
    h.ready(W1, 0.0)
    h.send(generate("a"), 1.0)
    (req,) = h.requests(W1)
    rid = req["rid"]
    h.partial(W1, rid, "x", 1.25)
    h.partial(W1, rid, "y", 1.30)
    h.partial(W1, rid, "z", 1.40)
    usage = {"prompt_tokens": 7, "completion_tokens": 3}
    h.final(W1, rid, 1.5, usage=usage)
    seen = observed(h)
    gaps = [o for o in seen if isinstance(o, TokenGap)]
    # The first token has no gap before it: two gaps for three tokens.
    assert [round(g.seconds, 6) for g in gaps] == [0.05, 0.1]
    assert all(g.engine == "llm" for g in gaps)
    assert len([o for o in seen if isinstance(o, Ended)]) == 1
    h.assert_each_answered_once()


def _one_streamed_request(h: BrokerHarness) -> None:
    """One streamed request of three tokens, answered."""
    h.ready(W1, 0.0)
    h.send(generate("a", stream=True), 1.0)
    rid = h.requests(W1)[0]["rid"]
    for n, at in enumerate((1.1, 1.2, 1.3)):
        h.partial(W1, rid, f"t{n}", at)
    h.final(W1, rid, 1.5, text=None)


@pytest.mark.parametrize("traces", [True, False])
@pytest.mark.parametrize("observations", [True, False])
def test_records_nobody_consumes_are_not_built_and_nothing_else_changes(
    traces: bool, observations: bool
) -> None:
    """``Outbox.consume``: with traces or observations off, none of them is built; the
    replies, the worker messages and the counters are those of a broker building all."""
    full, lean = BrokerHarness(routing=FULL), BrokerHarness(routing=FULL)
    lean.broker.outbox.consume(Consumed(traces=traces, observations=observations))
    for h in (full, lean):
        _one_streamed_request(h)
    assert bool(lean.broker.outbox.traces) is traces
    assert bool(lean.broker.outbox.observations) is observations
    assert full.broker.outbox.traces and full.broker.outbox.observations
    assert lean.replies() == full.replies()
    assert lean.broker.stats.counters == full.broker.stats.counters
    full.assert_each_answered_once()
    lean.assert_each_answered_once()


def test_each_ending_is_one_record_with_its_outcome_and_reason() -> None:
    h = BrokerHarness(routing=FULL)
    h.ready(W1, 0.0)
    h.send(generate("ok"), 1.0)
    (req,) = h.requests(W1)
    h.partial(W1, req["rid"], "x", 1.2)
    h.final(W1, req["rid"], 1.5, usage={"prompt_tokens": 7, "completion_tokens": 3})
    (ok,) = [o for o in observed(h) if isinstance(o, Ended)]
    assert (ok.engine, ok.outcome, ok.reason, ok.admitted) == ("llm", "ok", "none", True)
    assert ok.queue_s == pytest.approx(0.0)
    assert ok.ttft_s == pytest.approx(0.2)
    assert ok.total_s == pytest.approx(0.5)
    assert ok.overshoot_s is None
    assert (ok.prompt_tokens, ok.completion_tokens) == (7, 3)

    # deadline: 300 ms budget, the timer fires 4 ms late (one token: admitted, as the
    # 150 ms per token the first request taught predicts it in time)
    h.send(generate("late", timeout_ms=300, max_tokens=1), 2.0)
    (late,) = h.requests(W1)
    h.tick(2.304, keepalive=(W1,))
    (ended,) = [o for o in observed(h) if isinstance(o, Ended)]
    assert ended.outcome == "error_deadline_exceeded"
    assert ended.overshoot_s == pytest.approx(0.004)
    h.final(W1, late["rid"], 2.31, status="error", code=499, message="cancelled")
    assert not [o for o in observed(h) if isinstance(o, Ended)]  # the ack is no second end
    h.drain_workers()

    # cancelled by its client, while queued behind a running one
    h.send(generate("runs"), 3.0)
    (runs,) = h.requests(W1)
    h.send(generate("waits"), 3.0)
    h.send({"op": "cancel", "id": "c1", "target": "waits"}, 3.1)
    (cancelled,) = [o for o in observed(h) if isinstance(o, Ended)]
    assert (cancelled.outcome, cancelled.reason) == ("error_cancelled", "none")
    assert cancelled.queue_s is None and cancelled.ttft_s is None  # it never ran

    # shed at admission: the queue (max_queue 4) is full
    for i in range(4):
        h.send(generate(f"q{i}"), 3.2)
    h.send(generate("no room"), 3.2)
    (shed,) = [o for o in observed(h) if isinstance(o, Ended)]
    assert (shed.outcome, shed.reason, shed.admitted) == ("error_unavailable", "queue_full", False)
    assert shed.total_s is None

    # the client leaves: its requests end unanswered, counted as client_gone
    h.broker.client_gone(b"client-a", GoneCause.DISCONNECTED, 3.3)
    gone = [o for o in observed(h) if isinstance(o, Ended)]
    assert len(gone) == 5 and {o.reason for o in gone} == {"client_gone"}
    h.final(W1, runs["rid"], 3.4, status="error", code=499, message="cancelled")


def test_event_metrics_count_and_time_what_the_broker_observed() -> None:
    registry = CollectorRegistry()
    metrics = EventMetrics(registry)
    observations: list[Observation] = [
        Ended(
            "llm",
            "ok",
            "none",
            queue_s=0.01,
            ttft_s=0.1,
            total_s=0.5,
            prompt_tokens=7,
            completion_tokens=3,
        ),
        Ended("rules", "ok", "circuit_open", total_s=0.001, degraded="circuit_open"),
        Ended("llm", "error_unavailable", "queue_full", admitted=False),
        Ended("llm", "error_deadline_exceeded", "none", total_s=0.3, overshoot_s=0.004),
        TokenGap("llm", 0.03),
    ]
    moved = [Transition(1.0, BreakerState.CLOSED, BreakerState.OPEN, "failures")]
    metrics.observe(observations, moved)

    def value(name: str, **labels: str) -> float:
        found = registry.get_sample_value(name, labels)
        return 0.0 if found is None else found

    assert value("edgenode_requests_total", engine="llm", outcome="ok", reason="none") == 1
    assert value("edgenode_fallbacks_total", reason="circuit_open") == 1
    assert value("edgenode_shed_total", engine="llm", reason="queue_full") == 1
    assert value("edgenode_prompt_tokens_total", engine="llm") == 7
    assert value("edgenode_generation_tokens_total", engine="llm") == 3
    assert value("edgenode_time_to_first_token_seconds_bucket", engine="llm", le="0.1") == 1
    assert value("edgenode_time_to_first_token_seconds_bucket", engine="llm", le="0.05") == 0
    assert value("edgenode_deadline_overshoot_seconds_bucket", engine="llm", le="0.005") == 1
    assert value("edgenode_deadline_overshoot_seconds_bucket", engine="llm", le="0.002") == 0
    assert value("edgenode_inter_token_seconds_count", engine="llm") == 1
    assert value("edgenode_request_duration_seconds_count", engine="llm", outcome="ok") == 1
    # A refused request has no latency of its own.
    assert (
        value("edgenode_request_duration_seconds_count", engine="llm", outcome="error_unavailable")
        == 0
    )
    assert value("edgenode_breaker_transitions_total", from_state="closed", to_state="open") == 1


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("", None),
        ("127.0.0.1:9464", Listen("127.0.0.1", 9464)),
        ("localhost:1", Listen("localhost", 1)),
        ("[::1]:65535", Listen("::1", 65535)),
        ("0.0.0.0:9464", Listen("0.0.0.0", 9464)),
    ],
)
def test_listen_addresses(text: str, parsed: Listen | None) -> None:
    assert parse_listen("metrics.listen", text) == parsed


def test_only_loopback_is_called_loopback() -> None:
    assert Listen("127.0.0.2", 1).loopback and Listen("::1", 1).loopback
    assert Listen("localhost", 1).loopback
    assert not Listen("0.0.0.0", 1).loopback and not Listen("192.0.2.1", 1).loopback


@pytest.mark.parametrize("text", ["9464", ":9464", "host:9464", "[::1]:0", "127.0.0.1:x"])
def test_bad_listen_addresses_name_the_key(text: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        parse_listen("metrics.listen", text)
