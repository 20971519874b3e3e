#!/usr/bin/env python3
"""Benchmark deadlines and failure detection with the real model (not a test).

Starts a node (2 llama workers, production heartbeats: 1000 ms x 3) in a
temporary run dir and measures, from the client's side:

* deadline overshoot while decoding: reply time minus ``timeout_ms`` for
  requests that are generating tokens when their deadline falls;
* deadline overshoot while a ~700-token prompt is being evaluated, and how long
  the worker takes after the deadline to ack the cancel (abort callback);
* detection time of a busy worker killed with ``kill -9`` and stopped with
  ``SIGSTOP``: from the signal until the broker stops routing to it.

Usage: ``python scripts/bench_faults.py [--runs 20]``. Prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import threading
import time
from typing import Any

from broker.errors import DeadlineExceeded
from node.migration.report import percentile
from node.testing import NodeProcess

LONG_PROMPT = "The robot moved across the warehouse floor carefully. " * 78


def overshoot(node: NodeProcess, prompt: str, budget_ms: int) -> tuple[float, float]:
    """(reply overshoot ms, ms after the deadline until the worker is free again)."""
    with node.client() as c:
        start = time.monotonic()
        try:
            c.generate(prompt, max_tokens=512, timeout_ms=budget_ms)
            raise RuntimeError("the request finished before its deadline; raise max_tokens")
        except DeadlineExceeded:
            replied = time.monotonic()
        deadline = start + budget_ms / 1000
        while node.status()["credit"] < 2:
            time.sleep(0.005)
        freed = time.monotonic()
    return (replied - deadline) * 1000, (freed - deadline) * 1000


def detection(node: NodeProcess, sig: int) -> float:
    """ms from ``sig`` to a busy worker until the broker no longer lists it."""
    result: dict[str, Any] = {}

    def ask() -> None:
        with node.client() as c:
            try:
                result["reply"] = c.generate("Once upon a time", max_tokens=400, timeout_ms=60000)
            except Exception as exc:  # the benchmark only needs the timing
                result["error"] = exc

    thread = threading.Thread(target=ask)
    thread.start()
    while True:
        busy = [w for w in node.status()["workers"] if w["active"]]
        if busy:
            break
        time.sleep(0.005)
    pid = busy[0]["pid"]
    os.kill(pid, sig)
    sent = time.monotonic()
    while any(w["pid"] == pid for w in node.status()["workers"]):
        time.sleep(0.005)
    detected = (time.monotonic() - sent) * 1000
    thread.join(120)
    node.wait_ready(60)
    while node.status()["credit"] < 2:
        time.sleep(0.05)
    return detected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    random.seed(1)
    # The layout of the README's table: two one-slot workers of one thread.
    # CPU pressure off: in degrade mode it sends requests to the rules, which answer
    # before the poll sees a busy worker (the benchmark then waited forever).
    node = NodeProcess(
        {
            "workers": {"engine": "llama", "count": 2, "slots": 1, "threads": 1},
            "pressure": {"cpu_warn_pct": 0},
        }
    )
    node.start(timeout=120)
    try:
        decode = [
            overshoot(node, "Once upon a time", random.randint(300, 1500)) for _ in range(args.runs)
        ]
        prompt = [overshoot(node, LONG_PROMPT, random.randint(200, 1500)) for _ in range(args.runs)]
        kills = [detection(node, signal.SIGKILL) for _ in range(max(3, args.runs // 4))]
        stops = [detection(node, signal.SIGSTOP) for _ in range(max(3, args.runs // 4))]
    finally:
        node.cleanup()
    rows = {
        "deadline overshoot, decoding (reply)": [d[0] for d in decode],
        "deadline overshoot, prompt eval (reply)": [p[0] for p in prompt],
        "worker free after deadline, decoding": [d[1] for d in decode],
        "worker free after deadline, prompt eval": [p[1] for p in prompt],
        "detection, kill -9": kills,
        "detection, SIGSTOP (1000 ms x 3)": stops,
    }
    print(f"{'measure':<42} {'n':>3} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    summary = {}
    for name, values in rows.items():
        summary[name] = {
            "n": len(values),
            "p50_ms": round(statistics.median(values), 1),
            "p99_ms": round(percentile(values, 99), 1),
            "max_ms": round(max(values), 1),
        }
        s = summary[name]
        print(f"{name:<42} {s['n']:>3} {s['p50_ms']:>8} {s['p99_ms']:>8} {s['max_ms']:>8}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
