"""Scenario ``startup``: start to ready, the node next to the model's own load time.

* the node: from launching ``edgenode start --foreground`` (``NodeProcess``, its built-in
  layout, ``ctx.engine``) until ``status`` says every worker is ready;
* ``direct``: from launching llama-cpp-python alone in a subprocess
  (``node.bench.backends.DirectBackend``) until its model is loaded (model engine only);
* ``llama-server`` (when given): from launching it until ``/health`` answers 200.

Each is started and stopped ``rounds`` times, one after another; the table shows the
median (nearest rank) and the worst. Goal (issue 13): the node within llama-server's time.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from node.bench.backends import Backend, DirectBackend, ServerBackend
from node.bench.context import BenchContext
from node.bench.report import Goal, Section, Table
from node.bench.stats import percentile, ratio
from node.model import resolve_model
from node.testing import NodeProcess


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``."""
    kinds = 1 + (ctx.engine == "llama") + (ctx.llama_server is not None)
    return kinds * ctx.pick(1, 3)


def time_node(ctx: BenchContext) -> float:
    """Seconds from launching a node until every worker is ready."""
    node = NodeProcess({"workers": {"engine": ctx.engine}, "pressure": {"cpu_warn_pct": 0.0}})
    try:
        start = time.monotonic()
        node.start(timeout=180)
        return time.monotonic() - start
    finally:
        node.cleanup()


def time_backend(backend: Backend) -> float:
    """Seconds from launching ``backend`` until it serves (its ``start`` returns)."""
    try:
        start = time.monotonic()
        backend.start(1)
        return time.monotonic() - start
    finally:
        backend.stop()


def run(ctx: BenchContext) -> Section:
    """Start each ``rounds`` times; see the module."""
    rounds = ctx.pick(1, 3)
    cpus = sorted(os.sched_getaffinity(0))
    tmp = Path(tempfile.mkdtemp(prefix="bench-start-"))
    times: dict[str, list[float]] = {f"node ({ctx.engine} engine)": []}
    try:
        for i in range(rounds):
            ctx.step(f"startup: node {i + 1}/{rounds}")
            times[f"node ({ctx.engine} engine)"].append(time_node(ctx))
            backends: list[Backend] = []
            if ctx.engine == "llama":
                model = resolve_model("default")
                backends.append(DirectBackend(model, len(cpus), cpus, 0, False, "default", tmp))
                if ctx.llama_server is not None:
                    backends.append(
                        ServerBackend(ctx.llama_server, model, len(cpus), cpus, 0, False, [], tmp)
                    )
            for b in backends:
                ctx.step(f"startup: {b.name} {i + 1}/{rounds}")
                times.setdefault(b.name, []).append(time_backend(b))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return section(ctx, times)


def section(ctx: BenchContext, times: dict[str, list[float]]) -> Section:
    """The report of ``run``'s measurements."""
    node_name = f"node ({ctx.engine} engine)"
    node_median = percentile(times[node_name], 50)
    rows: list[tuple[Any, ...]] = []
    for name, values in times.items():
        median = percentile(values, 50)
        rows.append((name, len(values), median, max(values), ratio(node_median, median)))
    server = times.get("llama-server -nr")
    to_server = ratio(node_median, percentile(server, 50)) if server else None
    goals = [
        Goal(
            "node start to ready, share of llama-server's load time",
            None if to_server is None else 100 * to_server,
            100.0,
            "<=",
            " %",
        )
    ]
    text = (
        "Seconds from launch to ready. The node's time includes its broker, cgroups and "
        "every worker's model load; the baselines load the same model alone."
    )
    table = Table(("process", "n", "median s", "max s", "node / this"), rows)
    data = {"seconds": times}
    return Section("startup", "Start to ready", text, [table], goals, [], data)
