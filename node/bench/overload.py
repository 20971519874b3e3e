"""Scenario ``overload``: goodput, shed share and p99 from 0.5x to 10x capacity.

A node of 2 one-slot workers (``ctx.engine``; model only: ``routing.mode = "full"`` and
no rules, so every answer is the engine's; ``broker.max_queue = 8``). First its
saturation, the baseline of the run: the served req/s of a closed loop keeping every slot
busy and the queue full (``load.closed_loop``), where adding load no longer adds goodput
(only shed replies). Then,
open loop (``load.open_loop``), each factor of ``FACTORS`` x saturation for a fixed
time: offered and served req/s (goodput: ``load.Run.served_per_s``), shed share
(replies refused, any error), p99 of the shed replies' latency and of the served
requests' queue time and end-to-end time.

Goal (issue 13): goodput at 3x and 10x >= 95 % of the measured saturation.
"""

from __future__ import annotations

from typing import Any

from node.bench.context import BenchContext
from node.bench.load import Run, closed_loop, open_loop
from node.bench.report import Goal, Plot, Section, Series, Table, share
from node.bench.stats import p99, ratio
from node.testing import NodeProcess

FACTORS = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
QUICK_FACTORS = (0.5, 1.0, 3.0, 10.0)
GOAL_SHARE = 0.95
WORKERS = 2
MAX_QUEUE = 8
#: Saturation's closed loop: every slot busy and the queue full, none shed.
SATURATION_IN_FLIGHT = WORKERS + MAX_QUEUE
PROMPT = {
    "test": "Q: Which room has the lights on? A:",
    "llama": "Q: Which room has the lights on?\nA:",
}


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``."""
    return 2 + len(ctx.pick(QUICK_FACTORS, FACTORS))


def node_sections(ctx: BenchContext) -> dict[str, dict[str, Any]]:
    """The node of this scenario (module docstring)."""
    workers: dict[str, Any] = {"engine": ctx.engine, "count": WORKERS, "slots": 1, "threads": 1}
    if ctx.engine == "test":
        workers["test_token_ms"] = 10
    return {
        "workers": workers,
        "routing": {"mode": "full"},
        "fallback": {"rules": ""},
        "broker": {"max_queue": MAX_QUEUE, "max_in_flight_per_client": 10_000},
        "pressure": {"cpu_warn_pct": 0.0},
    }


def request(ctx: BenchContext) -> dict[str, Any]:
    """The request offered (greedy, 16 tokens, a 60 s budget)."""
    return {
        "op": "generate",
        "prompt": PROMPT[ctx.engine],
        "max_tokens": 16,
        "temperature": 0.0,
        "timeout_ms": 60_000,
    }


def summary(factor: float, rate: float, run: Run) -> dict[str, Any]:
    """One level's figures (module docstring)."""
    ok = [r for r in run.replies if r.ok]
    shed = [r for r in run.replies if not r.ok]
    return {
        "factor": factor,
        "offered_rps": rate,
        "goodput_rps": run.served_per_s(),
        "shed_share": len(shed) / max(1, len(run.replies)),
        "shed_p99_ms": p99(r.rtt_ms for r in shed),
        "queue_p99_ms": p99(float(r.body.get("queue_ms", 0)) for r in ok),
        "ok_p99_ms": p99(r.rtt_ms for r in ok),
        "sent": run.sent,
        "lost": run.lost,
        "shed_reasons": sorted({str(r.body.get("reason", r.body.get("code"))) for r in shed}),
    }


def run(ctx: BenchContext) -> Section:
    """Saturation, then every factor of it; see the module."""
    seconds = ctx.pick(5.0, 20.0)
    factors = ctx.pick(QUICK_FACTORS, FACTORS)
    body = request(ctx)
    ctx.step("overload: starting the node")
    node = NodeProcess(node_sections(ctx))
    try:
        node.start(timeout=180)
        ctx.step("overload: saturation")
        closed_loop(node.frontend, True, body, SATURATION_IN_FLIGHT, ctx.pick(1.0, 3.0))  # warm
        sat_run = closed_loop(node.frontend, True, body, SATURATION_IN_FLIGHT, seconds)
        saturation = sat_run.served_per_s()
        rows = []
        for f in factors:
            ctx.step(f"overload: {f:g}x saturation")
            rows.append(
                summary(f, f * saturation, open_loop(node.frontend, body, f * saturation, seconds))
            )
    finally:
        node.cleanup()
    return section(ctx, saturation, rows, seconds)


#: The columns of ``section``'s table, one row per load level.
HEADERS = (
    "load",
    "offered req/s",
    "goodput req/s",
    "goodput / saturation",
    "shed",
    "shed p99 ms",
    "queue p99 ms",
    "served p99 ms",
    "lost",
)


def section(
    ctx: BenchContext, saturation: float, rows: list[dict[str, Any]], seconds: float
) -> Section:
    """The report of ``run``'s measurements; adds each level's ``goodput_share`` (of
    ``saturation``) to its row in ``rows``."""
    for r in rows:
        r["goodput_share"] = ratio(r["goodput_rps"], saturation)
    table = Table(HEADERS, [_row(r) for r in rows])
    text = (
        f"Engine `{ctx.engine}`, {WORKERS} one-slot workers, `max_queue` {MAX_QUEUE}. "
        f"Saturation (closed loop, {SATURATION_IN_FLIGHT} in flight: every slot and the "
        f"queue): **{saturation:.2f} req/s**, the baseline of the goodput shares; each level "
        f"offered open loop for {seconds:.0f} s."
    )
    data = {"engine": ctx.engine, "saturation_rps": saturation, "seconds": seconds, "levels": rows}
    plot = _plot(ctx, saturation, rows)
    return Section("overload", "Overload curve", text, [table], _goals(rows), [plot], data)


def _row(r: dict[str, Any]) -> tuple[Any, ...]:
    """``HEADERS``' row of one load level."""
    return (
        f"{r['factor']:g}x",
        r["offered_rps"],
        r["goodput_rps"],
        share(r["goodput_share"]),
        share(r["shed_share"]),
        r["shed_p99_ms"],
        r["queue_p99_ms"],
        r["ok_p99_ms"],
        r["lost"],
    )


def _goals(rows: list[dict[str, Any]]) -> list[Goal]:
    """Goodput at 3x and 10x saturation, as a share of it (None: the level was not run)."""
    by_factor = {r["factor"]: r for r in rows}
    return [
        Goal(
            f"goodput at {f:g}x, share of saturation",
            100 * by_factor[f]["goodput_share"] if f in by_factor else None,
            100 * GOAL_SHARE,
            ">=",
            " %",
        )
        for f in (3.0, 10.0)
    ]


def _plot(ctx: BenchContext, saturation: float, rows: list[dict[str, Any]]) -> Plot:
    """Goodput and the shed share over the offered load (log x), beside saturation."""
    offered = [r["offered_rps"] for r in rows]
    return Plot(
        "overload",
        f"offered load vs goodput (engine {ctx.engine})",
        "offered load (req/s)",
        "req/s",
        [
            Series("goodput", offered, [r["goodput_rps"] for r in rows]),
            Series("saturation", offered, [saturation for _ in rows]),
            Series("shed (%)", offered, [100 * r["shed_share"] for r in rows], right=True),
        ],
        right_label="shed (%)",
        log_x=True,
    )
