#!/usr/bin/env python3
"""Goodput under overload with the real model (a benchmark, not a test).

Starts a node (2 llama workers) and measures its service rate first (the 1x
baseline of this run), then offers 1x, 3x and 10x that rate, open-loop, for a
fixed time each. Prints per level: offered and served requests/s (goodput),
shed rate, shed-reply latency p99 and admitted queue-time p99; writes a PNG of
offered load vs goodput and shed rate (needs ``pip install -e '.[bench]'``).

Usage: ``python scripts/bench_load.py [--seconds 20] [--png docs/bench/load.png]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nodeproc import NodeProcess

PROMPT = "Q: Which room has the lights on?\nA:"
MAX_TOKENS = 16


def offer(endpoint: str, rate: float, seconds: float) -> list[dict[str, Any]]:
    """Open-loop load: send at ``rate``/s for ``seconds``, then wait for all replies."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sent: dict[str, float] = {}
    results: list[dict[str, Any]] = []

    def read(timeout_ms: int) -> None:
        if sock.poll(timeout_ms):
            body = msgpack.unpackb(sock.recv_multipart()[-1])
            if body["status"] != "partial":
                body["latency_ms"] = (time.monotonic() - sent[body["id"]]) * 1000
                results.append(body)

    start = time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        while time.monotonic() < start + n / rate:
            read(1)
        rid = f"r{n}"
        sent[rid] = time.monotonic()
        sock.send_multipart(
            [
                b"",
                b"EDGE/C1",
                msgpack.packb(
                    {
                        "id": rid,
                        "op": "generate",
                        "prompt": PROMPT,
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0.0,
                        "timeout_ms": 60_000,
                    }
                ),
            ]
        )
        n += 1
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + 120
    while len(results) < n and time.monotonic() < deadline:
        read(50)
    sock.close(0)
    for r in results:
        r["window_s"] = elapsed
    return results


def p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return round(ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else None


def summarize(level: str, rate: float, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == "ok"]
    shed = [r for r in results if r["status"] == "error"]
    window = results[0]["window_s"] if results else 1.0
    last_ok = max((r["latency_ms"] for r in ok), default=0.0) / 1000
    return {
        "level": level,
        "offered_rps": round(rate, 2),
        "goodput_rps": round(len(ok) / max(window, last_ok), 2),
        "shed_rate": round(len(shed) / max(1, len(results)), 3),
        "shed_p99_ms": p99([r["latency_ms"] for r in shed]),
        "queue_p99_ms": p99([float(r["queue_ms"]) for r in ok]),
        "sent": len(results),
        "shed_reasons": sorted({r.get("reason", "") for r in shed}),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    offered = [r["offered_rps"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(offered, [r["goodput_rps"] for r in rows], "o-", label="goodput (req/s)")
    ax.plot(offered, offered, ":", color="grey", label="offered = served")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("requests/s")
    ax2 = ax.twinx()
    ax2.plot(
        offered, [100 * r["shed_rate"] for r in rows], "s--", color="tab:red", label="shed (%)"
    )
    ax2.set_ylabel("shed (%)")
    ax2.set_ylim(0, 100)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    ax.set_title("edgenode, Gemma 3 270M, 2 workers: offered load vs goodput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--png", type=Path, default=Path("docs/bench/load.png"))
    args = parser.parse_args()
    node = NodeProcess({"workers": {"engine": "llama", "count": 2}, "broker": {"max_queue": 8}})
    node.start(timeout=120)
    try:
        # Baseline of this run: closed-loop service rate with both workers busy.
        warm = offer(node.frontend, 2.0, 5.0)
        service_s = (
            sorted(r["total_ms"] - r["queue_ms"] for r in warm if r["status"] == "ok")[
                len(warm) // 2
            ]
            / 1000
        )
        capacity = 2 / service_s
        rows = []
        for level, factor in (("1x", 1.0), ("3x", 3.0), ("10x", 10.0)):
            rate = capacity * factor
            rows.append(summarize(level, rate, offer(node.frontend, rate, args.seconds)))
    finally:
        node.cleanup()
    print(f"service time {service_s * 1000:.0f} ms per request -> capacity {capacity:.2f} req/s")
    print(
        f"{'load':<5} {'offered':>8} {'goodput':>8} {'shed':>6} {'shed p99 ms':>12} "
        f"{'queue p99 ms':>13}"
    )
    for r in rows:
        print(
            f"{r['level']:<5} {r['offered_rps']:>8} {r['goodput_rps']:>8} "
            f"{r['shed_rate']:>6} {r['shed_p99_ms'] or '-':>12} {r['queue_p99_ms'] or '-':>13}"
        )
    print(json.dumps(rows))
    try:
        plot(rows, args.png)
        print(f"plot: {args.png}")
    except ImportError:
        print("matplotlib not installed: pip install -e '.[bench]' for the plot")


if __name__ == "__main__":
    main()
