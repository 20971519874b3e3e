"""The README's client examples ("From an app", "asyncio", "The defensive client")
run as written against a real node (test engine): only the endpoint and the rules
path are this test's. The defensive client's breaker is the client's defaults
(``CLIENT_BREAKER``) with the one change the example makes."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from broker.client_guard import CLIENT_BREAKER
from node.testing import REPO, NodeProcess

NodeFactory = Callable[..., NodeProcess]

#: The endpoint and rules path the README's examples name.
README_ENDPOINT = "ipc:///tmp/edgenode-0/frontend.sock"
README_RULES = "/etc/edgenode/rules.toml"


def readme_examples() -> list[str]:
    """The README's Python blocks that connect a client to the README's endpoint."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return [b for b in blocks if README_ENDPOINT in b]


def run_example(block: str, node: NodeProcess) -> dict[str, Any]:
    code = block.replace(README_ENDPOINT, node.frontend).replace(
        README_RULES, str(REPO / "etc" / "rules.toml")
    )
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    return namespace


def test_the_client_examples_run_as_written(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1, "slots": 2})
    blocks = readme_examples()
    assert len(blocks) == 3, "the sync, asyncio and defensive client examples"
    sync, asyncio_example, defensive = blocks
    assert "reply" in run_example(sync, node)
    run_example(asyncio_example, node)
    made = run_example(defensive, node)
    client = made["node"]
    try:
        assert made["reply"].text
        # The example's breaker: the client's defaults, open_wait_ms changed.
        assert client.guard.breaker.settings == dataclasses.replace(
            CLIENT_BREAKER, open_wait_ms=5000
        )
    finally:
        client.close()
