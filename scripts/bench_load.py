#!/usr/bin/env python3
"""A burst of long prompts with the real model (a benchmark, not a test). The overload
curve this script measured too is ``edgenode bench --only overload`` now
(``node.bench.overload``).

For each admission estimate (``broker.service_estimate``: ``mean``,
the one mean service time per engine, vs ``size``, per request from its prompt
tokens and ``max_tokens``), starts a node, warms it up on long and short
prompts with both workers busy, then sends 4 short and 12 long prompts at once, all with the same
budget: the long prompt's service time measured in this run x 2.5 plus the
short ones' share, so two workers can finish only about 4 of the long ones.
Every prompt starts with its own id: llama-cpp-python would otherwise reuse
the previous prompt's KV cache and make repeated prompts nearly free.
Prints, per estimate, how many were admitted, how many of those still ended
in 504 (admitted but doomed: model time nobody could use), refused at once
(503 ``deadline_unmeetable``) and served, the long prompts' service time in
the burst, and the first refusal's message (the estimate's numbers).

Usage: ``python scripts/bench_load.py [--estimates mean,size]`` (``default`` as an estimate
leaves the setting unset: the broker's own default, for runs of older code).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import msgpack
import zmq

from node.bench.context import list_type
from node.bench.stats import median
from node.testing import NodeProcess

PROMPT = "Q: Which room has the lights on?\nA:"
MAX_TOKENS = 16
#: ~450 tokens of the default model's vocabulary (measured: 452).
LONG_PROMPT = (
    "The kitchen sensor reported a temperature of 23 degrees while the hallway light stayed on. "
    * 25
    + "\nQ: Which room has the lights on?\nA:"
)
MODEL_ONLY = {
    # The layout of the README's table: two one-slot workers of one thread, one per core.
    "workers": {"engine": "llama", "count": 2, "slots": 1, "threads": 1, "cpus": []},
    "routing": {"mode": "full"},  # degrade mode's rules would answer in ~2 ms
    "fallback": {"rules": ""},
}


def request(rid: str, prompt: str, timeout_ms: int = 60_000) -> list[bytes]:
    """The frames of one greedy ``generate`` request."""
    body = {
        "id": rid,
        "op": "generate",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "timeout_ms": timeout_ms,
    }
    return [b"", b"EDGE/C1", msgpack.packb(body)]


def at_once(endpoint: str, batch: list[tuple[str, str]], timeout_ms: int) -> list[dict[str, Any]]:
    """Send every ``(id, prompt)`` of ``batch`` at once; return the final replies."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    for rid, prompt in batch:
        sock.send_multipart(request(rid, prompt, timeout_ms))
    finals: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_ms / 1000 + 120
    while len(finals) < len(batch) and time.monotonic() < deadline:
        if sock.poll(100):
            body = msgpack.unpackb(sock.recv_multipart()[-1])
            if body["status"] != "partial":
                finals.append(body)
    sock.close(0)
    return finals


def unique(rid: str, prompt: str) -> tuple[str, str]:
    """``(rid, prompt)`` with the prompt made unique from its first token on:
    llama-cpp-python reuses the KV cache of a prefix shared with the previous
    prompt on the same worker, which would make repeated prompts nearly free."""
    return rid, f"[{rid}] {prompt}"


def service_ms(reply: dict[str, Any]) -> int:
    """Dispatch to final reply (ms) of an ``ok`` reply."""
    assert reply["status"] == "ok", reply
    return int(reply["total_ms"] - reply["queue_ms"])


def burst(estimate: str, budget_ms: int | None) -> dict[str, Any]:
    """One node with ``estimate``: warm-up, then 4 short + 12 long prompts at once.

    ``budget_ms`` None: derive it from this node's warm-up (the first node of
    the run), so every estimate faces the same budget.
    """
    broker: dict[str, Any] = {"max_queue": 32, "max_in_flight_per_client": 100}
    if estimate != "default":
        broker["service_estimate"] = estimate
    node = NodeProcess({**MODEL_ONLY, "broker": broker})
    node.start(timeout=120)
    try:
        # Each worker's first request is slow (weights paged in): not a measurement.
        at_once(node.frontend, [unique("cold-0", PROMPT), unique("cold-1", PROMPT)], 60_000)
        # Learn both sizes with both workers busy, as in the burst (on 2 cores the
        # workers slow each other down): long prompts in pairs, then short ones.
        long_ms = []
        for i in range(2):
            pair = [unique(f"w-long-{i}{j}", LONG_PROMPT) for j in "ab"]
            long_ms += map(service_ms, at_once(node.frontend, pair, 60_000))
        shorts = [unique(f"w-short-{i}", PROMPT) for i in range(6)]
        short_ms = [service_ms(r) for r in at_once(node.frontend, shorts, 60_000)]
        if budget_ms is None:
            # 4 short ones on 2 workers, then 2.5 rounds of 2 long ones: ~4 long fit.
            budget_ms = int(2 * median(short_ms) + 2.5 * median(long_ms))
        batch = [unique(f"short-{i}", PROMPT) for i in range(4)]
        batch += [unique(f"long-{i}", LONG_PROMPT) for i in range(12)]
        finals = at_once(node.frontend, batch, budget_ms)
        counters = node.status()["counters"]
    finally:
        node.cleanup()
    refused = [r for r in finals if r.get("reason") == "deadline_unmeetable"]
    admitted = [r for r in finals if r not in refused]
    missed = [r for r in admitted if r["status"] == "error" and r["code"] == 504]
    ok = [r for r in admitted if r["status"] == "ok"]
    ok_long = [r for r in ok if r["id"].startswith("long")]
    return {
        "estimate": estimate,
        "budget_ms": budget_ms,
        "short_ms": int(median(short_ms)),
        "long_ms": int(median(long_ms)),
        "burst_long_ms": int(median(map(service_ms, ok_long))) if ok_long else None,
        "refusal": refused[0]["message"] if refused else "",
        "sent": len(batch),
        "answered": len(finals),
        "admitted": len(admitted),
        "admitted_504": len(missed),
        "admitted_504_share": round(len(missed) / max(1, len(admitted)), 3),
        "refused_503": len(refused),
        "ok": len(ok),
        "ok_long": len(ok_long),
        "other_errors": sorted(
            {r.get("reason", r["code"]) for r in admitted if r not in ok + missed}
        ),
        "deadline_exceeded_counter": counters.get("deadline_exceeded", 0),
    }


def print_burst(rows: list[dict[str, Any]]) -> None:
    first = rows[0]
    print(
        f"long-prompt burst: 4 short + 12 long prompts at once, budget {first['budget_ms']} ms "
        f"(service measured: short {first['short_ms']} ms, long {first['long_ms']} ms)"
    )
    print(
        f"{'estimate':<9} {'admitted':>8} {'504':>4} {'504 share':>10} {'503 now':>8} "
        f"{'ok':>4} {'ok long':>8} {'long ms in burst':>17}"
    )
    for r in rows:
        print(
            f"{r['estimate']:<9} {r['admitted']:>8} {r['admitted_504']:>4} "
            f"{r['admitted_504_share']:>10} {r['refused_503']:>8} {r['ok']:>4} "
            f"{r['ok_long']:>8} {r['burst_long_ms'] or '-':>17}"
        )
    for r in rows:
        if r["refusal"]:
            print(f"{r['estimate']}: first refusal: {r['refusal']}")
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--estimates", type=list_type("estimate", str), default=["mean", "size"])
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for estimate in args.estimates:
        rows.append(burst(estimate, rows[0]["budget_ms"] if rows else None))
    print_burst(rows)


if __name__ == "__main__":
    main()
