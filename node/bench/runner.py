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
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from node.bench import faults, host, overhead, overload, remote, startup, throughput
from node.bench.context import BenchContext, BenchEngine, NoProgress, split_list
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
        ValueError: an unknown name, an empty or blank list, an empty item (``split_list``);
            the message lists the known names.
    """
    known = f"known: {', '.join(SCENARIO_NAMES)}"
    try:
        wanted = set(split_list(text, "scenario"))
    except ValueError as exc:
        raise ValueError(f"{exc}; {known}") from exc
    unknown = wanted - set(SCENARIO_NAMES)
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(sorted(unknown))}; {known}")
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


@dataclass(frozen=True)
class Outcome:
    """What a run left.

    ``report``: report.md's path (in ``--out``, or in a fallback directory when ``--out``
    could not be written: ``problem`` then says so), or None when it could be written
    nowhere (the caller prints it). ``interrupted``: the scenario a Ctrl-C stopped (the
    report then holds the scenarios finished before it), else None.
    """

    report: Path | None
    sections: list[Section]
    header: dict[str, Any]
    problem: str = ""
    interrupted: ScenarioName | None = None


def run(
    names: Sequence[ScenarioName],
    out: Path,
    quick: bool,
    engine: BenchEngine,
    llama_server: Path | None,
    show_progress: bool = True,
) -> Outcome:
    """Run ``names`` and write the report into ``out`` (``save``).

    A Ctrl-C (KeyboardInterrupt) stops the run after the scenario it hit has cleaned up
    (each stops its own processes in a ``finally``); the scenarios finished before it are
    written, the header marked ``interrupted``, and ``Outcome.interrupted`` names it.

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
    interrupted: ScenarioName | None = None
    ctx = BenchContext(quick, engine, llama_server, NoProgress())
    total = sum(SCENARIOS[n].steps(ctx) for n in names)
    with tqdm(total=total, unit="step", disable=not show_progress, file=sys.stderr) as bar:
        ctx.bar = bar
        try:
            for name in names:
                sections.append(SCENARIOS[name].run(ctx))
        except KeyboardInterrupt:
            interrupted = names[len(sections)]
        bar.set_postfix_str("writing the report")
    header = meta(names, ctx, started)
    if interrupted is not None:
        finished = ", ".join(s.name for s in sections) or "none"
        header["interrupted"] = f"by Ctrl-C during {interrupted}; finished: {finished}"
    report, problem = save(out, sections, header)
    return Outcome(report, sections, header, problem, interrupted)


def save(out: Path, sections: Sequence[Section], header: dict[str, Any]) -> tuple[Path | None, str]:
    """Write the report into ``out``; if that fails (the disk filled, the directory went
    away), into a new temporary directory: measurements are never lost to a bad ``--out``.

    Returns:
        (report.md's path, or None if it could be written nowhere; what went wrong, or "").
    """
    try:
        return write(out, sections, header), ""
    except OSError as exc:
        problem = f"could not write the report into {out} ({exc})"
    try:
        fallback = Path(tempfile.mkdtemp(prefix="edgenode-bench-"))
        return write(fallback, sections, header), f"{problem}; wrote it into {fallback} instead"
    except OSError as exc:
        return None, f"{problem}, nor into a temporary directory ({exc})"
