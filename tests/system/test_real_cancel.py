"""Cancellation inside llama.cpp's prompt evaluation, with the real model."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from node.testing import NodeProcess

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]

#: ~700 tokens for Gemma 3's tokenizer (9 tokens per sentence); evaluating it
#: takes ~3.5 s on one core here, far longer than the deadline and the grace.
LONG_PROMPT = "The robot moved across the warehouse floor carefully. " * 78


def test_deadline_cancels_a_700_token_prompt_evaluation(make_node: NodeFactory) -> None:
    node = make_node(
        workers={"engine": "llama", "count": 1},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000, "cancel_grace_ms": 1500},
    )
    with node.client() as c:
        stream = c.stream_generate(LONG_PROMPT, max_tokens=4, timeout_ms=700)
        with pytest.raises(Exception) as info:
            list(stream)
        assert getattr(info.value, "code", None) == 504
        assert getattr(info.value, "partial_text", None) == ""  # no token existed yet
        # Had the abort callback not stopped the evaluation, the worker would
        # miss the 1.5 s ack grace and be killed as hung: it must instead
        # serve the next request as the same process.
        reply = c.generate("The capital of France is", max_tokens=6, temperature=0.0)
        assert reply.usage["completion_tokens"] == 6
    status = node.status()
    assert status["processes"][0]["restarts"] == 0
    assert status["counters"].get("workers_lost", 0) == 0
    log = (node.run_dir / "logs" / "llm-0.log").read_text()
    assert "cancelled during prompt evaluation" in log
