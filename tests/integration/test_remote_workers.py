"""Remote workers with real processes: a gateway node on a loopback TCP backend and a
host agent (``edgenode worker --connect``) started as a separate process, in its
own run dir and cgroups, both with the test engine and 100 ms heartbeats x 3."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from node.testing import FAST_BROKER, AgentProcess, Collector, NodeProcess, free_port, wait_for

AGENT = "boardb"
REMOTE_ID = f"{AGENT}.llm-0"
TEST_WORKERS = {"engine": "test", "count": 1, "slots": 1, "threads": 1, "test_token_ms": 10}

Pair = Callable[..., tuple[NodeProcess, AgentProcess]]


@pytest.fixture
def gateway_and_agent(make_node: Callable[..., NodeProcess]) -> Iterator[Pair]:
    """Factory: ``(gateway, agent)``, the agent's workers registered with the gateway.
    ``rules=True`` gives the gateway its rule worker; ``agent_slots`` the remote
    worker's slots; ``local_workers`` the gateway's own model workers."""
    agents: list[AgentProcess] = []

    def factory(
        rules: bool = False, agent_slots: int = 1, local_workers: int = 1
    ) -> tuple[NodeProcess, AgentProcess]:
        backend = f"tcp://127.0.0.1:{free_port()}"
        node = make_node(
            node={"backend": backend},
            workers={**TEST_WORKERS, "count": local_workers},
            fallback={"rules": "default" if rules else ""},
            # Degrade mode's latency hedge is not under test: slow requests must
            # reach the rules only when a worker is lost.
            routing={"ttft_budget_ms": 10_000},
        )
        agent = AgentProcess(
            backend,
            AGENT,
            {"workers": {**TEST_WORKERS, "slots": agent_slots}, "broker": FAST_BROKER},
        )
        agents.append(agent)
        agent.start().registered(node, 1)
        return node, agent

    yield factory
    for agent in agents:
        agent.cleanup()


def run_all(node: NodeProcess, bodies: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    """Send ``bodies`` at once; each one's single final reply, by id."""
    col = Collector(node.frontend)
    try:
        for body in bodies:
            col.send(op="generate", **body)
        col.collect(timeout=20)
        col.assert_exactly_one_final_each()
        return {b["id"]: col.final(b["id"]) for b in bodies}
    finally:
        col.close()


def test_an_agents_workers_serve_after_the_local_ones(gateway_and_agent: Pair) -> None:
    node, _agent = gateway_and_agent()
    # One at a time: the local slot is always free, so the local worker serves them all.
    with node.client(wait_ms=10_000) as c:
        alone = [c.generate(f"one {i}").raw["worker"] for i in range(4)]
    assert alone == ["llm-0"] * 4
    # Two at once (slow enough to overlap): the local slot is taken, the remote one serves.
    both = run_all(node, [{"id": i, "prompt": f"!slow 100 {i} a b c"} for i in range(2)])
    assert sorted(r["worker"] for r in both.values()) == ["boardb.llm-0", "llm-0"]
    assert all(r["status"] == "ok" for r in both.values())


def test_status_shows_remote_workers_apart(gateway_and_agent: Pair) -> None:
    node, agent = gateway_and_agent()
    workers = {w["worker_id"]: w for w in node.status()["workers"]}
    assert (workers["llm-0"]["remote"], workers[REMOTE_ID]["remote"]) == (False, True)
    assert workers[REMOTE_ID]["host"] == AGENT
    assert workers[REMOTE_ID]["pid"] in agent.worker_pids()
    # The node supervises its own processes only: the remote one is not among them.
    assert [p["worker_id"] for p in node.status()["processes"]] == ["llm-0"]
    shown = node.cli("status")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("REMOTE WORKER"))
    assert lines[header + 1].split()[:3] == [REMOTE_ID, AGENT, "ready"]


def test_killing_the_agent_mid_request_answers_each_request_once(gateway_and_agent: Pair) -> None:
    """kill -9 of the agent and its workers (a board losing power) while it runs a
    plain and a streamed request. Missed heartbeats declare its worker dead; the
    plain one (nothing seen by its client) runs again on the local worker; the
    streamed one, its text half out, ends with 503 ``worker_lost`` carrying that
    text (text a client has seen is never made again). One final reply each."""
    node, agent = gateway_and_agent(rules=True, agent_slots=2)
    col = Collector(node.frontend)
    try:
        # Hold the local slot until the remote worker is gone (3 x 100 ms of silence).
        col.send(id="local", op="generate", prompt="!slow 150 a b c d e f g h", max_tokens=8)
        wait_for(lambda: _active(node, "llm-0") == 1)
        col.send(id="plain", op="generate", prompt="!slow 200 a b c d e f", max_tokens=6)
        col.send(id="streamed", op="generate", prompt="!slow 200 a b c d e f", stream=True)
        wait_for(lambda: _active(node, REMOTE_ID) == 2)
        wait_for(lambda: _partials(col, "streamed"))
        agent.kill9()
        col.collect(timeout=20)
        col.assert_exactly_one_final_each()
        plain, streamed = col.final("plain"), col.final("streamed")
        assert (plain["status"], plain["worker"]) == ("ok", "llm-0"), plain
        assert (streamed["code"], streamed["reason"]) == (503, "worker_lost"), streamed
        shown = "".join(r["text"] for r in col.replies["streamed"] if r["status"] == "partial")
        assert shown and streamed["text"] == shown
        assert col.final("local")["status"] == "ok"
    finally:
        col.close()
    status = node.status()
    assert [w["worker_id"] for w in status["workers"] if w["remote"]] == []
    assert status["counters"]["workers_lost"] == 1
    assert status["in_flight"] == 0


def test_killing_the_only_model_board_hands_its_request_to_the_rules(
    gateway_and_agent: Pair,
) -> None:
    """A gateway with no model worker of its own (workers.count = 0): when the
    agent dies, degrade mode's rules answer the request it was running."""
    node, agent = gateway_and_agent(rules=True, local_workers=0)
    col = Collector(node.frontend)
    try:
        col.send(id="lights", op="generate", prompt="!slow 300 Turn on the kitchen lights")
        wait_for(lambda: _active(node, REMOTE_ID) == 1)
        agent.kill9()
        col.collect(timeout=20)
        col.assert_exactly_one_final_each()
        reply = col.final("lights")
        assert (reply.get("served_by"), reply.get("degraded")) == ("rules", True), reply
        assert reply["degrade_reason"] in ("worker_lost", "no_model_worker")
    finally:
        col.close()


def test_an_agent_refuses_a_name_that_cannot_prefix_worker_ids(
    make_node: Callable[..., NodeProcess],
) -> None:
    node = make_node(start=False)
    done = node.cli("worker", "--connect", "tcp://127.0.0.1:5556", "--name", "a.b")
    assert done.returncode == 1
    assert "worker --name must match" in done.stderr
    done = node.cli("worker", "--connect", "tcp://*:5556", "--name", "b")
    assert done.returncode == 1
    assert "not a wildcard" in done.stderr


def _active(node: NodeProcess, worker_id: str) -> int:
    for w in node.status()["workers"]:
        if w["worker_id"] == worker_id:
            active: int = w["active"]
            return active
    return -1


def _partials(col: Collector, rid: str) -> bool:
    """Read what has come; whether ``rid`` has had a partial reply yet."""
    col.collect(until_all_final=False, timeout=0.05, linger=0)
    return any(r["status"] == "partial" for r in col.replies.get(rid, []))
