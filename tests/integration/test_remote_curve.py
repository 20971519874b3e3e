"""Remote host agents on a CURVE backend over loopback TCP: a gateway node and
``edgenode worker`` agents started as processes of their own (test engine, 100 ms
heartbeats x 3). An allowed agent's workers register and serve; an agent without
an allowed key, one that trusts another server key, or one in plaintext cannot
register, and the gateway counts the refusals."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from node.security.keys import generate
from node.testing import FAST_BROKER, AgentProcess, Collector, NodeProcess, free_port, wait_for

TEST_WORKERS = {"engine": "test", "count": 1, "slots": 1, "threads": 1, "test_token_ms": 10}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    """The gateway backend's keypair, an allowed agent's (boardb) and a stranger's."""
    root = tmp_path / "keys"
    for name in ("backend", "boardb", "stranger"):
        generate(root, name)
    return root


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    """The agents a test started, cleaned up whatever happens."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.cleanup()


def curve_gateway(make_node: Callable[..., NodeProcess], keys: Path, tmp_path: Path) -> NodeProcess:
    """A gateway with CURVE on its loopback TCP backend; boardb's public key allowed
    with ``edgenode keys allow --worker``."""
    node = make_node(
        start=False,
        node={"backend": f"tcp://127.0.0.1:{free_port()}"},
        workers=TEST_WORKERS,
        security={
            "backend_secret_key": str(keys / "backend.key_secret"),
            "worker_keys": str(tmp_path / "workers"),
        },
    )
    allowed = node.cli("keys", "allow", str(keys / "boardb.key"), "--worker")
    assert allowed.returncode == 0, allowed.stderr
    return node.start()


def agent(agents: list[AgentProcess], node: NodeProcess, name: str, *extra: str) -> AgentProcess:
    """Start agent NAME for ``node``'s backend with ``edgenode worker`` options ``extra``."""
    sections: dict[str, dict[str, Any]] = {"workers": TEST_WORKERS, "broker": FAST_BROKER}
    made = AgentProcess(node.sections["node"]["backend"], name, sections, extra=extra)
    agents.append(made)
    return made.start()


def refused(node: NodeProcess, cause: str) -> int:
    """The gateway's count of CURVE handshakes refused on its backend for ``cause``."""
    count: int = node.status()["refused"]["backend"][cause]
    return count


def test_an_allowed_agents_workers_serve_on_a_curve_backend(
    make_node: Callable[..., NodeProcess],
    keys: Path,
    tmp_path: Path,
    agents: list[AgentProcess],
) -> None:
    node = curve_gateway(make_node, keys, tmp_path)
    board = agent(
        agents,
        node,
        "boardb",
        "--key",
        str(keys / "boardb.key_secret"),
        "--server-key",
        str(keys / "backend.key"),
    )
    (entry,) = board.registered(node, 1)
    assert (entry["worker_id"], entry["remote"]) == ("boardb.llm-0", True)
    assert node.status()["security"]["backend"] == "curve"
    col = Collector(node.frontend)
    try:  # two at once: the local slot takes one, the agent's worker the other
        for i in range(2):
            col.send(id=i, op="generate", prompt=f"!slow 100 {i} a b c")
        col.collect(timeout=20)
        col.assert_exactly_one_final_each()
        served = sorted((col.final(i)["status"], col.final(i)["worker"]) for i in range(2))
        assert served == [("ok", "boardb.llm-0"), ("ok", "llm-0")]
    finally:
        col.close()
    assert "curve" in (board.log.read_text())


def test_an_agent_without_the_backends_allowed_key_cannot_register(
    make_node: Callable[..., NodeProcess],
    keys: Path,
    tmp_path: Path,
    agents: list[AgentProcess],
) -> None:
    node = curve_gateway(make_node, keys, tmp_path)
    backend_key = str(keys / "backend.key")
    # A stranger's key (not allowed), the allowed key but trusting another server
    # key (a spoofed gateway's), and no key at all (plaintext on loopback).
    stranger = agent(agents, node, "strange", "--key", str(keys / "stranger.key_secret"),
                     "--server-key", backend_key)  # fmt: skip
    fooled = agent(agents, node, "fooled", "--key", str(keys / "boardb.key_secret"),
                   "--server-key", str(keys / "stranger.key"))  # fmt: skip
    plain = agent(agents, node, "plain")
    assert wait_for(lambda: refused(node, "key_not_allowed") >= 1, timeout=30)
    assert wait_for(lambda: refused(node, "handshake_failed") >= 2, timeout=30)
    # Their workers run and keep trying, and none is ever registered.
    for one in (stranger, fooled, plain):
        assert one.proc is not None and one.proc.poll() is None, one.log.read_text()
        assert len(one.worker_pids()) == 1
    assert [w["worker_id"] for w in node.status()["workers"]] == ["llm-0"]


def test_an_agent_refuses_half_a_keypair_or_plaintext_to_another_host(
    make_node: Callable[..., NodeProcess], keys: Path
) -> None:
    node = make_node(start=False)
    half = node.cli(
        "worker", "--connect", "tcp://127.0.0.1:5556", "--key", str(keys / "boardb.key_secret")
    )
    assert half.returncode == 1
    assert "--key and --server-key go together" in half.stderr
    exposed = node.cli("worker", "--connect", "tcp://192.0.2.1:5556", "--name", "b")
    assert exposed.returncode == 1
    assert "reachable from other hosts without CURVE" in exposed.stderr
    loose = keys / "loose.key_secret"
    loose.write_bytes((keys / "boardb.key_secret").read_bytes())
    loose.chmod(0o644)
    shown = node.cli("worker", "--connect", "tcp://127.0.0.1:5556", "--key", str(loose),
                     "--server-key", str(keys / "backend.key"))  # fmt: skip
    assert shown.returncode == 1
    assert "readable by others" in shown.stderr
