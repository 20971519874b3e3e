"""The whole path with the real model: CLI -> broker -> llama.cpp workers -> client."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from node.testing import NodeProcess, leftover_processes

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]


def on_topic(text: str) -> bool:
    """Whether a greedy continuation of "The capital of France is" stays on it. The
    exact words change with the CPU's kernels: " Paris..." on one machine, " the
    capital of the French Republic." on an AMD EPYC with AVX-512 (its CI run)."""
    return any(word in text.lower() for word in ("paris", "france", "french"))


def test_real_model_answers_through_the_whole_path(make_node: NodeFactory) -> None:
    node = make_node(
        start=False,
        workers={"engine": "llama", "count": 2},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
    )
    started = node.cli("start", "--wait-s", "120", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    try:
        status = node.status()
        assert [w["state"] for w in status["workers"]] == ["ready", "ready"]
        assert all(w["model"].endswith(".gguf") and w["n_ctx"] == 2048 for w in status["workers"])

        # Greedy: at the default temperature a third of the answers name no colour.
        answer = node.cli(
            "ask", "Name three primary colors.", "--max-tokens", "40", "--temperature", "0",
            "--no-cache-prompt", timeout=120,
        )  # fmt: skip
        assert answer.returncode == 0, answer.stderr
        text = answer.stdout.strip().lower()
        assert len(text) > 10
        assert any(color in text for color in ("red", "blue", "yellow", "green"))
        assert "completion tokens" in answer.stderr and "(0 cached)" in answer.stderr

        with node.client() as c:
            stream = c.stream_chat(
                [{"role": "user", "content": "Count from one to five."}],
                max_tokens=24,
                temperature=0.0,
            )
            pieces = list(stream)
            assert stream.result is not None
            assert len(pieces) >= 3  # tokens arrived one by one, not as one block
            assert "".join(pieces) == stream.result.text
            usage = stream.result.usage
            assert usage["prompt_tokens"] > 5 and usage["completion_tokens"] >= len(pieces)
            reply = c.generate("The capital of France is", max_tokens=8, temperature=0.0)
            assert on_topic(reply.text)  # a base model continues the sentence
            assert (reply.finish_reason, reply.usage["completion_tokens"]) == ("length", 8)
            assert reply.served_by == "llm" and reply.ttft_ms <= reply.total_ms
            # The field reaches the engine: the whole prompt evaluated, nothing reused
            # (that it then repeats its text: tests/system/test_slots.py).
            whole = c.generate(
                "The capital of France is", max_tokens=8, temperature=0.0, cache_prompt=False
            )
            assert whole.usage["cached_tokens"] == 0 and on_topic(whole.text)
    finally:
        stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert leftover_processes(node.run_dir) == []


def test_a_q8_0_kv_cache_node_answers_within_its_plan(make_node: NodeFactory) -> None:
    # A quantized V cache needs flash attention: without it llama.cpp refuses the
    # context and the worker never becomes ready.
    node = make_node(
        start=False,
        workers={"engine": "llama", "count": 1},
        model={"kv_type": "q8_0"},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
    )
    node.start(timeout=50)
    status = node.status()
    plan = status["capacity"]
    assert plan["per_worker"] - plan["grammar"] < 150 * 2**20  # f16's plan is 156 MiB
    with node.client() as c:
        reply = c.generate("The capital of France is", max_tokens=6, temperature=0.0)
    assert reply.served_by == "llm" and reply.usage["completion_tokens"] == 6
    assert node.stop() == 0
