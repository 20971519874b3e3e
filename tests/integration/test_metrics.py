"""Prometheus metrics of a real node (test engine): ``[metrics] listen`` serves
``/metrics`` from the broker's process, and nothing listens without it.

Each test takes a free port of its own. Scrapes are parsed with
``prometheus_client``'s own parser, so names, types and labels are checked as a
Prometheus server would read them.
"""

from __future__ import annotations

import os
import signal
import socket
import urllib.request
from collections.abc import Callable

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.errors import Cancelled, DeadlineExceeded, Unavailable
from broker.kinds import ENGINE_KINDS
from node.testing import NodeProcess, free_port, wait_for

NodeFactory = Callable[..., NodeProcess]
#: A stream of 1 + 30 pieces at 100 ms each: still running whenever the test acts on it.
SLOW = "!slow 100 " + " ".join(f"w{i}" for i in range(28))
WAIT_MS = 5000

#: Every metric family the node exports, with its Prometheus type and label names
#: (the parser names a counter's family without ``_total``).
FAMILIES: dict[str, tuple[str, set[str]]] = {
    "edgenode_requests": ("counter", {"engine", "outcome", "reason"}),
    "edgenode_shed": ("counter", {"engine", "reason"}),
    "edgenode_fallbacks": ("counter", {"reason"}),
    "edgenode_prompt_tokens": ("counter", {"engine"}),
    "edgenode_generation_tokens": ("counter", {"engine"}),
    "edgenode_queue_seconds": ("histogram", {"engine"}),
    "edgenode_time_to_first_token_seconds": ("histogram", {"engine"}),
    "edgenode_inter_token_seconds": ("histogram", {"engine"}),
    "edgenode_request_duration_seconds": ("histogram", {"engine", "outcome"}),
    "edgenode_deadline_overshoot_seconds": ("histogram", {"engine"}),
    "edgenode_breaker_transitions": ("counter", {"from_state", "to_state"}),
    "edgenode_state_age_seconds": ("gauge", set()),
    "edgenode_credit_free": ("gauge", {"engine"}),
    "edgenode_slots": ("gauge", {"engine"}),
    "edgenode_queue_depth": ("gauge", {"engine"}),
    "edgenode_requests_running": ("gauge", set()),
    "edgenode_breaker_state": ("gauge", {"state"}),
    "edgenode_memory_pressure": ("gauge", {"level"}),
    "edgenode_cpu_pressure": ("gauge", {"level"}),
    "edgenode_worker_oom_kills": ("counter", {"worker", "engine"}),
    "edgenode_worker_restarts": ("counter", {"worker", "engine"}),
    "edgenode_worker_last_heard_seconds": ("gauge", {"worker", "engine"}),
    "edgenode_worker_state": ("gauge", {"worker", "engine", "state"}),
}
#: Present only where the workers have cgroups (root, a memory controller).
MEMORY_FAMILIES = (
    "edgenode_worker_memory_bytes",
    "edgenode_worker_memory_limit_bytes",
    "edgenode_worker_memory_peak_bytes",
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Scrape:
    """One parsed ``/metrics`` page: families by name, and every sample's value."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            assert page.headers["Content-Type"].startswith("text/plain")
            text = page.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: Samples = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(self, name: str, **labels: str) -> float:
        """A sample's value; 0 for a labelled series not created yet."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)


def scrape_until(port: int, ready: Callable[[Scrape], bool], timeout: float = 10) -> Scrape:
    """The first scrape for which ``ready`` holds (the state gauges lag the loop by
    up to ``node.observe.state.PUBLISH_EVERY_S``)."""

    def attempt() -> Scrape | None:
        scrape = Scrape(port)
        return scrape if ready(scrape) else None

    result: Scrape = wait_for(attempt, timeout=timeout)
    return result


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on."""
    proc = psutil.Process(pid)
    # net_connections is psutil >= 6.0's name (pyproject allows 5.9, which has only connections).
    conns = (proc.net_connections if hasattr(proc, "net_connections") else proc.connections)("tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def test_metrics_move_with_ok_shed_cancelled_and_deadline_outcomes(make_node: NodeFactory) -> None:
    port = free_port()
    node = make_node(broker={"max_queue": 1}, metrics={"listen": f"127.0.0.1:{port}"})
    before = scrape_until(port, lambda s: s.value("edgenode_slots", engine="llm") == 2)
    for name, (kind, labels) in FAMILIES.items():
        assert name in before.families, name
        family = before.families[name]
        assert family.type == kind, (name, family.type)
        for sample in family.samples:
            # Histograms add ``le`` to their buckets.
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
    assert before.value("edgenode_slots", engine="llm") == 2
    assert before.value("edgenode_breaker_state", state="closed") == 1
    assert before.value("edgenode_worker_state", worker="llm-0", engine="llm", state="ready") == 1
    for engine in ENGINE_KINDS:  # label values come from the broker's vocabularies
        assert ("edgenode_queue_seconds_count", frozenset({("engine", engine)})) in before.samples

    with node.client(wait_ms=WAIT_MS) as c:
        # ok, twice
        for _ in range(2):
            assert c.generate("hello metrics", max_tokens=4).text == "echo: hello metrics"
        # deadline: a second a token, a 2 s budget (admission, which predicts from the
        # ~10 ms tokens measured so far, lets it in even on a loaded machine)
        with pytest.raises(DeadlineExceeded):
            c.generate("!slow 1000 a b c", max_tokens=6, timeout_ms=2000)
        # both workers busy, one request queued, the next shed (max_queue = 1) ...
        running = [c.stream_generate(SLOW, max_tokens=100) for _ in range(2)]
        streams = [iter(r) for r in running]
        for pieces in streams:
            next(pieces)
        queued = c.stream_generate("waits", max_tokens=2)
        with pytest.raises(Unavailable) as shed:
            c.generate("no room", max_tokens=2)
        assert shed.value.reason == "queue_full"
        # ... which a scrape sees while the traffic runs.
        during = scrape_until(
            port,
            lambda s: (
                s.value("edgenode_queue_depth", engine="llm") == 1
                and s.value("edgenode_requests_running") == 2
                and s.value("edgenode_credit_free", engine="llm") == 0
            ),
        )
        assert during.value("edgenode_inter_token_seconds_count", engine="llm") > before.value(
            "edgenode_inter_token_seconds_count", engine="llm"
        )
        # cancelled: the two running streams
        for r, pieces in zip(running, streams, strict=True):
            c.cancel(r.id)
            with pytest.raises(Cancelled):
                list(pieces)
        assert "".join(queued) == "echo: waits"  # a third ok

    after = scrape_until(port, lambda s: s.value("edgenode_requests_running") == 0)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **labels) - before.value(name, **labels)

    requests = "edgenode_requests_total"
    assert delta(requests, engine="llm", outcome="ok", reason="none") == 3
    assert delta(requests, engine="llm", outcome="error_deadline_exceeded", reason="none") == 1
    assert delta(requests, engine="llm", outcome="error_cancelled", reason="none") == 2
    assert delta(requests, engine="llm", outcome="error_unavailable", reason="queue_full") == 1
    assert delta("edgenode_shed_total", engine="llm", reason="queue_full") == 1
    duration = "edgenode_request_duration_seconds_count"
    assert delta(duration, engine="llm", outcome="ok") == 3
    assert delta(duration, engine="llm", outcome="error_deadline_exceeded") == 1
    assert delta(duration, engine="llm", outcome="error_cancelled") == 2
    # The shed request was never admitted: no latency of its own.
    assert delta(duration, engine="llm", outcome="error_unavailable") == 0
    assert delta("edgenode_deadline_overshoot_seconds_count", engine="llm") == 1
    overshoot = delta("edgenode_deadline_overshoot_seconds_sum", engine="llm")
    assert 0 <= overshoot < 1.0
    # Every admitted request ran (6) and streamed a first token.
    assert delta("edgenode_queue_seconds_count", engine="llm") == 6
    assert delta("edgenode_time_to_first_token_seconds_count", engine="llm") == 6
    # "hello metrics": 2 prompt tokens, 3 generated ("echo:", " hello", " metrics"); "waits": 1, 2.
    assert delta("edgenode_prompt_tokens_total", engine="llm") == 2 * 2 + 1
    assert delta("edgenode_generation_tokens_total", engine="llm") == 2 * 3 + 2
    assert delta("edgenode_inter_token_seconds_count", engine="llm") > 0
    assert after.value("edgenode_queue_depth", engine="llm") == 0
    assert after.value("edgenode_credit_free", engine="llm") == 2
    # Nothing reached the rules, and the breaker did not move.
    assert not any(s.value for s in after.families["edgenode_fallbacks"].samples)
    assert after.value("edgenode_breaker_state", state="closed") == 1


def test_nothing_listens_while_metrics_are_off(make_node: NodeFactory) -> None:
    port = free_port()
    node = make_node()  # no [metrics]: off by default
    assert node.proc is not None
    assert listening_ports(node.proc.pid) == set()
    with node.client(wait_ms=WAIT_MS) as c:
        assert c.generate("hello", max_tokens=2).text == "echo: hello"
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
    assert listening_ports(node.proc.pid) == set()


def test_metrics_listen_on_the_configured_port_only_until_the_node_stops(
    make_node: NodeFactory,
) -> None:
    port = free_port()
    node = make_node(metrics={"listen": f"127.0.0.1:{port}"})
    assert node.proc is not None
    assert listening_ports(node.proc.pid) == {port}
    assert "edgenode_requests" in Scrape(port).families
    # A clean stop (exit 0) closes the endpoint and frees the port.
    assert node.stop() == 0
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass


def test_a_metrics_port_in_use_stops_the_start_naming_the_key(make_node: NodeFactory) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        node = make_node(start=False, metrics={"listen": f"127.0.0.1:{port}"})
        result = node.cli("start", "--wait-s", "60")
    assert result.returncode != 0, result.stdout
    assert f"metrics.listen 127.0.0.1:{port}: cannot listen" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_metrics_follow_lost_workers_the_breaker_and_the_fallbacks(make_node: NodeFactory) -> None:
    port = free_port()
    node = make_node(
        fallback={"rules": "default"},
        # Opens once 2+ calls are in its window and half failed (as in test_fallback.py).
        breaker={
            "minimum_calls": 2,
            "open_wait_ms": 60_000,  # still open when the last scrape comes
            "half_open_probes": 1,
            "half_open_successes": 1,
        },
        metrics={"listen": f"127.0.0.1:{port}"},
    )
    # Two sources: the broker's registry (slots) and the supervisor's process state,
    # which may turn "ready" a snapshot later (failed once in CI when asserted at once).
    scrape_until(
        port,
        lambda s: (
            s.value("edgenode_slots", engine="rules") == 1
            and s.value("edgenode_worker_state", worker="rules-0", engine="rules", state="ready")
            == 1
        ),
    )
    with node.client(wait_ms=WAIT_MS) as c:
        assert c.generate("Turn on the kitchen lights").served_by == "llm"
        for w in node.status()["processes"]:
            if w["worker_id"].startswith("llm-"):
                os.kill(w["pid"], signal.SIGKILL)
        # Both lost: the breaker opens, the rules answer in the model's place.
        wait_for(lambda: not any(w["kind"] == "llm" for w in node.status()["workers"]))
        reply = c.generate("Turn on the kitchen lights")
        assert (reply.served_by, reply.degraded) == ("rules", True)
        reason = reply.raw["degrade_reason"]
    after = scrape_until(
        port,
        lambda s: (
            s.value("edgenode_worker_restarts_total", worker="llm-0", engine="llm") == 1
            and s.value("edgenode_worker_restarts_total", worker="llm-1", engine="llm") == 1
        ),
    )
    assert (
        after.value("edgenode_breaker_transitions_total", from_state="closed", to_state="open") == 1
    )
    assert after.value("edgenode_breaker_state", state="open") == 1
    assert after.value("edgenode_fallbacks_total", reason=reason) == 1
    assert after.value("edgenode_requests_total", engine="rules", outcome="ok", reason=reason) == 1
    assert after.value("edgenode_requests_total", engine="llm", outcome="ok", reason="none") == 1
    assert after.value("edgenode_worker_restarts_total", worker="rules-0", engine="rules") == 0
    # The rules answered in well under the model's time: its own histograms moved.
    assert after.value("edgenode_request_duration_seconds_count", engine="rules", outcome="ok") == 1
