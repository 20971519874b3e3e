"""Shared fixtures of the unit tier (sans-I/O, fake clock)."""

from __future__ import annotations

import os
from pathlib import Path

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


#: ``read_gguf_meta`` results by (path, size, mtime): a file's metadata is a function of its
#: bytes, and reading the default model's (its 262k-token vocabulary walked) took ~0.5-1 s
#: per plan, which most capacity tests make several of.
_GGUF_METAS: dict[tuple[str, int, int], ModelMeta] = {}


def _read_gguf_meta_once(path: Path | str) -> ModelMeta:
    """``read_gguf_meta``, read once per file version (errors are not kept: raised each time)."""
    try:
        st = os.stat(path)
    except OSError:
        return _read_gguf_meta_once(path)  # raises its ConfigError
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _GGUF_METAS:
        _GGUF_METAS[key] = read_gguf_meta(path)
    return _GGUF_METAS[key]


@pytest.fixture(autouse=True)
def _gguf_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity plan reads a model's metadata once per run (``_read_gguf_meta_once``);
    the reader itself is tested on its own (test_capacity.py, test_capacity_grammar.py)."""
    monkeypatch.setattr("node.capacity.plan.read_gguf_meta", _read_gguf_meta_once)


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
    return _read_gguf_meta_once(path)
