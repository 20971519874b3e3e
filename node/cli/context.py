"""What every ``edgenode`` command reads from the click context: the node's config.

The group (``node.cli.main.cli``) stores the ``--config`` path in ``ctx.obj``; a
command run outside the group (tests, embedding) finds none and gets the built-in lookup.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

from broker.errors import EdgeNodeError
from node.config import NodeConfig, load_config
from node.model import cache_dir

#: ``ctx.obj`` key: the run directory of the config a command loaded (``node_config``).
RUN_DIR_KEY = "run_dir"


def node_config(ctx: click.Context) -> NodeConfig:
    """The config the command line names (``--config``/``$EDGENODE_CONFIG``).

    Raises:
        click.ClickException: the file is unreadable or invalid (the ``ConfigError``'s message).
    """
    try:
        config: NodeConfig = load_config(ctx.obj["config"])
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
    # For unusable_dir_error: an OSError later in the command may be about it.
    ctx.obj[RUN_DIR_KEY] = config.run_dir
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
