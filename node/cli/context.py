"""What every ``edgenode`` command reads from the click context: the node's config,
and the global options that choose it.

The global options ``-c/--config``, ``--run-dir`` and ``--json`` are taken
wherever people type them: before the command (``edgenode --run-dir X status``)
or after it (``edgenode status --run-dir X``), at every level (``edgenode rules
--json test ...``). ``add_global_options`` gives a command its own copies of them
(``expose_value=False``); each copy's callback stores what was given into the
root context's object (``ctx.obj``), so the command reads one value whatever the
place. Options are parsed left to right, group before command, so when one is
given in both places the one after the command wins (the nearest to it), as
click does for a repeated option; ``$EDGENODE_CONFIG``/``$EDGENODE_RUN_DIR`` are
read by the group's copy only, so an option typed anywhere beats them.

A command run outside the group (tests, embedding) finds no ``ctx.obj`` and gets
the built-in lookup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from broker.errors import EdgeNodeError
from node.config import NodeConfig, load_config
from node.model import cache_dir

#: ``ctx.obj`` key: the run directory of the config a command loaded (``node_config``).
RUN_DIR_KEY = "run_dir"
#: ``ctx.obj`` keys of the global options: the config path, the ``--json`` flag.
CONFIG_KEY = "config"
JSON_KEY = "json"


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    """Keep a global option's value in the root context's object, when it was
    given (command line or, for the group's copy, environment); the run
    directory and config path also go to the environment, resolved, so the
    node a background start launches inherits them."""
    if param.name is None or ctx.get_parameter_source(param.name) is ParameterSource.DEFAULT:
        return
    obj = ctx.find_root().ensure_object(dict)
    if param.name == "run_dir":
        os.environ["EDGENODE_RUN_DIR"] = str(Path(value).resolve())
    elif param.name == "config_path":
        obj[CONFIG_KEY] = os.environ["EDGENODE_CONFIG"] = str(Path(value).resolve())
    elif param.name == "as_json":
        obj[JSON_KEY] = bool(value)


def global_options(group: bool) -> list[click.Option]:
    """Fresh copies of ``-c/--config``, ``--run-dir`` and ``--json`` for one
    command (``group``: the top-level group's, which also read the environment)."""
    return [
        click.Option(
            ["-c", "--config", "config_path"],
            envvar="EDGENODE_CONFIG" if group else None,
            type=click.Path(),
            expose_value=False,
            callback=_store,
            help="TOML config file (default: /etc/edgenode/edgenode.toml if present, "
            "else built-in defaults = etc/edgenode.toml).",
        ),
        click.Option(
            ["--run-dir", "run_dir"],
            envvar="EDGENODE_RUN_DIR" if group else None,
            type=click.Path(),
            expose_value=False,
            callback=_store,
            help="Pidfile, sockets and logs (default: $XDG_RUNTIME_DIR/edgenode or "
            "/tmp/edgenode-<uid>).",
        ),
        click.Option(
            ["--json", "as_json"],
            is_flag=True,
            expose_value=False,
            callback=_store,
            help="Machine-readable output (commands without a JSON view ignore it).",
        ),
    ]


def add_global_options(command: click.Command, group: bool = False) -> None:
    """Give ``command`` (and, for a group, every command it holds) the global
    options. A command that declares one of those flags itself keeps its own."""
    taken = {flag for param in command.params for flag in getattr(param, "opts", [])}
    for option in global_options(group):
        if not taken.intersection(option.opts):
            command.params.append(option)
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_global_options(sub)


def wants_json(ctx: click.Context) -> bool:
    """Whether ``--json`` was given, before or after the command."""
    obj = ctx.find_root().obj
    return bool(obj.get(JSON_KEY)) if isinstance(obj, dict) else False


def config_path(ctx: click.Context) -> str | None:
    """The ``--config`` path given (resolved), else None (the built-in lookup,
    which reads ``$EDGENODE_CONFIG`` itself)."""
    obj = ctx.find_root().obj
    return obj.get(CONFIG_KEY) if isinstance(obj, dict) else None


def node_config(ctx: click.Context) -> NodeConfig:
    """The config the command line names (``--config``/``$EDGENODE_CONFIG``).

    Raises:
        click.ClickException: the file is unreadable or invalid (the ``ConfigError``'s message).
    """
    try:
        config: NodeConfig = load_config(config_path(ctx))
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
    # For unusable_dir_error: an OSError later in the command may be about it.
    ctx.find_root().ensure_object(dict)[RUN_DIR_KEY] = config.run_dir
    return config


def unusable_dir_error(exc: OSError, obj: Any) -> click.ClickException | None:
    """The one-line error for ``exc`` when the path it names is the run directory
    (of the config ``node_config`` loaded into ``obj``) or the model cache
    directory, lies inside one or above one (creating it failed there); None
    for any other ``OSError``."""
    if not isinstance(exc.filename, (str, bytes)):
        return None
    failed = Path(os.fsdecode(exc.filename)).absolute()
    run_dir = obj.get(RUN_DIR_KEY) if isinstance(obj, dict) else None
    candidates = [
        ("run directory", run_dir, "--run-dir or EDGENODE_RUN_DIR"),
        ("cache directory", cache_dir(), "EDGENODE_CACHE_DIR"),
    ]
    for what, directory, setting in candidates:
        if directory is None:
            continue
        directory = Path(directory).absolute()
        if failed == directory or directory in failed.parents or failed in directory.parents:
            return click.ClickException(
                f"unusable {what} {directory}: {exc.strerror} ({failed}); "
                f"point {setting} at a directory this user can create and write"
            )
    return None
