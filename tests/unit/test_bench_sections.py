"""The broker-overhead and overload scenarios' report sections, from fixed measurements:
their goals, tables and plots say what the figures are."""

from __future__ import annotations

from typing import Any

import pytest

from node.bench import overhead, overload
from node.bench.context import BenchContext, NoProgress


def level(rps: float, p50: float = 1.0, p99: float = 2.0, lost: int = 0) -> dict[str, Any]:
    """One closed-loop level's summary, as ``overhead.summary`` gives it."""
    return {"req_per_s": rps, "rtt_p50_ms": p50, "rtt_p99_ms": p99, "lost": lost, "not_ok": 1}


def test_the_broker_goal_is_the_share_of_the_relay_at_the_top_level() -> None:
    results = {
        "node": {1: level(100.0), 8: level(560.0, lost=2)},
        "relay": {1: level(200.0), 8: level(700.0)},
    }
    report = overhead.section(results, 5.0)
    (goal,) = report.goals
    assert goal.measured == pytest.approx(80.0) and goal.met is True
    (table,) = report.tables
    assert len(table.headers) == len(table.rows[0]) == len(overhead.HEADERS)
    assert [row[0] for row in table.rows] == list(overhead.LEVELS)
    assert table.rows[-1][-1] == 3  # lost plus not ok
    (plot,) = report.plots
    assert [s.label for s in plot.series] == ["node", "raw relay"]
    assert plot.series[1].y == [200.0, 700.0]


def test_a_relay_that_served_nothing_has_no_share() -> None:
    results = {"node": {lv: level(1.0) for lv in overhead.LEVELS}}
    results["relay"] = {lv: level(0.0) for lv in overhead.LEVELS}
    (goal,) = overhead.section(results, 5.0).goals
    assert goal.measured is None and goal.met is None


def load(factor: float, offered: float, goodput: float, shed: float) -> dict[str, Any]:
    """One open-loop level's summary, as ``overload.summary`` gives it."""
    return {
        "factor": factor,
        "offered_rps": offered,
        "goodput_rps": goodput,
        "shed_share": shed,
        "shed_p99_ms": 1.0,
        "queue_p99_ms": 2.0,
        "ok_p99_ms": 3.0,
        "lost": 0,
    }


def test_overload_goals_are_goodput_shares_at_3x_and_10x_and_none_when_not_run() -> None:
    ctx = BenchContext(True, "test", None, NoProgress())
    rows = [load(1.0, 2.0, 2.0, 0.0), load(3.0, 6.0, 1.5, 0.7)]
    report = overload.section(ctx, 2.0, rows, 10.0)
    at3, at10 = report.goals
    assert at3.measured == pytest.approx(75.0) and at3.met is False
    assert at10.measured is None and at10.met is None
    assert report.data["levels"][1]["goodput_share"] == pytest.approx(0.75)
    (table,) = report.tables
    assert [row[0] for row in table.rows] == ["1x", "3x"]
    assert len(table.rows[0]) == len(overload.HEADERS)
    (plot,) = report.plots
    shed = next(s for s in plot.series if s.right)
    assert shed.y == [0.0, 70.0]
