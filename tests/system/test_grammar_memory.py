"""JSON-schema requests against workers whose cgroups have exactly the capacity plan's
memory.max, set by hand or by ``workers.memory_max = "auto"`` (real model, real cgroup, root).

The plan's grammar allowance (node.capacity.plan.grammar_allowance) must cover what the
largest schemas node.llama.grammar admits cost: each request here fills the context first,
so the KV cache and the attention scratch are touched, then generates under the grammar.
``scripts/bench_grammar.py`` measures the same cases with numbers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_cgroups import _skip_reason

from broker.errors import TooLarge
from fallback.intents import INTENT_PROMPT, INTENT_SCHEMA
from node.capacity.plan import config_plan
from node.config import from_dict
from node.llama.grammar import MAX_REPEAT, MAX_SCHEMA_DEPTH
from node.model import resolve_model
from node.sandbox.cgroupfs import read_int
from node.testing import NodeProcess

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]
MiB = 2**20
N_CTX = 2048
TOKENS = 176  # enough to reach the innermost of the deepest objects allowed


def deepest_objects() -> dict[str, Any]:
    """The most nested objects allowed, each with a short string to write first."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range((MAX_SCHEMA_DEPTH - 1) // 2):
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 4}, "child": schema},
            "required": ["name", "child"],
        }
    return schema


#: The longest string allowed: the model stays inside a string, where the grammar
#: admits almost every token, which is the sampler's costliest state.
LONGEST_STRING = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": MAX_REPEAT}},
    "required": ["text"],
}


@pytest.fixture(scope="module")
def usable() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def node_sections(memory_max: str | int, count: int = 1) -> dict[str, dict[str, Any]]:
    return {
        "workers": {
            "engine": "llama",
            "count": count,
            "sandbox": "required",
            "memory_max": memory_max,
        },
        "model": {"n_ctx": N_CTX},
        "broker": {"heartbeat_interval_ms": 1000, "stall_timeout_ms": 60_000},
        "breaker": {"slow_call_ms": 600_000},
    }


def fill_and_ask(node: NodeProcess, schema: dict[str, Any]) -> str:
    """A context-filling prompt, then ``TOKENS`` tokens under ``schema``; the text."""
    prompt = "robot " * (N_CTX - TOKENS - 96) + "\nAnswer in JSON:"  # a token per word
    with node.client(wait_ms=240_000) as c:
        reply = c.generate(
            prompt,
            json_schema=schema,
            max_tokens=TOKENS,
            temperature=0.0,
            route="llm",
            timeout_ms=240_000,
        )
    assert reply.served_by == "llm"
    return reply.text


@pytest.mark.timeout(420)
def test_a_worker_at_the_plans_memory_max_survives_the_largest_schemas(
    usable: None, make_node: NodeFactory
) -> None:
    plan, _ = config_plan(from_dict(node_sections("1G")))
    assert plan.grammar > 0  # the allowance is in the plan the limit comes from
    node = make_node(**node_sections(plan.memory_max))
    before = node.status()["processes"][0]
    assert before["memory"]["limit"] == plan.memory_max

    assert fill_and_ask(node, LONGEST_STRING).startswith('{"text":')
    assert fill_and_ask(node, deepest_objects()).startswith('{"name":')
    with pytest.raises(TooLarge, match="maxLength 3000"):  # refused, not a crash
        fill_and_ask(node, {"type": "string", "maxLength": 3000})

    after = node.status()["processes"][0]
    assert (after["pid"], after["restarts"], after["oom_kills"]) == (before["pid"], 0, 0)
    memory = after["memory"]
    assert memory["oom_kills"] == 0 and memory["limit"] == plan.memory_max
    assert memory["peak"] is None or memory["peak"] <= plan.memory_max
    assert Path(after["cgroup"]).name == "worker-llm-0"
    # The sampler's freed vectors went back to the system (node.llama.grammar.trim_heap):
    # what the worker keeps is about a plain request's, not that plus the grammar's.
    assert private_bytes(after["pid"], str(resolve_model("default"))) < (
        plan.per_worker - plan.grammar + 32 * MiB
    )


def private_bytes(pid: int, model: str) -> int:
    """Private memory of ``pid`` (``Private_Clean`` + ``Private_Dirty``) outside the
    model file's mapping: a lone worker is the only one mapping the weights, so
    they count as private then (the first version of this test measured them
    and passed only when another process happened to map the same file)."""
    total, in_model = 0, False
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                in_model = len(head) >= 6 and head[5] == model
            elif not in_model and head[:1] in (["Private_Clean:"], ["Private_Dirty:"]):
                total += int(head[1]) * 1024
    return total


@pytest.mark.timeout(420)
def test_auto_gives_the_workers_the_plans_limits_and_they_serve_schemas(
    usable: None, make_node: NodeFactory
) -> None:
    node = make_node(**node_sections("auto", count=2))
    status = node.status()
    plan = status["capacity"]
    limits = {"setting": "auto"} | {k: plan[k] for k in ("memory_max", "memory_high")}
    assert plan["worker_limits"] == limits
    printed = node.cli("capacity", "--json")  # what an operator checks before starting
    assert json.loads(printed.stdout)["worker_limits"] == limits, printed.stderr
    before = {p["worker_id"]: p for p in status["processes"]}
    assert sorted(before) == ["llm-0", "llm-1"]
    for proc in before.values():
        cgroup = Path(proc["cgroup"])
        limit = read_int(cgroup / "memory.limit_in_bytes") or read_int(cgroup / "memory.max")
        assert limit == plan["memory_max"]  # the kernel's own file, not just our status
        assert proc["memory"]["high"] == plan["memory_high"]

    with node.client(wait_ms=120_000) as c:
        plain = c.generate("The capital of France is", max_tokens=8, route="llm")
        intent = c.chat(
            [{"role": "system", "content": INTENT_PROMPT}, {"role": "user", "content": "lights"}],
            json_schema=INTENT_SCHEMA,
            max_tokens=48,
            temperature=0.0,
            route="llm",
        )
    assert plain.served_by == intent.served_by == "llm"
    assert "intent" in json.loads(intent.text)
    assert fill_and_ask(node, LONGEST_STRING).startswith('{"text":')

    after = {p["worker_id"]: p for p in node.status()["processes"]}
    for wid, proc in after.items():
        assert (proc["pid"], proc["restarts"], proc["oom_kills"]) == (before[wid]["pid"], 0, 0)
        assert proc["memory"]["limit"] == plan["memory_max"]
        assert proc["memory"]["peak"] is None or proc["memory"]["peak"] <= plan["memory_max"]
