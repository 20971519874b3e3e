"""A host agent supervising its workers with what the gateway tells them, with real
processes (a gateway node on a loopback TCP backend, ``edgenode worker --connect`` as
a separate process, the test engine, 100 ms heartbeats): it learns that its workers
registered, restarts with backoff a worker that never registers, and starts the
backoff anew after a worker's good run. What the agent knows is read from its
``agent-status.json``."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from node.remote.agent import STATUS_FILE
from node.testing import FAST_BROKER, AgentProcess, NodeProcess, free_port, wait_for

AGENT = "boardc"
REMOTE_ID = f"{AGENT}.llm-0"
TEST_WORKERS = {"engine": "test", "count": 1, "slots": 1, "threads": 1, "test_token_ms": 10}
NodeFactory = Callable[..., NodeProcess]
AgentFactory = Callable[..., AgentProcess]


@pytest.fixture
def make_agent() -> Iterator[AgentFactory]:
    """Factory: ``make_agent(backend, workers={...})``, a started agent of one worker."""
    agents: list[AgentProcess] = []

    def factory(backend: str, **workers: Any) -> AgentProcess:
        sections = {"workers": {**TEST_WORKERS, **workers}, "broker": FAST_BROKER}
        agent = AgentProcess(backend, AGENT, sections)
        agents.append(agent)
        return agent.start()

    yield factory
    for agent in agents:
        agent.cleanup()


def gateway(make_node: NodeFactory, backend: str) -> NodeProcess:
    return make_node(node={"backend": backend}, workers={**TEST_WORKERS})


def worker_view(agent: AgentProcess) -> dict[str, Any] | None:
    """The agent's row of its one worker (``agent-status.json``), None before it wrote one."""
    assert agent.proc is not None
    if agent.proc.poll() is not None:
        raise RuntimeError(f"agent exited: {agent.log.read_text()[-3000:]}")
    try:
        view = json.loads((agent.run_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None
    (row,) = view["workers"]
    assert row["worker_id"] == REMOTE_ID
    return dict(row)


def until(agent: AgentProcess, check: Callable[[dict[str, Any]], bool], timeout: float = 20) -> Any:
    """The agent's worker row once ``check`` holds for it."""

    def seen() -> dict[str, Any] | None:
        row = worker_view(agent)
        return row if row is not None and check(row) else None

    return wait_for(seen, timeout=timeout, every=0.05)


def test_the_agent_learns_that_its_worker_registered(
    make_node: NodeFactory, make_agent: AgentFactory
) -> None:
    backend = f"tcp://127.0.0.1:{free_port()}"
    node = gateway(make_node, backend)
    agent = make_agent(backend)
    (remote,) = agent.registered(node, 1)
    row = until(agent, lambda r: r["registered"])
    assert (row["state"], row["registrations"], row["pid"]) == ("ready", 1, remote["pid"])
    assert row["restarts"] == 0 and row["failures_in_row"] == 0
    assert f"{REMOTE_ID} registered with the gateway (pid {remote['pid']})" in agent.log.read_text()


def test_a_worker_that_never_registers_is_restarted_with_backoff_until_it_does(
    make_node: NodeFactory, make_agent: AgentFactory
) -> None:
    backend = f"tcp://127.0.0.1:{free_port()}"  # no gateway there yet
    agent = make_agent(
        backend, ready_timeout_ms=3000, restart_backoff_ms=200, restart_backoff_max_ms=1000
    )
    row = until(agent, lambda r: r["restarts"] >= 2, timeout=40)
    assert row["last_exit"].startswith("not READY within 3s"), row
    assert row["failures_in_row"] >= 2 and not row["registered"]  # each kill backs off more
    node = gateway(make_node, backend)
    (remote,) = agent.registered(node, 1)
    row = until(agent, lambda r: r["registered"] and r["pid"] == remote["pid"])
    assert row["state"] == "ready"
    restarts = row["restarts"]
    # Registered: no longer killed for the READY timeout (3 s) once it has run longer.
    time.sleep(3.5)
    steady = until(agent, lambda r: True)
    assert (steady["pid"], steady["restarts"], steady["state"]) == (
        remote["pid"],
        restarts,
        "ready",
    )


def test_the_backoff_starts_anew_after_a_good_run(
    make_node: NodeFactory, make_agent: AgentFactory
) -> None:
    backend = f"tcp://127.0.0.1:{free_port()}"
    node = gateway(make_node, backend)
    # A good run: registered for restart_backoff_max_ms (1.5 s).
    agent = make_agent(backend, restart_backoff_ms=100, restart_backoff_max_ms=1500)
    agent.registered(node, 1)
    pids = set()
    for failures in (1, 2):  # killed soon after registering: no good run, the delay grows
        row = until(agent, lambda r: r["registered"] and r["pid"] not in pids)
        pids.add(row["pid"])
        os.kill(row["pid"], signal.SIGKILL)
        row = until(agent, lambda r, f=failures: r["failures_in_row"] == f)
    row = until(agent, lambda r: r["registered"] and r["pid"] not in pids)
    assert row["failures_in_row"] == 2  # registered, but not up long enough yet
    row = until(agent, lambda r: r["failures_in_row"] == 0, timeout=10)
    assert row["pid"] not in pids and row["registered"]
    assert "up for" in agent.log.read_text()
    good = row["pid"]
    os.kill(good, signal.SIGKILL)  # after a good run: from the first delay again
    row = until(agent, lambda r: r["failures_in_row"] == 1 and r["pid"] not in (None, good))
    assert row["restarts"] == 3
