"""Shared fixtures: nodes started as real processes, cleaned up whatever happens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from node.testing import FAST_BROKER, NodeProcess


class StartedNodes:
    """``factory(workers={...}, broker={...})`` starts a node with the test engine, and
    ``cleanup()`` stops every node it started.

    Sections given replace keys of the defaults below; ``start=False`` returns
    the node unstarted (for CLI tests).
    """

    def __init__(self) -> None:
        self.nodes: list[NodeProcess] = []

    def __call__(self, start: bool = True, **sections: dict[str, Any]) -> NodeProcess:
        merged: dict[str, dict[str, Any]] = {
            # The layout most tests are written for: two one-slot workers.
            "workers": {
                "engine": "test",
                "count": 2,
                "slots": 1,
                "threads": 1,
                "test_token_ms": 10,
                # Every allowed core, as before "auto" reserved one for the host: the
                # suite's nodes test the broker, not placement (test_skeleton's
                # test_reserved_cores_keep_the_whole_node_off_the_hosts_cores does).
                "cpus": [],
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
        self.nodes.append(node)
        return node.start() if start else node

    def cleanup(self) -> None:
        """Stop every node started here: a test-engine node is only sent SIGTERM and left
        to ``STOPPING`` (it takes seconds to stop its workers, which the next test's start
        overlaps); a model node is stopped and removed at once (its memory is not shared
        with the next test's)."""
        for node in self.nodes:
            if node.sections.get("workers", {}).get("engine") == "test" and not node.stopped():
                node.begin_stop()
                STOPPING.append(node)
            else:
                node.cleanup()
        reap(STOPPING, keep=MAX_STOPPING)


#: Nodes sent SIGTERM by a test's teardown and not cleaned up yet (``reap``).
STOPPING: list[NodeProcess] = []
#: At most this many nodes stop in the background; past it, the oldest is waited for.
MAX_STOPPING = 2


def reap(stopping: list[NodeProcess], keep: int) -> None:
    """Clean up (``NodeProcess.cleanup``: wait, kill what is left, remove the run dir)
    each node of ``stopping`` that has exited, and the oldest ones until at most ``keep``
    are still stopping."""
    for node in [n for n in stopping if n.stopped()]:
        stopping.remove(node)
        node.cleanup()
    while len(stopping) > keep:
        stopping.pop(0).cleanup()


@pytest.fixture(scope="session", autouse=True)
def _reap_stopping_nodes() -> Iterator[None]:
    """Every node left stopping by a teardown is gone before the session ends."""
    yield
    reap(STOPPING, keep=0)


@pytest.fixture
def make_node() -> Iterator[Callable[..., NodeProcess]]:
    """A ``StartedNodes`` for one test: its nodes are stopped after the test."""
    factory = StartedNodes()
    try:
        yield factory
    finally:
        factory.cleanup()


@pytest.fixture(scope="module")
def make_module_node() -> Iterator[Callable[..., NodeProcess]]:
    """A ``StartedNodes`` whose nodes serve every test of one module, for a module-scoped
    fixture of tests that only send requests (a node start costs seconds). Such tests
    must leave the node as they found it: no stop, kill or reconfiguration, every
    request answered, and ids of their own."""
    factory = StartedNodes()
    try:
        yield factory
    finally:
        factory.cleanup()
