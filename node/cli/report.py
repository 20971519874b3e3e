"""``edgenode report``: summarize the migration log (shadow, dual, degrade, full).

Register with ``cli.add_command(report)`` in ``node.cli.main``. The command reads only log files
(the live one and its rotated backups), never the node's sockets, so it also works on a copy
of the logs on another machine.

Exit codes: 0 done (also for an empty log), 1 none of the given logs exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from node.cli.context import add_global_options, node_config, wants_json
from node.migration.log import migration_log_path
from node.migration.report import summarize
from node.migration.report_view import format_report


@click.command()
@click.option(
    "--log",
    "logs",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="A migration log; its rotated backups (LOG.1, LOG.2, ...) are read too. Repeatable. "
    "Default: <run dir>/logs/migration.jsonl.",
)
@click.pass_context
def report(ctx: click.Context, logs: tuple[Path, ...]) -> None:
    """Agreement, latency percentiles, fallbacks and memory peak per migration mode, with a
    hint whether to advance to the next stage."""
    paths = list(logs) or [migration_log_path(_run_dir(ctx))]
    summary = summarize(paths)
    if not summary["files"]:
        raise click.ClickException("no migration log at " + ", ".join(str(p) for p in paths))
    if wants_json(ctx):
        click.echo(json.dumps(summary, indent=2, sort_keys=True))
        return
    click.echo(format_report(summary))


def _run_dir(ctx: click.Context) -> Path:
    # Outside the ``edgenode`` group (tests, embedding) nobody set ctx.obj: built-in lookup.
    ctx.ensure_object(dict).setdefault("config", None)
    return node_config(ctx).run_dir


# The global options also when the command runs on its own (tests, embedding);
# the edgenode group adds none twice (node.cli.context.add_global_options).
add_global_options(report)
