"""node.bench.report (tables, goals, the Markdown and JSON report, its PNGs) and the
``edgenode bench`` command line's checks before anything runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from node.bench import report
from node.bench.report import (
    Goal,
    MissingExtraError,
    Plot,
    Section,
    Series,
    Table,
    cell,
    goals_table,
    markdown_table,
    render,
    require_extras,
    share,
    write,
)
from node.bench.runner import SCENARIO_NAMES, parse_only
from node.cli.main import cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_markdown_table_formats_cells() -> None:
    table = Table(
        ("level", "node req/s", "relay req/s", "node / relay", "note"),
        [(1, 25.25, 605.4, share(0.0417), None), (8, 0.012345, 3600.0, share(None), "a|b")],
        caption="broker",
    )
    assert markdown_table(table).splitlines() == [
        "*broker*",
        "",
        "| level | node req/s | relay req/s | node / relay | note |",
        "|---|---|---|---|---|",
        "| 1 | 25.2 | 605 | 4.2 % | - |",
        "| 8 | 0.0123 | 3600 | - | a\\|b |",
    ]


def test_markdown_table_refuses_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="row of 1 cells under 2 headers"):
        markdown_table(Table(("a", "b"), [(1,)]))


def test_cell_and_share() -> None:
    assert [cell(None), cell(3), cell(2.0), cell(99.96), cell(1234.5)] == [
        "-",
        "3",
        "2",
        "100",
        "1234",
    ]
    assert share(0.7) == "70.0 %"


@pytest.mark.parametrize(
    ("measured", "target", "comparison", "met"),
    [
        (103.0, 100.0, "<=", False),
        (99.0, 100.0, "<=", True),
        (70.0, 70.0, ">=", True),
        (3.5, 70.0, ">=", False),
        (0.0, 0.0, "==", True),
        (1.0, 0.0, "==", False),
        (None, 100.0, "<=", None),
    ],
)
def test_goal_met(measured: float | None, target: float, comparison: Any, met: bool | None) -> None:
    assert Goal("g", measured, target, comparison).met is met


def test_goals_table_says_which_were_missed() -> None:
    table = goals_table(
        [
            Goal("kill -9 detected", 103.0, 100.0, "<=", " ms"),
            Goal("lost replies", 0.0, 0, "=="),
            Goal("vs llama-server", None, 100.0, "<=", " %"),
        ]
    )
    assert [list(r) for r in table.rows] == [
        ["kill -9 detected", "<= 100 ms", "103 ms", "**no**"],
        ["lost replies", "== 0", "0", "yes"],
        ["vs llama-server", "<= 100 %", "-", "not measured"],
    ]


def sections() -> list[Section]:
    plot = Plot(
        "broker",
        "node vs relay",
        "in flight",
        "req/s",
        [
            Series("node", [1, 8], [25.0, 126.0]),
            Series("raw relay", [1, 8], [605.0, None]),
            Series("share (%)", [1, 8], [4.1, 3.5], right=True),
        ],
        right_label="%",
        log_x=True,
    )
    broker = Section(
        "broker",
        "Broker overhead",
        "text of the broker",
        [Table(("in flight", "node req/s", "raw relay req/s"), [(1, 25.0, 605.0)])],
        [Goal("share at 8", 3.5, 70.0, ">=", " %")],
        [plot],
        {"share": {"8": 0.035}},
    )
    skipped = Section("throughput", "Model throughput", skipped="needs the model")
    return [broker, skipped]


def test_render_puts_goals_first_then_each_section() -> None:
    text = render(sections(), {"engine": "test"})
    lines = text.splitlines()
    assert lines[:3] == ["# edgenode bench", "", "- engine: test"]
    assert text.index("## Goals") < text.index("## Broker overhead") < text.index("## Model")
    assert "| share at 8 | >= 70 % | 3.5 % | **no** |" in lines
    assert "| 1 | 25 | 605 |" in lines
    assert "![node vs relay](broker.png)" in lines
    assert "Skipped: needs the model" in lines


def test_write_makes_markdown_json_and_pngs(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "report"
    path = write(out, sections(), {"engine": "test"})
    assert path == out / "report.md"
    assert path.read_text() == render(sections(), {"engine": "test"})
    assert (out / "broker.png").read_bytes()[:8] == PNG_MAGIC
    data = json.loads((out / "report.json").read_text())
    assert data["meta"] == {"engine": "test"}
    assert data["goals"][0]["met"] is False
    assert data["scenarios"]["broker"]["share"] == {"8": 0.035}
    assert data["scenarios"]["throughput"]["skipped"] == "needs the model"


def test_a_missing_extra_is_named_with_its_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def without_matplotlib(name: str, *args: Any) -> Any:
        return None if name == "matplotlib" else real(name, *args)

    monkeypatch.setattr(report.importlib.util, "find_spec", without_matplotlib)
    with pytest.raises(MissingExtraError, match=r"matplotlib \(the report's plots\)"):
        require_extras()
    result = CliRunner().invoke(cli, ["bench", "--quick", "--only", "broker"])
    assert result.exit_code == 1
    assert "pip install 'edgenode[bench]'" in result.output


def test_only_names_scenarios_in_run_order() -> None:
    assert parse_only("faults, broker") == ["broker", "faults"]
    assert parse_only(",".join(SCENARIO_NAMES)) == list(SCENARIO_NAMES)
    for bad in ("brokr", ""):
        with pytest.raises(ValueError, match="known: broker,"):
            parse_only(bad)


def test_cli_refuses_unknown_scenarios_and_a_missing_llama_server(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["bench", "--only", "broker,nope"])
    assert result.exit_code == 2
    assert "unknown scenario(s) nope" in result.output
    missing = tmp_path / "llama-server"
    result = runner.invoke(cli, ["bench", "--llama-server", str(missing), "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "no such file" in result.output
    assert not (tmp_path / "report.md").exists()
