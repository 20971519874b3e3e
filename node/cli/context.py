"""What every ``edgenode`` command reads from the click context: the node's config.

The group (``node.cli.main.cli``) stores the ``--config`` path in ``ctx.obj``; a
command run outside the group (tests, embedding) finds none and gets the built-in lookup.
"""

from __future__ import annotations

import click

from broker.errors import EdgeNodeError
from node.config import NodeConfig, load_config


def node_config(ctx: click.Context) -> NodeConfig:
    """The config the command line names (``--config``/``$EDGENODE_CONFIG``).

    Raises:
        click.ClickException: the file is unreadable or invalid (the ``ConfigError``'s message).
    """
    try:
        config: NodeConfig = load_config(ctx.obj["config"])
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
    return config
