"""``/metrics`` of a node running the real model: token counts match the replies'
usage, every streamed token after the first is one inter-token gap, and the model
worker's cgroup memory is exported against its limit."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.testing import NodeProcess, free_port, wait_for

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        text = page.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.timeout(240)
def test_real_model_metrics(make_node: NodeFactory) -> None:
    port = free_port()
    node = make_node(
        start=False,
        workers={"engine": "llama", "count": 1},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
        metrics={"listen": f"127.0.0.1:{port}"},
    )
    # A loaded machine can take a while to load the model: as test_real_model.py does.
    started = node.cli("start", "--wait-s", "120", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    llm = frozenset({("engine", "llm")})
    with node.client() as c:
        stream = c.stream_chat(
            [{"role": "user", "content": "Count from one to five."}],
            max_tokens=16,
            temperature=0.0,
        )
        pieces = list(stream)
        assert stream.result is not None
        usage = stream.result.usage
    expected = {
        ("edgenode_prompt_tokens_total", llm): usage["prompt_tokens"],
        ("edgenode_generation_tokens_total", llm): usage["completion_tokens"],
        ("edgenode_time_to_first_token_seconds_count", llm): 1,
        # One PARTIAL per token: a gap between each two.
        ("edgenode_inter_token_seconds_count", llm): len(pieces) - 1,
    }
    # The loop hands a turn's observations to the metrics before it sends the FINAL
    # (tests/integration/test_loop_flush.py): one scrape after it sees them all.
    got = scrape(port)
    seen = {key: got.get(key) for key in expected}
    assert seen == expected
    ttft = got[("edgenode_time_to_first_token_seconds_sum", llm)]
    assert 0 < ttft <= stream.result.total_ms / 1000
    worker = frozenset({("worker", "llm-0"), ("engine", "llm")})
    memory = wait_for(lambda: scrape(port).get(("edgenode_worker_memory_bytes", worker)))
    limit = scrape(port).get(("edgenode_worker_memory_limit_bytes", worker))
    if limit is not None:
        assert 0 < memory <= limit
    # The model's weights are mapped into the worker: tens of MiB at least.
    assert memory > 10 * 2**20
    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    # The port is free again once the node stopped.
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port)):
        pass
