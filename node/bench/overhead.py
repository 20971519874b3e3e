"""Scenario ``broker``: what the node's broker costs per request, against a raw relay.

Both sides get the same closed-loop load from one DEALER (``load.closed_loop``) at 1 and
8 requests in flight, with the same worker layout (2 worker processes x 4 slots), the
same request (``generate``, ``max_tokens`` 1) and instant work:

* the node: ``engine = "test"`` with ``test_token_ms = 0`` (one token, no wait), no rule
  worker, CPU pressure off;
* the baseline: ``node.bench.relay``, a raw pyzmq ROUTER/ROUTER relay whose workers
  unpack the request and pack a reply.

Reported: req/s and RTT p50/p99 of each, and the node's req/s as a share of the relay's
(goal: >= 70 % at 8 in flight).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from node.bench.context import BenchContext
from node.bench.load import Run, closed_loop
from node.bench.report import Goal, Plot, Section, Series, Table, share
from node.bench.stats import percentile, ratio
from node.interpreter import module_command
from node.testing import DIE_WITH_HARNESS, NodeProcess

LEVELS = (1, 8)
WORKERS, SLOTS = 2, 4
REQUEST: dict[str, Any] = {"op": "generate", "prompt": "ping", "max_tokens": 1}
NODE: dict[str, dict[str, Any]] = {
    "workers": {
        "engine": "test",
        "count": WORKERS,
        "slots": SLOTS,
        "threads": 1,
        "test_token_ms": 0,
        "cpus": [],  # every core, as the relay has: not the default's reserved ones
    },
    "broker": {"max_in_flight_per_client": 64},
    "fallback": {"rules": ""},
    "pressure": {"cpu_warn_pct": 0.0},
}
#: The goal (issue 13): the node's req/s at 8 in flight, as a share of the relay's.
GOAL_SHARE = 0.70


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``."""
    return 2 + 2 * len(LEVELS)


class Relay:
    """The relay process (``node.bench.relay``) in a private directory, while in a ``with``."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="en-relay-"))
        self.frontend = f"ipc://{self.dir}/front.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Relay:
        argv = [sys.executable, "-c", DIE_WITH_HARNESS, str(os.getpid())]
        argv += module_command("node.bench.relay", self.frontend, f"ipc://{self.dir}/back.sock")
        argv += ["--workers", str(WORKERS), "--slots", str(SLOTS)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the raw relay did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def summary(run: Run) -> dict[str, Any]:
    """req/s (``Run.served_per_s``), RTT p50/p99 (ms), replies not ``ok`` and lost."""
    rtts = [r.rtt_ms for r in run.replies]
    served = sum(1 for r in run.replies if r.ok)
    return {
        "req_per_s": run.served_per_s(),
        "rtt_p50_ms": percentile(rtts, 50) if rtts else None,
        "rtt_p99_ms": percentile(rtts, 99) if rtts else None,
        "requests": run.sent,
        "not_ok": len(run.replies) - served,
        "lost": run.lost,
    }


def run(ctx: BenchContext) -> Section:
    """Measure the node and the relay at each level of ``LEVELS``; see the module."""
    seconds = ctx.pick(2.0, 10.0)
    warm = ctx.pick(0.5, 2.0)
    results: dict[str, dict[int, dict[str, Any]]] = {"node": {}, "relay": {}}
    ctx.step("broker: starting the node")
    node = NodeProcess(NODE)
    try:
        node.start(timeout=120)
        closed_loop(node.frontend, True, REQUEST, 8, warm)
        for level in LEVELS:
            ctx.step(f"broker: node, {level} in flight")
            results["node"][level] = summary(
                closed_loop(node.frontend, True, REQUEST, level, seconds)
            )
    finally:
        node.cleanup()
    ctx.step("broker: starting the raw relay")
    with Relay() as relay:
        closed_loop(relay.frontend, False, REQUEST, 8, warm)
        for level in LEVELS:
            ctx.step(f"broker: raw relay, {level} in flight")
            results["relay"][level] = summary(
                closed_loop(relay.frontend, False, REQUEST, level, seconds)
            )
    return section(results, seconds)


#: The columns of ``section``'s table, one row per level in flight.
HEADERS = (
    "in flight",
    "node req/s",
    "raw relay req/s",
    "node / relay",
    "node RTT p50 ms",
    "relay RTT p50 ms",
    "node RTT p99 ms",
    "relay RTT p99 ms",
    "node lost or not ok",
)


def section(results: dict[str, dict[int, dict[str, Any]]], seconds: float) -> Section:
    """The report of ``run``'s measurements."""
    shares = {
        lv: ratio(results["node"][lv]["req_per_s"], results["relay"][lv]["req_per_s"])
        for lv in LEVELS
    }
    text = (
        f"Closed loop from one DEALER for {seconds:.0f} s per level; {WORKERS} workers x "
        f"{SLOTS} slots on both sides; the node runs the test engine with no token delay, "
        "the baseline is a raw pyzmq ROUTER/ROUTER relay (`node.bench.relay`)."
    )
    top = shares[max(LEVELS)]
    goal = Goal(
        "broker req/s at 8 in flight, share of the raw relay",
        None if top is None else 100 * top,
        100 * GOAL_SHARE,
        ">=",
        " %",
    )
    data = {
        "seconds": seconds,
        "node": results["node"],
        "relay": results["relay"],
        "share": shares,
    }
    table = Table(HEADERS, [_row(lv, results, shares[lv]) for lv in LEVELS])
    return Section("broker", "Broker overhead", text, [table], [goal], [_plot(results)], data)


def _row(
    level: int, results: dict[str, dict[int, dict[str, Any]]], node_share: float | None
) -> tuple[Any, ...]:
    """``HEADERS``' row of one level in flight (``node_share``: node / relay req/s)."""
    n, r = results["node"][level], results["relay"][level]
    return (
        level,
        n["req_per_s"],
        r["req_per_s"],
        share(node_share),
        n["rtt_p50_ms"],
        r["rtt_p50_ms"],
        n["rtt_p99_ms"],
        r["rtt_p99_ms"],
        n["lost"] + n["not_ok"],
    )


def _plot(results: dict[str, dict[int, dict[str, Any]]]) -> Plot:
    """req/s over the levels in flight, the node's beside the raw relay's."""
    return Plot(
        "broker",
        "broker overhead: node vs raw relay",
        "requests in flight",
        "req/s",
        [
            Series("node", list(LEVELS), [results["node"][lv]["req_per_s"] for lv in LEVELS]),
            Series("raw relay", list(LEVELS), [results["relay"][lv]["req_per_s"] for lv in LEVELS]),
        ],
    )
