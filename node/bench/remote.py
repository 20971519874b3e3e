"""Scenario ``remote``: tokens/s of one local worker plus one remote host agent,
against the local worker alone (issue 14, "Remote workers").

The allowed cores are split in two halves (at least one core each; fewer than two
cores skips the scenario). Two layouts are measured, one after the other, each
started, warmed up, measured and stopped:

* ``local alone``: a gateway node (``NodeProcess``, ``ctx.engine``) with one model
  worker of ``SLOTS`` slots on the first half (``workers.cpus``, threads = its cores),
  its backend on loopback TCP;
* ``local + remote agent``: the same gateway, plus a host agent
  (``edgenode worker --connect``, ``node.testing.AgentProcess``) started as a
  process of its own, in its own run dir and cgroups, whose one worker of
  ``SLOTS`` slots is reserved the second half: a second board on this machine.

Both are model only (``routing.mode = "full"``, no rules) and take the same load:
a closed loop keeping every slot of the layout busy (``SLOTS`` x workers
requests in flight) with one prompt, greedy, ``max_tokens`` each, for a fixed
window; tokens/s is the completion tokens of the ``ok`` replies over the time
to the last reply. The ratio of the two, in the same round, is the figure;
rounds are interleaved and the report takes the median. The remote share says
how many replies the agent's worker served (local-first dispatch gives it what
the local slots cannot take).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

from node.bench.context import BenchContext
from node.bench.load import Run, closed_loop
from node.bench.report import Goal, Section, Table
from node.bench.stats import median, ratio
from node.testing import AgentProcess, NodeProcess

#: Slots per worker, local and remote: continuous batching's gain is in both.
SLOTS = 2
AGENT = "bench-agent"
PROMPT = (
    "Once upon a time, in a small village at the edge of a dark forest, there lived an "
    "old clockmaker who kept a secret. Every night, when the village was asleep, he"
)
LAYOUTS = ("local alone", "local + remote agent")
#: Start budget of a node or agent (s): the model's first load pages its weights in.
START_S = 180.0
#: How long the closed loop waits for the requests still out after its window, s: a
#: 128-token request takes ~13 s on one core here (~10 tokens/s per slot with 2 slots),
#: and a 10 s drain counted the last ones as lost (4 in one round of the first full run).
DRAIN_S = 60.0


def window_s(ctx: BenchContext) -> float:
    """Seconds of closed-loop load per layout: 60 (quick: 15; the test engine, which
    only checks the machinery, 4)."""
    if ctx.quick and ctx.engine == "test":
        return 4.0
    return ctx.pick(15.0, 60.0)


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``: each layout once per round."""
    return len(LAYOUTS) * ctx.pick(1, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _workers(ctx: BenchContext, cpus: Sequence[int]) -> dict[str, Any]:
    """One worker of ``SLOTS`` slots reserved ``cpus``, at nice 0 (nothing else runs)."""
    return {
        "engine": ctx.engine,
        "count": 1,
        "slots": SLOTS,
        "threads": len(cpus),
        "cpus": list(cpus),
        "nice": 0,
        "test_token_ms": 20,
    }


def measure(
    ctx: BenchContext, local: Sequence[int], remote: Sequence[int] | None
) -> dict[str, Any]:
    """One layout's run: tokens/s, replies, the remote worker's share of them."""
    backend = f"tcp://127.0.0.1:{_free_port()}"
    node = NodeProcess(
        {
            "node": {"backend": backend},
            "workers": _workers(ctx, local),
            "routing": {"mode": "full"},
            "fallback": {"rules": ""},
            "broker": {"max_in_flight_per_client": 64},
            "pressure": {"cpu_warn_pct": 0.0},
        }
    )
    agent: AgentProcess | None = None
    try:
        # workers.cpus reserves each half; the broker joins its workers' (node.cpus = []).
        node.start(timeout=START_S)
        workers = 1
        if remote is not None:
            agent = AgentProcess(backend, AGENT, {"workers": _workers(ctx, remote)})
            agent.start()
            agent.registered(node, 1, timeout=START_S)
            workers = 2
        in_flight = SLOTS * workers
        body = {"op": "generate", "prompt": PROMPT, "temperature": 0.0}
        # Warm-up: every slot once (a worker's first request pages the weights in).
        closed_loop(node.frontend, True, {**body, "max_tokens": 8}, in_flight, 0.1)
        max_tokens = ctx.pick(32, 128)
        run = closed_loop(
            node.frontend,
            True,
            {**body, "max_tokens": max_tokens},
            in_flight,
            window_s(ctx),
            drain_s=DRAIN_S,
        )
        return summarize(run)
    finally:
        if agent is not None:
            agent.cleanup()
        node.cleanup()


def summarize(run: Run) -> dict[str, Any]:
    """Tokens/s over the time to the last reply, and who served the ``ok`` replies."""
    ok = [r.body for r in run.replies if r.ok]
    tokens = sum(int(b.get("usage", {}).get("completion_tokens", 0)) for b in ok)
    remote = sum(1 for b in ok if str(b.get("worker", "")).startswith(f"{AGENT}."))
    return {
        "tokens_per_s": tokens / run.elapsed_s if run.elapsed_s > 0 else 0.0,
        "tokens": tokens,
        "replies": len(ok),
        "errors": len(run.replies) - len(ok) + run.lost,
        "remote_share_pct": 100.0 * remote / len(ok) if ok else 0.0,
        "elapsed_s": run.elapsed_s,
    }


def run(ctx: BenchContext) -> Section:
    """Both layouts, ``rounds`` times interleaved; see the module."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return Section("remote", TITLE, skipped="needs at least 2 allowed cores (one per board)")
    half = len(cores) // 2
    local, remote = cores[:half], cores[half:]
    rounds = ctx.pick(1, 3)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    for i in range(rounds):
        for name in LAYOUTS:
            ctx.step(f"remote: {name} {i + 1}/{rounds}")
            results[name].append(measure(ctx, local, remote if name != LAYOUTS[0] else None))
    return section(ctx, results, local, remote)


TITLE = "Remote workers: a second board's agent beside the local worker"


def section(
    ctx: BenchContext,
    results: dict[str, list[dict[str, Any]]],
    local: Sequence[int],
    remote: Sequence[int],
) -> Section:
    """The report of ``run``'s measurements."""
    alone, both = (results[name] for name in LAYOUTS)
    ratios = [ratio(b["tokens_per_s"], a["tokens_per_s"]) for a, b in zip(alone, both, strict=True)]
    known = [r for r in ratios if r is not None]
    gain = median(known) if known else None
    rows: list[tuple[Any, ...]] = []
    for name, runs in results.items():
        rows.append(
            (
                name,
                len(runs),
                median(r["tokens_per_s"] for r in runs),
                sum(r["replies"] for r in runs),
                sum(r["errors"] for r in runs),
                median(r["remote_share_pct"] for r in runs),
            )
        )
    table = Table(
        ("layout", "rounds", "tokens/s (median)", "ok replies", "errors", "remote share %"), rows
    )
    text = (
        f"Engine {ctx.engine}; local worker on cores {','.join(map(str, local))}, the agent's "
        f"on {','.join(map(str, remote))} (its own run dir and cgroups), each 1 worker x "
        f"{SLOTS} slots, backend on loopback TCP; a closed loop keeps every slot busy. "
        "Gain: local + remote over local alone, same round, median over rounds."
    )
    goals = [
        Goal(
            "tokens/s, local + remote agent over local alone",
            None if gain is None else 100 * gain,
            150.0,
            ">=",
            " %",
        )
    ]
    data = {"runs": results, "ratios": ratios, "local_cpus": list(local)}
    data["remote_cpus"] = list(remote)
    return Section("remote", TITLE, text, [table], goals, [], data)
