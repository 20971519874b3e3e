"""Shared fixtures of the unit tier (sans-I/O, fake clock)."""

from __future__ import annotations

import pytest

from broker.errors import ConfigError
from brokerkit import BrokerHarness
from node.gguf_meta import ModelMeta, read_gguf_meta
from node.model import resolve_model


@pytest.fixture
def h() -> BrokerHarness:
    """A fresh broker with the fast test timings of ``brokerkit.FAST``."""
    return BrokerHarness()


@pytest.fixture(scope="session")
def gemma() -> ModelMeta:
    """The default model's metadata (Gemma 3 270M Q4_K_M), read without its weights."""
    try:
        path = resolve_model("default")
    except ConfigError as exc:
        pytest.skip(f"default model not available: {exc.message}")
    return read_gguf_meta(path)
