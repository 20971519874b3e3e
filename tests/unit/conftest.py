"""Shared fixtures of the unit tier (sans-I/O, fake clock)."""

from __future__ import annotations

import pytest

from broker.errors import ConfigError
from brokerkit import BrokerHarness
from node.capacity.gguf import ModelMeta, read_gguf_meta
from node.model import resolve_model


@pytest.fixture
def h() -> BrokerHarness:
    """A fresh broker with the fast test timings of ``brokerkit.FAST``."""
    return BrokerHarness()


@pytest.fixture(autouse=True)
def _no_host_memory_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budgets stay what a test configures whatever cgroup runs the tests: ``node.capacity.budget``
    cuts them to the node's cgroup limit, read from the real host (a CI container's
    limit, a node running in the default run directory). Tests of that path use fake
    trees (test_budget_path.py) and patch ``node_limit`` themselves."""
    monkeypatch.setattr("node.capacity.budget.node_limit", lambda config, host=None: None)


@pytest.fixture
def many_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host of 64 cores: "auto" slots follow the threads each worker really runs
    (``node.sandbox.cores.worker_threads``), which a small host would cut below the
    ``workers.threads`` a test's arithmetic is written for."""
    monkeypatch.setattr("node.sandbox.cores.allowed_cores", lambda: tuple(range(64)))


@pytest.fixture(scope="session")
def gemma() -> ModelMeta:
    """The default model's metadata (Gemma 3 270M Q4_K_M), read without its weights."""
    try:
        path = resolve_model("default")
    except ConfigError as exc:
        pytest.skip(f"default model not available: {exc.message}")
    return read_gguf_meta(path)
