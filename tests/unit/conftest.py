"""Shared fixtures of the unit tier (sans-I/O, fake clock)."""

from __future__ import annotations

import pytest

from brokerkit import BrokerHarness


@pytest.fixture
def h() -> BrokerHarness:
    """A fresh broker with the fast test timings of ``brokerkit.FAST``."""
    return BrokerHarness()
