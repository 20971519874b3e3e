"""Dual mode with the real model: the rules answer, the model runs a copy of every request,
and the migration log shows how often the two agree on the default rule set.

The commands come from the default rule set's table (tests/unit/test_rules.py) and none of
them is a few-shot example of ``INTENT_PROMPT``. The default model is a 270M base model:
the test asserts that agreement is computed and reported, and that the model gets some
commands right, not a tuned agreement rate (measured here at temperature 0: 7 of these 10
agree exactly; "turn off", "unlock the back door" and "return to base" get a wrong intent).
``scripts/bench_shadow.py`` prints the same figure.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fallback.intents import EVAL_COMMANDS, INTENT_PROMPT, INTENT_SCHEMA
from node.testing import Collector, NodeProcess

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]

COMMANDS = EVAL_COMMANDS


def intent_request(rid: int, command: str) -> dict[str, Any]:
    """A chat request asking for the command's intent, as a device would send it."""
    return {
        "id": rid,
        "op": "chat",
        "messages": [
            {"role": "system", "content": INTENT_PROMPT},
            {"role": "user", "content": command},
        ],
        "json_schema": INTENT_SCHEMA,
        "max_tokens": 48,
        "temperature": 0.0,
        # Copies inherit the request's deadline: room for ten of them on a busy host.
        "timeout_ms": 150_000,
    }


def pair_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "pair"]


@pytest.mark.timeout(240)
def test_dual_mode_logs_agreement_with_the_real_model(make_node: NodeFactory) -> None:
    node = make_node(
        workers={"engine": "llama", "count": 2},
        broker={"heartbeat_interval_ms": 1000, "stall_timeout_ms": 15000},
        fallback={"rules": "default"},
        routing={"mode": "dual"},
    )
    col = Collector(node.frontend)
    try:
        for i, command in enumerate(COMMANDS):
            col.send(**intent_request(i, command))
        col.collect(timeout=10)  # the rules answer at once; the model runs behind
        col.assert_exactly_one_final_each()
    finally:
        col.close()
    for i in range(len(COMMANDS)):
        reply = col.final(i)
        assert (reply["status"], reply["served_by"], reply["degraded"]) == ("ok", "rules", False)
        assert reply["total_ms"] < 1000  # never waited for the model

    log = node.run_dir / "logs" / "migration.jsonl"
    deadline = time.monotonic() + 180
    while len(pair_records(log)) < len(COMMANDS) and time.monotonic() < deadline:
        time.sleep(0.2)
    pairs = pair_records(log)
    assert sorted(p["prompt"] for p in pairs) == sorted(COMMANDS)
    for pair in pairs:
        assert (pair["mode"], pair["schema"]) == ("dual", True)
        assert pair["rules"]["status"] == "ok" and pair["rules"]["rule"] is not None
        assert pair["llm"]["status"] == "ok", pair["llm"]
        assert pair["agreement"] is not None  # computed for every pair
        print(
            f"{'agree   ' if pair['agreement']['agree'] else 'DISAGREE'} {pair['prompt']!r}: "
            f"rules {pair['rules']['text']} model {pair['llm']['text']}"
        )

    result = node.cli("report", "--log", str(log))
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    line = re.search(r"^dual: ([0-9.]+)% agreement over (\d+) pairs", result.stdout, re.M)
    assert line is not None, result.stdout
    assert int(line.group(2)) == len(COMMANDS)
    summary = json.loads(node.cli("report", "--log", str(log), "--json").stdout)
    dual = summary["by_mode"]["dual"]["pairs"]
    assert dual["compared"] == len(COMMANDS)
    assert isinstance(dual["agreement_pct"], float)
    assert float(line.group(1)) == pytest.approx(dual["agreement_pct"], abs=0.05)
    assert dual["agree"] == sum(p["agreement"]["agree"] for p in pairs)
    assert dual["agree"] >= 3, dual  # a working model, not a tuned bar
    assert summary["by_mode"]["dual"]["latency_ms"]["llm"]["count"] == len(COMMANDS)
