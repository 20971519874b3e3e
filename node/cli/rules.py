"""``edgenode rules``: check and try rule files of the rule-engine fallback.

Register with ``cli.add_command(rules)`` in ``node.cli.main``. The commands read only the rule
file, never the node's config or sockets, so they work on a device where no node runs.

Exit codes: 0 done (``test`` also exits 0 when no rule matched: that is an answer), 1 the
file is unreadable or invalid (every error printed to stderr, one per line).
``edgenode start`` checks the node's rules file with ``load_or_exit`` too, so a bad file
refuses the start in the same words.
"""

from __future__ import annotations

import json
from typing import Any

import click

from fallback.engine import RuleEngine
from fallback.intents import INTENT_SCHEMA
from fallback.rules import RulesError, RuleSet, load_rules
from node.cli.context import add_global_options, wants_json


def load_or_exit(path: str) -> RuleSet:
    """The validated rules of ``path``; if they are invalid, every error is printed to
    stderr, one per line, and the command exits 1 (``rules check``, ``rules test``, ``start``).

    Raises:
        click.exceptions.Exit: (code 1) the file is unreadable or invalid.
    """
    try:
        return load_rules(path)
    except RulesError as exc:
        for line in exc.message.splitlines():
            click.echo(line, err=True)
        raise click.exceptions.Exit(1) from exc


@click.group()
def rules() -> None:
    """Check and try rule files (etc/rules.toml documents the format)."""


@rules.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def check(file: str) -> None:
    """Validate FILE: print the rule count, or every error (exit 1)."""
    ruleset = load_or_exit(file)
    count = len(ruleset.rules)
    click.echo(f"{file}: {count} rule{'s' if count != 1 else ''} OK")


@rules.command("test")
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("text")
@click.option(
    "--schema/--no-schema",
    default=True,
    show_default=True,
    help="Answer as to a request carrying json_schema (the intent schema): JSON responses "
    "are preferred. --no-schema prefers a rule's text response.",
)
@click.pass_context
def test(ctx: click.Context, file: str, text: str, schema: bool) -> None:
    """Show which rule of FILE answers TEXT (a command, or telemetry as a JSON object)."""
    engine = RuleEngine(load_or_exit(file))
    request: dict[str, Any] = {"op": "generate", "prompt": text}
    if schema:
        request["json_schema"] = INTENT_SCHEMA
    answer = engine.answer(request)
    if wants_json(ctx):  # the engine's whole answer
        click.echo(json.dumps(answer, ensure_ascii=False))
        return
    click.echo(f"rule: {answer['rule'] or '(none: no rule matched)'}")
    click.echo(f"confidence: {answer['confidence']:g}")
    click.echo(f"response: {answer['text']}")


# The global options also when the command runs on its own (tests, embedding);
# the edgenode group adds none twice (node.cli.context.add_global_options).
add_global_options(rules)
