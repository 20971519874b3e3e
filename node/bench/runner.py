"""Run the chosen scenarios one after another under one progress bar, and write the report.

Each scenario module has ``steps(ctx) -> int`` (its progress steps) and
``run(ctx) -> Section``; they run in ``SCENARIOS`` order, each starting and stopping
what it measures, so one figure's processes never load the next one's.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from node.bench import faults, host, overhead, overload, remote, startup, throughput
from node.bench.context import BenchContext, BenchEngine, NoProgress
from node.bench.report import Section, require_extras, write

ScenarioName = Literal["broker", "throughput", "overload", "faults", "host", "startup", "remote"]
SCENARIO_NAMES: tuple[ScenarioName, ...] = get_args(ScenarioName)


@dataclass(frozen=True)
class Scenario:
    """A scenario's entry points (see the module docstring)."""

    steps: Callable[[BenchContext], int]
    run: Callable[[BenchContext], Section]


SCENARIOS: dict[ScenarioName, Scenario] = {
    "broker": Scenario(overhead.steps, overhead.run),
    "throughput": Scenario(throughput.steps, throughput.run),
    "overload": Scenario(overload.steps, overload.run),
    "faults": Scenario(faults.steps, faults.run),
    "host": Scenario(host.steps, host.run),
    "startup": Scenario(startup.steps, startup.run),
    "remote": Scenario(remote.steps, remote.run),
}


def parse_only(text: str) -> list[ScenarioName]:
    """``broker,faults`` -> those scenarios, in ``SCENARIOS`` order.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    wanted = {w.strip() for w in text.split(",") if w.strip()}
    unknown = wanted - set(SCENARIO_NAMES)
    if unknown or not wanted:
        raise ValueError(
            f"unknown scenario(s) {', '.join(sorted(unknown)) or '(none given)'}; "
            f"known: {', '.join(SCENARIO_NAMES)}"
        )
    return [n for n in SCENARIO_NAMES if n in wanted]


def meta(names: Sequence[ScenarioName], ctx: BenchContext, started: float) -> dict[str, Any]:
    """The report's header: what ran, where and how long."""
    return {
        "command": " ".join(["edgenode", *sys.argv[1:]]) if sys.argv else "edgenode bench",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": f"{platform.node()}, {os.cpu_count()} CPUs ({platform.machine()})",
        "allowed cores": ",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        "load average before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "scenarios": ", ".join(names),
        "quick": ctx.quick,
        "engine": ctx.engine,
        "llama-server": str(ctx.llama_server) if ctx.llama_server else "not given",
        "llama-cpp-python": importlib.metadata.version("llama-cpp-python"),
        "duration s": round(time.monotonic() - started, 1),
    }


def run(
    names: Sequence[ScenarioName],
    out: Path,
    quick: bool,
    engine: BenchEngine,
    llama_server: Path | None,
    show_progress: bool = True,
) -> tuple[Path, list[Section], dict[str, Any]]:
    """Run ``names`` and write the report into ``out``; returns the report's path, the
    sections and the header.

    Raises:
        MissingExtraError: the ``bench`` extra is missing (checked before anything runs).
        FileNotFoundError: ``llama_server`` is given but is no file.
    """
    require_extras()
    if llama_server is not None and not llama_server.is_file():
        raise FileNotFoundError(f"--llama-server {llama_server}: no such file")
    from tqdm import tqdm

    started = time.monotonic()
    sections: list[Section] = []
    ctx = BenchContext(quick, engine, llama_server, NoProgress())
    total = sum(SCENARIOS[n].steps(ctx) for n in names)
    with tqdm(total=total, unit="step", disable=not show_progress, file=sys.stderr) as bar:
        ctx.bar = bar
        for name in names:
            sections.append(SCENARIOS[name].run(ctx))
        bar.set_postfix_str("writing the report")
    header = meta(names, ctx, started)
    return write(out, sections, header), sections, header
