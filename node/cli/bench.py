"""``edgenode bench``: run the benchmark scenarios and write the report (README, "Benchmark").

It starts its own nodes (private run directories), never the configured one: ``-c`` and
``--run-dir`` do not apply. Exit status 1 when the ``bench`` extra is missing or a
scenario fails; a goal missed is reported, not an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from node.bench.context import BenchEngine
from node.bench.report import MissingExtraError, as_json, require_extras
from node.bench.runner import SCENARIO_NAMES, parse_only
from node.bench.runner import run as run_bench
from node.cli.context import wants_json


def _only(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    """Click callback: ``--only a,b`` as scenario names."""
    try:
        return list(parse_only(value)) if value else list(SCENARIO_NAMES)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-report"),
    show_default=True,
    help="Directory of the report (report.md, report.json and the PNG plots).",
)
@click.option("--quick", is_flag=True, help="Fewer, shorter measurements: about 2 minutes.")
@click.option(
    "--only",
    callback=_only,
    metavar="NAMES",
    help=f"Comma-separated scenarios to run (default all: {','.join(SCENARIO_NAMES)}).",
)
@click.option(
    "--engine",
    type=click.Choice(["llama", "test"]),
    default="llama",
    show_default=True,
    help="The node's engine in the model scenarios (test: check the machinery; "
    "the broker scenario always uses the test engine).",
)
@click.option(
    "--llama-server",
    "llama_server",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A llama-server binary: adds it as a baseline (throughput, start to ready).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.pass_context
def bench(
    ctx: click.Context,
    out: Path,
    quick: bool,
    only: list[str],
    engine: str,
    llama_server: Path | None,
    no_progress: bool,
) -> None:
    """Measure the node beside its baselines, in one run; write a Markdown report with plots
    (the global ``--json``: also print the results as JSON on stdout)."""
    try:
        require_extras()
    except MissingExtraError as exc:
        raise click.ClickException(str(exc)) from exc
    if llama_server is not None and not llama_server.is_file():
        raise click.BadParameter(f"{llama_server}: no such file", param_hint="--llama-server")
    names = parse_only(",".join(only))
    chosen: BenchEngine = "test" if engine == "test" else "llama"
    report, sections, header = run_bench(
        names, out, quick, chosen, llama_server, show_progress=not no_progress
    )
    if wants_json(ctx):
        click.echo(json.dumps(as_json(sections, header), indent=1, default=str))
    else:
        click.echo(f"report: {report}")
        missed = [g.name for s in sections for g in s.goals if g.met is False]
        if missed:
            click.echo(f"goals missed: {'; '.join(missed)}")
