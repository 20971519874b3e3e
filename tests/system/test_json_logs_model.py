"""JSON logs with the real model: a streamed request is followed by its id from the
broker's log into its llama.cpp worker's log (tests/integration/test_json_logs_node.py
does the same, and the events, with the test engine)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest

from node.testing import NodeProcess, grep_json, wait_for

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

NodeFactory = Callable[..., NodeProcess]


def test_a_streamed_model_request_is_followed_by_its_id(make_node: NodeFactory) -> None:
    node = make_node(
        start=False,
        # A loaded 2-core machine can take over a minute to load the model.
        workers={"engine": "llama", "count": 1, "slots": 2, "ready_timeout_ms": 200_000},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
        node={"log_level": "debug"},
        logging={"format": "json"},
    ).start(timeout=220)
    request_id = f"model-{uuid.uuid4().hex}"
    with node.client(wait_ms=60_000) as c:
        stream = c.stream_generate("The capital of France is", id=request_id, max_tokens=6)
        pieces = list(stream)
    assert stream.result is not None and pieces

    def replied() -> list[dict[str, Any]] | None:
        lines = grep_json(node.log, request_id)
        return lines if lines and lines[-1].get("step") == "replied" else None

    in_broker: list[dict[str, Any]] = wait_for(replied, timeout=10)
    in_worker = grep_json(node.run_dir / "logs" / "llm-0.log", request_id)
    assert [line["step"] for line in in_broker] == [
        "admitted",
        "dispatched",
        "worker_final",
        "replied",
    ]
    assert [line["step"] for line in in_worker] == ["started", "final"]
    for line in in_broker + in_worker:
        assert line["request_id"] == request_id
    assert {line["role"] for line in in_worker} == {"llm-0"}
    assert in_worker[-1]["status"] == in_broker[-1]["status"] == "ok"
    # No line carries the output the client streamed.
    text = "".join(pieces).strip()
    assert all(text not in line["msg"] for line in in_broker + in_worker)
