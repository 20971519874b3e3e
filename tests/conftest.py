"""Shared fixtures: nodes started as real processes, cleaned up whatever happens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from node.testing import FAST_BROKER, NodeProcess


@pytest.fixture
def make_node() -> Iterator[Callable[..., NodeProcess]]:
    """Factory: ``make_node(workers={...}, broker={...})`` starts a node with the test engine.

    Sections given replace keys of the defaults below; ``start=False`` returns
    the node unstarted (for CLI tests).
    """
    nodes: list[NodeProcess] = []

    def factory(start: bool = True, **sections: dict[str, Any]) -> NodeProcess:
        merged: dict[str, dict[str, Any]] = {
            # The layout most tests are written for: two one-slot workers.
            "workers": {
                "engine": "test",
                "count": 2,
                "slots": 1,
                "threads": 1,
                "test_token_ms": 10,
            },
            "broker": dict(FAST_BROKER),
            # No rule worker unless a test asks for one: pool sizes stay the model's.
            "fallback": {"rules": ""},
            # The host's CPU pressure off unless a test asks for it: tests running
            # side by side on a loaded CI machine would otherwise send degrade
            # mode's requests to the rules (tests/system/test_cpu_pressure.py turns it on).
            "pressure": {"cpu_warn_pct": 0.0},
        }
        for name, values in sections.items():
            merged.setdefault(name, {}).update(values)
        node = NodeProcess(merged)
        nodes.append(node)
        return node.start() if start else node

    yield factory
    for node in nodes:
        node.cleanup()
