"""The host agent's checks before anything starts (``node.remote.agent``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from broker.errors import ConfigError
from node.config import NodeConfig, SecuritySection
from node.remote.agent import agent_config, agent_keys, agent_name
from node.security.keys import generate


def test_the_agent_name_defaults_to_the_hosts_first_label_and_must_fit_a_worker_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "boardb.plant.example")
    assert agent_name(None) == "boardb"
    assert agent_name("cam-2") == "cam-2"
    for bad in ("", "a.b", "a/b", "-x", "x" * 65):
        with pytest.raises(ConfigError, match="worker --name must match"):
            agent_name(bad)


def test_the_agent_connects_its_workers_to_the_gateway_backend() -> None:
    config = agent_config(NodeConfig(), "tcp://127.0.0.1:5556")
    assert config.backend == "tcp://127.0.0.1:5556"
    with pytest.raises(ConfigError, match="not a wildcard"):
        agent_config(NodeConfig(), "tcp://*:5556")
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        agent_config(NodeConfig(), "tcp://127.0.0.1")


def test_plaintext_to_another_host_needs_keys_or_allow_plaintext(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="reachable from other hosts without CURVE"):
        agent_config(NodeConfig(), "tcp://192.0.2.1:5556")
    allowed = dataclasses.replace(NodeConfig(), security=SecuritySection(allow_plaintext=True))
    assert agent_config(allowed, "tcp://192.0.2.1:5556").backend == "tcp://192.0.2.1:5556"
    generate(tmp_path, "backend")
    generate(tmp_path, "boardb")
    keys = agent_keys(str(tmp_path / "boardb.key_secret"), str(tmp_path / "backend.key"))
    assert keys is not None and len(keys.server_public) == 40
    assert agent_config(NodeConfig(), "tcp://192.0.2.1:5556", keys).backend.endswith(":5556")


def test_keys_come_in_pairs_and_the_secret_stays_private(tmp_path: Path) -> None:
    assert agent_keys(None, None) is None
    generate(tmp_path, "boardb")
    with pytest.raises(ConfigError, match="go together"):
        agent_keys(str(tmp_path / "boardb.key_secret"), None)
    with pytest.raises(ConfigError, match="holds no secret key"):
        agent_keys(str(tmp_path / "boardb.key"), str(tmp_path / "boardb.key"))
    (tmp_path / "boardb.key_secret").chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        agent_keys(str(tmp_path / "boardb.key_secret"), str(tmp_path / "boardb.key"))
