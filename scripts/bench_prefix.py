#!/usr/bin/env python3
"""Prompt prefix reuse through the node: the time to the first token of requests
that share a fixed ~300-token system prompt (a benchmark, not a test).

Starts a node (the default model, ``--layout`` workers x slots, ``--threads``
per worker, mode ``full``, no rule worker) and sends, one after another:

* ``shared``: the same system prompt before a different short question each
  time: the first request evaluates the whole prompt; later ones find it in
  their slot's KV cache (``usage.cached_tokens``) and evaluate only the question;
* ``unshared`` (the baseline, interleaved with ``shared``): the same prompts
  with a different first word each time, so no slot holds any of their prefix.

It reports the first request's TTFT, the median and p90 of the later ones and
their ratio to the first (the target: at most 20 %), next to the
baseline. With several model workers the broker does not yet route by prefix,
so a later request may land on a worker that has not seen the prompt: run it
with one worker (``--layout 1x4``) to measure the slot's reuse.

Usage: ``python scripts/bench_prefix.py [--layout 1x4] [--threads 2] [--requests 12]``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from node.bench.stats import percentile
from node.testing import NodeProcess

SYSTEM = (
    "You are the voice assistant of a greenhouse controller. The greenhouse has four zones: "
    "tomatoes, peppers, herbs and seedlings. Each zone has a temperature sensor, a humidity "
    "sensor, a soil moisture probe, a vent motor and a drip valve. Keep temperatures between "
    "18 and 27 degrees Celsius, humidity between 50 and 75 percent, and water a zone when its "
    "soil moisture drops below 30 percent, for at most ten minutes at a time. Never open the "
    "vents while it rains. Answer in one short sentence, name the zone you act on, and say "
    "which device you use. If a request is unsafe or unclear, say so and do nothing. "
) * 2
QUESTIONS = [
    "The tomato zone reads 31 degrees. What do you do?",
    "Soil moisture in the herbs zone is 22 percent.",
    "It is raining and the pepper zone is hot.",
    "Humidity in the seedlings zone is 85 percent.",
    "Should I water the tomatoes now?",
    "The vent motor of zone two is stuck.",
    "What is the temperature range you keep?",
    "Turn everything off for the night.",
]


def ttft_ms(node: NodeProcess, prompt: str) -> tuple[int, int]:
    """(TTFT in ms, prompt tokens the slot reused) of one greedy request."""
    with node.client() as client:
        reply = client.generate(prompt, max_tokens=8, temperature=0.0)
    return reply.ttft_ms, int(reply.usage.get("cached_tokens", 0))


def run(node: NodeProcess, requests: int) -> dict[str, Any]:
    """Shared and unshared requests alternating; their TTFTs and reuse."""
    shared: list[tuple[int, int]] = []
    unshared: list[tuple[int, int]] = []
    for i in range(requests):
        question = QUESTIONS[i % len(QUESTIONS)]
        shared.append(ttft_ms(node, f"{SYSTEM}\nQ: {question}\nA:"))
        unshared.append(ttft_ms(node, f"Request {i}. {SYSTEM}\nQ: {question}\nA:"))
    return {"shared": shared, "unshared": unshared}


def summary(samples: list[tuple[int, int]]) -> dict[str, float]:
    """First TTFT, the later ones' median and p90 (nearest rank), and their ratios."""
    first, later = samples[0][0], sorted(t for t, _ in samples[1:])
    median = percentile(later, 50)
    p90 = percentile(later, 90)
    return {
        "first_ms": first,
        "later_median_ms": median,
        "later_p90_ms": p90,
        "median_ratio": median / first,
        "p90_ratio": p90 / first,
        "later_cached_tokens_median": percentile((c for _, c in samples[1:]), 50),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="1x4", help="workers x slots (default 1x4)")
    parser.add_argument("--threads", type=int, default=2, help="threads per worker")
    parser.add_argument("--requests", type=int, default=12, help="requests of each kind")
    args = parser.parse_args()
    workers, slots = (int(n) for n in args.layout.split("x"))
    node = NodeProcess(
        {
            "workers": {
                "engine": "llama",
                "count": workers,
                "slots": slots,
                "threads": args.threads,
            },
            "routing": {"mode": "full"},
            "fallback": {"rules": ""},
        }
    )
    try:
        node.start(timeout=120)
        result = run(node, args.requests)
    finally:
        node.cleanup()
    table = {kind: summary(samples) for kind, samples in result.items()}
    print(f"layout {args.layout}, {args.threads} thread(s) per worker, {args.requests} requests")
    print("| prompts | first TTFT | later TTFT median (p90) | later / first | reused tokens |")
    print("|---|---|---|---|---|")
    for kind, s in table.items():
        print(
            f"| {kind} | {s['first_ms']:.0f} ms | {s['later_median_ms']:.0f} ms "
            f"({s['later_p90_ms']:.0f}) | {s['median_ratio']:.0%} ({s['p90_ratio']:.0%}) "
            f"| {s['later_cached_tokens_median']:.0f} |"
        )
    print(json.dumps({"summary": table, "raw": result}))


if __name__ == "__main__":
    main()
