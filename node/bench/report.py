"""The bench report: each scenario's ``Section`` (tables, goals, plots), written as one
Markdown file with PNG plots beside it, and as JSON.

The plots need matplotlib (the ``bench`` extra); ``require_extras`` says so before a run
starts rather than after it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

#: A cell of a table: text as is, numbers formatted by ``cell``, None as a dash.
Cell = str | int | float | None
#: How a goal compares its measured value with its target.
Comparison = Literal["<=", ">=", "=="]
#: The Python modules of the ``bench`` extra and what each is for.
EXTRAS = {"matplotlib": "the report's plots", "tqdm": "the progress bar"}


class MissingExtraError(RuntimeError):
    """A module of the ``bench`` extra is not installed (the message says how to install it)."""


def require_extras() -> None:
    """Check the ``bench`` extra is importable.

    Raises:
        MissingExtraError: naming every missing module and the ``pip install`` that adds it.
    """
    missing = [m for m in EXTRAS if importlib.util.find_spec(m) is None]
    if missing:
        needs = ", ".join(f"{m} ({EXTRAS[m]})" for m in missing)
        raise MissingExtraError(
            f"edgenode bench needs {needs}: pip install 'edgenode[bench]' "
            "(or pip install -e '.[bench]' in a checkout)"
        )


@dataclass(frozen=True)
class Table:
    """A Markdown table: ``headers`` and ``rows`` of the same width."""

    headers: Sequence[str]
    rows: Sequence[Sequence[Cell]]
    caption: str = ""


@dataclass(frozen=True)
class Series:
    """One line of a plot: y over x, with its legend label; ``right`` puts it on a second
    y axis (e.g. a share in % beside a rate)."""

    label: str
    x: Sequence[float]
    y: Sequence[float | None]
    right: bool = False


@dataclass(frozen=True)
class Plot:
    """A line plot saved as ``<out>/<name>.png``."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: Sequence[Series]
    right_label: str = ""
    log_x: bool = False


@dataclass(frozen=True)
class Goal:
    """A target of the issue the run is reported against (README, "Benchmark")."""

    name: str
    measured: float | None
    target: float
    comparison: Comparison
    unit: str = ""

    @property
    def met(self) -> bool | None:
        """Whether the measured value meets the target; None when nothing was measured."""
        if self.measured is None:
            return None
        if self.comparison == "<=":
            return self.measured <= self.target
        if self.comparison == ">=":
            return self.measured >= self.target
        return self.measured == self.target


@dataclass
class Section:
    """What one scenario reports: prose, tables, goals, plots, and its raw data (JSON)."""

    name: str
    title: str
    text: str = ""
    tables: list[Table] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    plots: list[Plot] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    skipped: str = ""


def cell(value: Cell) -> str:
    """A table cell: None as ``-``, floats to 3 significant digits (at least whole units
    above 100), others as ``str``; ``|`` escaped."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def share(value: float | None) -> str:
    """A ratio as a percentage (``0.834`` -> ``83.4 %``); None as ``-``."""
    return "-" if value is None else f"{100 * value:.1f} %"


def markdown_table(table: Table) -> str:
    """``table`` in GitHub Markdown (caption, if any, above it in italics).

    Raises:
        ValueError: a row is not as wide as the headers.
    """
    width = len(table.headers)
    for row in table.rows:
        if len(row) != width:
            raise ValueError(f"row of {len(row)} cells under {width} headers: {row!r}")
    lines = [f"*{table.caption}*", ""] if table.caption else []
    lines.append("| " + " | ".join(cell(h) for h in table.headers) + " |")
    lines.append("|" + "|".join("---" for _ in table.headers) + "|")
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def goals_table(goals: Sequence[Goal]) -> Table:
    """The goals as a table: goal, target, measured, met."""
    verdict = {True: "yes", False: "**no**", None: "not measured"}
    rows = [
        (g.name, f"{g.comparison} {cell(g.target)}{g.unit}", _with_unit(g), verdict[g.met])
        for g in goals
    ]
    return Table(("goal", "target", "measured", "met"), rows)


def _with_unit(goal: Goal) -> str:
    return "-" if goal.measured is None else f"{cell(goal.measured)}{goal.unit}"


def render(sections: Sequence[Section], meta: dict[str, Any]) -> str:
    """The report in Markdown: a header from ``meta``, every goal, then each section."""
    out = ["# edgenode bench", ""]
    out += [f"- {k}: {v}" for k, v in meta.items()]
    goals = [g for s in sections for g in s.goals]
    if goals:
        out += ["", "## Goals", "", markdown_table(goals_table(goals))]
    for s in sections:
        out += ["", f"## {s.title}", ""]
        if s.skipped:
            out += [f"Skipped: {s.skipped}"]
            continue
        if s.text:
            out += [s.text, ""]
        for t in s.tables:
            out += [markdown_table(t), ""]
        out += [f"![{p.title}]({p.name}.png)" for p in s.plots]
    return "\n".join(out).rstrip() + "\n"


def draw(plot: Plot, path: Path) -> None:
    """Save ``plot`` as a PNG at ``path`` (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    right = ax.twinx() if any(s.right for s in plot.series) else None
    markers = "osD^v<>"
    for i, s in enumerate(plot.series):
        axis = right if s.right and right is not None else ax
        xs = [x for x, y in zip(s.x, s.y, strict=True) if y is not None]
        ys = [y for y in s.y if y is not None]
        style = "--" if s.right else "-"
        # Colours by series, not by axis: a second axis would restart the cycle.
        axis.plot(xs, ys, style, marker=markers[i % len(markers)], color=f"C{i}", label=s.label)
    if plot.log_x:
        ax.set_xscale("log")
    ax.set_xlabel(plot.xlabel)
    ax.set_ylabel(plot.ylabel)
    if right is not None:
        right.set_ylabel(plot.right_label)
    ax.set_title(plot.title)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(out: Path, sections: Sequence[Section], meta: dict[str, Any]) -> Path:
    """Write ``out/report.md``, a PNG per plot and ``out/report.json``; returns the report.

    Raises:
        MissingExtraError: matplotlib is not installed.
        OSError: ``out`` cannot be created or written.
    """
    require_extras()
    out.mkdir(parents=True, exist_ok=True)
    for s in sections:
        for p in s.plots:
            draw(p, out / f"{p.name}.png")
    report = out / "report.md"
    report.write_text(render(sections, meta))
    (out / "report.json").write_text(json.dumps(as_json(sections, meta), indent=1) + "\n")
    return report


def as_json(sections: Sequence[Section], meta: dict[str, Any]) -> dict[str, Any]:
    """The run as plain data: meta, goals (with ``met``) and each section's raw data."""
    return {
        "meta": meta,
        "goals": [{**asdict(g), "met": g.met} for s in sections for g in s.goals],
        "scenarios": {
            s.name: {"title": s.title, "skipped": s.skipped or None, **s.data} for s in sections
        },
    }
