"""Routing with a fake clock: what counts against the breaker, the latency budget,
per-engine wait estimates. The hedge at the latency budget: test_core_hedge.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from broker.breaker import BreakerSettings
from broker.exits import ExitCause
from broker.protocol import WorkerCommand
from broker.routing import RoutingSettings
from brokerkit import FAST, RULES, W1, W2, BrokerHarness, bodies, generate

REQUEST = WorkerCommand.REQUEST
QUICK_BREAKER = BreakerSettings(
    minimum_calls=2,
    failure_rate_pct=50.0,
    open_wait_ms=1000,
    half_open_probes=1,
    half_open_successes=1,
)


def harness(mode: str = "degrade", budget_ms: int = 200, **settings: Any) -> BrokerHarness:
    return BrokerHarness(replace(FAST, **settings), RoutingSettings(mode, budget_ms), QUICK_BREAKER)


def counting_harness(minimum_calls: int) -> BrokerHarness:
    """Mode full, a breaker that needs ``minimum_calls`` calls before it opens."""
    breaker = replace(QUICK_BREAKER, minimum_calls=minimum_calls)
    return BrokerHarness(FAST, RoutingSettings("full", 200), breaker)


def breaker_state(h: BrokerHarness, now: float) -> str:
    return str(h.broker.router.breaker.state(now).value)


def test_the_brokers_own_503s_do_not_open_the_breaker() -> None:
    h = harness(max_queue=1)
    h.ready(W1, 0.0)
    h.send(generate("run"), 0.0)  # runs
    h.send(generate("s1", priority="sheddable"), 0.0)  # queued, holds a permit
    h.send(generate("c1", priority="critical"), 0.1)  # evicts s1: a 503 by the broker
    h.broker.set_pressure("critical", 0.2)  # cancels nothing here: no sheddable work runs
    h.broker.set_pressure("ok", 0.3)
    h.broker.abort_all("stopping", 0.4)  # shutdown 503s for the rest
    replies = {r["id"]: r for r in h.replies() if r["status"] == "error"}
    assert replies["s1"]["reason"] == "queue_full"
    assert breaker_state(h, 0.5) == "closed"
    assert h.broker.router.breaker.snapshot(0.5)["failures"] == 0


def test_worker_crashes_do_open_the_breaker() -> None:
    h = harness()
    h.ready(W1, 0.0, worker_id="llm-0")
    h.ready(W2, 0.0, worker_id="llm-1")
    h.send(generate("a"), 0.0)
    h.send(generate("b"), 0.0)
    h.drain_workers()
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.1)
    h.broker.worker_exited("llm-1", ExitCause(signal="SIGKILL"), 0.1)
    assert breaker_state(h, 0.2) == "open"


def test_a_lost_worker_counts_once_and_its_re_run_requests_decide_their_own_calls() -> None:
    """Break-it finding (session 11): each request a lost 4-slot worker held counted
    as a failure, so one kill -9 opened the breaker although all four were run again
    and answered ok (``failure rate 50% of 8 calls``, then 503 circuit_open)."""
    h = counting_harness(minimum_calls=5)  # [breaker]'s default
    h.ready(W1, 0.0, slots=4, worker_id="llm-0")
    for i in range(4):
        h.send(generate(f"r{i}"), 0.0)
    assert len(bodies(h.drain_workers(), W1, REQUEST)) == 4
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.1)
    assert h.broker.router.breaker.snapshot(0.1)["failures"] == 1
    h.ready(W2, 0.2, slots=4, worker_id="llm-0")  # restarted: the four run again
    again = bodies(h.drain_workers(), W2, REQUEST)
    assert len(again) == 4
    for req in again:
        h.final(W2, req["rid"], 0.3)
    assert [r["status"] for r in h.replies()] == ["ok"] * 4
    snap = h.broker.router.breaker.snapshot(0.4)
    assert (snap["state"], snap["failures"], snap["calls"]) == ("closed", 1, 5)


def test_a_lost_worker_that_ends_four_streams_counts_one_failure() -> None:
    """Break-it finding (session 13): a kill -9 of a 4-slot worker ending four
    streams that had sent text counted four failed calls, so with the default
    ``minimum_calls = 5`` one crash opened the breaker (``failure rate 80% of 5
    calls``) and ``route: "llm"`` got 503 circuit_open for 11 s, the worker back
    after 3.5 s. One crash is one fault, whatever the worker's slots."""
    h = counting_harness(minimum_calls=10)  # stays closed: every count shows
    h.ready(W1, 0.0, slots=4, worker_id="llm-0")
    for i in range(4):
        h.send(generate(f"s{i}", stream=True), 0.0)
    for req in bodies(h.drain_workers(), W1, REQUEST):
        h.partial(W1, req["rid"], "Once", 0.05)
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.1)
    lost = [r for r in h.replies() if r["status"] == "error"]
    assert [r["reason"] for r in lost] == ["worker_lost"] * 4
    snap = h.broker.router.breaker.snapshot(0.2)
    assert (snap["failures"], snap["calls"]) == (1, 1)


def test_one_crash_ending_four_streams_leaves_the_default_breaker_closed() -> None:
    """The same crash with ``[breaker]``'s default minimum of 5 calls and one
    success before it: 1 failure of 2 calls, closed (it used to open)."""
    h = counting_harness(minimum_calls=5)
    h.ready(W1, 0.0, slots=4, worker_id="llm-0")
    h.send(generate("ok"), 0.0)
    (first,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, first["rid"], 0.01)
    for i in range(4):
        h.send(generate(f"s{i}", stream=True), 0.02)
    for req in bodies(h.drain_workers(), W1, REQUEST):
        h.partial(W1, req["rid"], "Once", 0.05)
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.1)
    assert breaker_state(h, 0.2) == "closed"


def test_a_half_open_probe_ended_by_a_crash_reopens_the_breaker() -> None:
    """The one failure a crash counts lands on a request's permit, so a probe the
    crash ended still reopens a half-open breaker."""
    h = harness("full")  # QUICK_BREAKER: 2 calls open it, 1 probe, open 1 s
    h.ready(W1, 0.0, slots=4, worker_id="llm-0")
    h.ready(W2, 0.0, slots=4, worker_id="llm-1")
    for i in range(2):
        h.send(generate(f"a{i}"), 0.0)
    h.drain_workers()
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.1)
    h.broker.worker_exited("llm-1", ExitCause(signal="SIGKILL"), 0.1)
    assert breaker_state(h, 0.2) == "open"
    h.ready(W1, 1.5, slots=4, worker_id="llm-0")
    h.drain_workers()
    h.send(generate("probe", stream=True), 1.6)
    assert breaker_state(h, 1.6) == "half_open"
    (req,) = bodies(h.drain_workers(), W1, REQUEST)  # the two a* were not re-run
    h.partial(W1, req["rid"], "Once", 1.7)
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 1.8)
    assert breaker_state(h, 1.9) == "open"


def test_clean_disconnects_and_stopping_workers_are_not_failures() -> None:
    h = harness()
    h.ready(W1, 0.0, worker_id="llm-0")
    h.ready(W2, 0.0, worker_id="llm-1")
    h.worker_send(W1, WorkerCommand.DISCONNECT, {"reason": "worker stopping"}, 0.1)
    h.broker.draining = True
    h.broker.worker_exited("llm-1", ExitCause(code=0), 0.2)
    h.ready(W2, 0.3, worker_id="llm-1")
    h.ready(b"newer", 0.4, worker_id="llm-1")  # replaces the W2 incarnation
    assert h.broker.router.breaker.snapshot(0.5)["failures"] == 0


def test_a_request_lost_to_a_replaced_incarnation_is_no_pool_failure() -> None:
    """Break-it finding: after a broker pause the workers re-register, their streams
    end 503 worker_lost, and each such reply counted as a model failure (the breaker
    was one call short of opening)."""
    h = harness("full")
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("story", stream=True), 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.partial(W1, req["rid"], "Once", 0.1)
    h.ready(b"llm-0-again", 0.2, worker_id="llm-0")
    (lost,) = [r for r in h.replies() if r["status"] == "error"]
    assert (lost["reason"], lost["text"]) == ("worker_lost", "Once")
    snap = h.broker.router.breaker.snapshot(0.3)
    assert snap["failures"] == 0 and snap["state"] == "closed"


def test_zero_latency_budget_means_no_budget() -> None:
    h = harness(budget_ms=0)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    h.broker.estimator.observe_service(5.0)  # slow model, long queue: still the model's
    h.send(generate("busy"), 0.0)
    h.send(generate("waits"), 0.0)
    assert [r for r in h.replies() if r["status"] == "error"] == []
    for i in range(1, 31):  # three seconds of a healthy, busy, progressing model
        h.heartbeat(W1, i / 10, advance=1)
        h.tick(i / 10, keepalive=(RULES,))
    requests = bodies(h.drain_workers(), RULES, REQUEST)
    assert requests == []  # nothing was handed to the rules
    assert h.broker.status(3.0)["queue_depth"] == 1


def test_a_rules_request_does_not_wait_for_the_model_queue() -> None:
    h = harness(mode="full", max_queue=16)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    h.send(generate("warm"), 0.0)
    (req,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, req["rid"], 4.0)  # the model takes 4 s per request
    h.replies()
    for i in range(4):  # a long model queue
        h.send(generate(f"m{i}", timeout_ms=60_000), 4.0)
    h.send(generate("r", route="rules", timeout_ms=500), 4.0)
    assert [r for r in h.replies() if r["status"] == "error"] == []
    assert len(bodies(h.drain_workers(), RULES, REQUEST)) == 1


def test_service_times_are_kept_per_engine() -> None:
    h = harness(mode="full", max_queue=16)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    h.send(generate("model"), 0.0)
    (m,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, m["rid"], 5.0)  # the model: 5 s
    h.send(generate("rule", route="rules"), 5.0)
    (r,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.final(RULES, r["rid"], 5.002)  # the rules: 2 ms
    h.replies()
    estimator = h.broker.estimator
    assert estimator.mean_s("llm") == 5.0 and estimator.mean_s("rules") < 0.01
    # A backlog of rule requests with tight budgets is fine: the rules are fast.
    for i in range(6):
        h.send(generate(f"r{i}", route="rules", timeout_ms=300), 6.0)
    assert [r for r in h.replies() if r["status"] == "error"] == []
    assert (
        estimator.mean_retry_after_ms(4, 1, "rules")
        == 50
        < estimator.mean_retry_after_ms(4, 1, "llm")
    )


def test_rules_request_shed_at_client_cap_is_advised_by_the_rules_service_time() -> None:
    """A rule request refused for its client's cap retries when the rules could take
    it (milliseconds), not after the model's mean service time (seconds)."""
    h = harness(mode="full", max_in_flight_per_client=1)
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    h.send(generate("model"), 0.0)
    (m,) = bodies(h.drain_workers(), W1, REQUEST)
    h.final(W1, m["rid"], 4.0)  # the model: 4 s per request
    h.send(generate("rule", route="rules"), 4.0)
    (r,) = bodies(h.drain_workers(), RULES, REQUEST)
    h.final(RULES, r["rid"], 4.002)  # the rules: 2 ms
    h.replies()
    h.send(generate("busy-rule", route="rules"), 5.0)  # in flight at the rule worker
    h.send(generate("capped-rule", route="rules"), 5.0)
    (reply,) = [r for r in h.replies() if r["id"] == "capped-rule"]
    assert (reply["code"], reply["reason"]) == (429, "client_cap")
    rules_advice = h.broker.estimator.mean_retry_after_ms(0, 1, "rules")
    assert reply["retry_after_ms"] == rules_advice < h.broker.estimator.mean_s("llm") * 1000
