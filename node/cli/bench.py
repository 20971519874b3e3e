"""``edgenode bench``: run the benchmark scenarios and write the report (README, "Benchmark").

It starts its own nodes (private run directories), never the configured one: ``-c`` and
``--run-dir`` do not apply. Exit status 2 for a bad option, ``--out`` included (checked and
claimed before anything runs: ``node.bench.outdir``); 1 when the ``bench`` extra is missing
or a scenario fails or the report could not be written into ``--out`` (it is then written
elsewhere, or printed, and the message says where); 130 on Ctrl-C, after writing the
scenarios finished. A goal missed is reported, not an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from node.bench import outdir
from node.bench.context import BenchEngine
from node.bench.report import MissingExtraError, as_json, render, require_extras
from node.bench.runner import SCENARIO_NAMES, parse_only
from node.bench.runner import run as run_bench
from node.cli.context import wants_json


def _only(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str]:
    """Click callback: ``--only a,b`` as scenario names (not given: all of them; given but
    empty or blank, or with an empty item: an error, not every scenario)."""
    try:
        return list(SCENARIO_NAMES) if value is None else list(parse_only(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command()
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-report"),
    show_default=True,
    help="Directory of the report (report.md, report.json and the PNG plots); made and "
    "test-written before anything runs. One that already holds a report is refused "
    "unless --force.",
)
@click.option("--force", is_flag=True, help="Replace a report already in --out.")
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
    force: bool,
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
    try:
        claim = outdir.claim(out, force)
    except outdir.OutDirError as exc:
        raise click.BadParameter(str(exc), param_hint="'--out'") from exc
    chosen: BenchEngine = "test" if engine == "test" else "llama"
    try:
        done = run_bench(names, out, quick, chosen, llama_server, show_progress=not no_progress)
    finally:
        claim.release()
    if wants_json(ctx):
        click.echo(json.dumps(as_json(done.sections, done.header), indent=1, default=str))
    elif done.report is None:
        click.echo(render(done.sections, done.header), nl=False)
    if done.problem:
        where = "the JSON above" if wants_json(ctx) else "the report above"
        click.echo(
            f"Error: {done.problem}" + ("" if done.report else f"; {where} is its only copy"),
            err=True,
        )
    if not wants_json(ctx) and done.report is not None:
        click.echo(f"report: {done.report}")
    missed = [g.name for s in done.sections for g in s.goals if g.met is False]
    if missed and not wants_json(ctx):
        click.echo(f"goals missed: {'; '.join(missed)}")
    if done.interrupted is not None:
        click.echo(
            f"interrupted during {done.interrupted}: "
            "the report holds the scenarios finished before it",
            err=True,
        )
        ctx.exit(130)
    if done.problem:
        ctx.exit(1)
