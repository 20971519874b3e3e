#!/usr/bin/env python3
"""Benchmark shadow mode with the real model (not a test): does it delay the rules?

Two nodes run side by side, each with the real model (2 llama workers) and the rule worker:

* **off** (the baseline): mode ``degrade``, requests sent with ``route: "rules"``, so the
  model never runs (it sits idle, as on a device without the model);
* **shadow**: mode ``shadow``, requests sent with ``route: "auto"``: the rules answer and the
  model gets a copy whenever it has free credit, so it computes most of the time.

The same intent requests (a chat with ``INTENT_PROMPT`` and ``json_schema=INTENT_SCHEMA``,
as a device would send them) go to one node, then the other, in alternating blocks with a
fixed gap between requests, so that drift in the host's load hits both alike; the shadow
node's copies drain before each baseline block. Latency is the client's: send to final
reply. The script prints p50/p99 of each and the ratio of the p99s, then runs the fixed
command list in ``dual`` mode on a third node and prints the agreement from the migration
log, through ``node.migration.report`` like ``edgenode report``.

Usage: ``python scripts/bench_shadow.py [--requests 1000] [--blocks 20] [--gap-ms 20]
[--workers 2] [--cpus 1] [--nice 10]``.
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from broker.client import Client
from fallback.intents import EVAL_COMMANDS, INTENT_PROMPT, INTENT_SCHEMA
from node.bench.stats import percentile
from node.migration.report import summarize
from node.migration.report_view import format_report
from node.testing import NodeProcess

COMMANDS = EVAL_COMMANDS
WARMUP = 20


def start(mode: str, workers: dict[str, Any]) -> NodeProcess:
    node = NodeProcess(
        {
            "workers": {"engine": "llama", **workers},
            "fallback": {"rules": "default"},
            "routing": {"mode": mode},
        }
    )
    return node.start(timeout=120)


def intent(**fields: Any) -> dict[str, Any]:
    """The fields of an intent request besides its messages (for ``Client.chat``)."""
    return {
        "json_schema": INTENT_SCHEMA,
        "max_tokens": 48,
        "temperature": 0.0,
        **fields,
    }


def messages(command: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": INTENT_PROMPT}, {"role": "user", "content": command}]


def block(
    client: Client, route: str, n: int, gap_s: float, offset: int
) -> tuple[list[float], list[float]]:
    """``n`` requests one after the other, ``gap_s`` apart: latencies in ms seen by the
    client (send to reply) and by the broker (``total_ms``: accepted to answered)."""
    seen, inside = [], []
    for i in range(n):
        command = COMMANDS[(offset + i) % len(COMMANDS)]
        started = time.perf_counter()
        reply = client.chat(messages(command), **intent(route=route))
        seen.append((time.perf_counter() - started) * 1000)
        inside.append(float(reply.total_ms))
        if reply.served_by != "rules" or reply.degraded:
            raise RuntimeError(f"expected a rules answer, got {reply.raw}")
        time.sleep(gap_s)
    return seen, inside


def drained(node: NodeProcess, timeout_s: float = 120) -> None:
    """Wait until the node's model copies are done (nothing pending, all credit back)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = node.status()
        if s["routing"]["pairs_pending"] == 0 and s["in_flight"] == 0 and not s["queue_depth"]:
            return
        time.sleep(0.05)
    raise RuntimeError("model copies did not drain")


def latency_phase(
    requests: int, blocks: int, gap_s: float, workers: dict[str, Any]
) -> dict[str, Any]:
    off, shadow = start("degrade", workers), start("shadow", workers)
    lat: dict[str, list[float]] = {m: [] for m in ("off", "shadow", "off_broker", "shadow_broker")}
    try:
        with off.client() as c_off, shadow.client() as c_shadow:
            block(c_off, "rules", WARMUP, gap_s, 0)  # sockets, caches, first rule compile
            block(c_shadow, "auto", WARMUP, gap_s, 0)
            drained(shadow)
            per_block = max(1, requests // blocks)
            for b in range(blocks):
                for mode, client, route in (("off", c_off, "rules"), ("shadow", c_shadow, "auto")):
                    seen, inside = block(client, route, per_block, gap_s, b * per_block)
                    lat[mode] += seen
                    lat[f"{mode}_broker"] += inside
                drained(shadow)
        log = summarize([shadow.run_dir / "logs" / "migration.jsonl"])
    finally:
        off.cleanup()
        shadow.cleanup()
    shadow_log = log["by_mode"].get("shadow", {})
    return {
        "latency": lat,
        "copies_run": shadow_log.get("pairs", {}).get("count", 0),
        "copies_skipped": shadow_log.get("copy_skipped", {}).get("total", 0),
        "model_ms": shadow_log.get("latency_ms", {}).get("llm"),
    }


def dual_phase(workers: dict[str, Any]) -> tuple[dict[str, Any], str]:
    node = start("dual", workers)
    try:
        with node.client() as c:
            for command in COMMANDS:
                reply = c.chat(messages(command), **intent(timeout_ms=300_000))
                assert reply.served_by == "rules"
        log = node.run_dir / "logs" / "migration.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            summary = summarize([log])
            if summary["events"].get("pair", 0) >= len(COMMANDS):
                break
            time.sleep(0.2)
        pairs = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "pair"]
    finally:
        node.cleanup()
    for pair in pairs:
        verdict = "agree   " if (pair["agreement"] or {}).get("agree") else "DISAGREE"
        print(
            f"  {verdict} {pair['prompt']!r}: rules {pair['rules']['text']}, "
            f"model {pair['llm']['text']}"
        )
    return summary, format_report(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000, help="per mode")
    parser.add_argument("--blocks", type=int, default=20, help="alternations off/shadow")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="pause between requests")
    parser.add_argument("--workers", type=int, default=2, help="model workers per node")
    parser.add_argument(
        "--cpus",
        default="",
        help="cores reserved for the model workers, e.g. 1 (workers.cpus); default none: "
        "every core, as in the README's table",
    )
    parser.add_argument("--nice", type=int, default=10, help="model workers' nice (workers.nice)")
    args = parser.parse_args()
    # One-slot workers of one thread: the layout of the README's table.
    workers: dict[str, Any] = {"count": args.workers, "slots": 1, "threads": 1, "nice": args.nice}
    workers["cpus"] = [int(c) for c in args.cpus.split(",")] if args.cpus else []

    result = latency_phase(args.requests, args.blocks, args.gap_ms / 1000, workers)
    lat = result["latency"]
    print(f"model workers: {workers}")
    print(f"rules' answer latency, {len(lat['off'])} requests per mode")
    print(f"{'mode':<40} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    rows = {}
    for mode, label in (
        ("off", "off (degrade, route=rules), client"),
        ("shadow", "shadow (auto), client"),
        ("off_broker", "off, in the broker (total_ms)"),
        ("shadow_broker", "shadow, in the broker (total_ms)"),
    ):
        values = lat[mode]
        rows[mode] = {
            "n": len(values),
            "p50_ms": round(percentile(values, 50), 2),
            "p99_ms": round(percentile(values, 99), 2),
            "max_ms": round(max(values), 2),
        }
        r = rows[mode]
        print(f"{label:<40} {r['p50_ms']:>8} {r['p99_ms']:>8} {r['max_ms']:>8}")
    ratio = rows["shadow"]["p99_ms"] / rows["off"]["p99_ms"]
    print(f"p99 ratio shadow/off: {ratio:.2f}")
    model = result["model_ms"] or {}
    print(
        f"shadow copies: {result['copies_run']} run, {result['copies_skipped']} skipped "
        f"(model busy); model latency p50 {model.get('p50')} ms, p99 {model.get('p99')} ms"
    )

    print("\ndual mode, fixed command list:")
    summary, text = dual_phase(workers)
    dual = summary["by_mode"].get("dual", {}).get("pairs", {})
    print(text)
    print(
        json.dumps(
            {
                "workers": workers,
                "rules_latency_ms": rows,
                "p99_ratio_shadow_over_off": round(ratio, 3),
                "shadow_copies_run": result["copies_run"],
                "shadow_copies_skipped": result["copies_skipped"],
                "dual_agreement_pct": dual.get("agreement_pct"),
                "dual_agree": dual.get("agree"),
                "dual_compared": dual.get("compared"),
            }
        )
    )


if __name__ == "__main__":
    main()
