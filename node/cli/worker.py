"""``edgenode worker``: run this board's workers for a node on another board."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from broker.errors import EdgeNodeError
from node.cli.context import node_config
from node.remote.agent import HostAgent, agent_config, agent_name


@click.command()
@click.option(
    "--connect",
    required=True,
    metavar="ENDPOINT",
    help="The gateway node's backend, e.g. tcp://gateway:5556 (its node.backend).",
)
@click.option(
    "--name",
    help="This agent's name, the prefix of its worker ids (NAME.llm-0) (default: the host name).",
)
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(),
    help="This board's config (workers, model, capacity, node.cpus, node.run_dir); "
    "the same as the group's --config.",
)
@click.pass_context
def worker(ctx: click.Context, connect: str, name: str | None, config_path: str | None) -> None:
    """Run this board's model workers (a host agent) for the node at --connect.

    The agent owns this board's cgroups, cores and capacity plan and supervises
    its workers (restarts with backoff); the workers register with the gateway's
    broker as NAME.llm-N. It runs in the foreground until SIGTERM or Ctrl-C.
    """
    if config_path:
        ctx.obj["config"] = str(Path(config_path).resolve())
        os.environ["EDGENODE_CONFIG"] = ctx.obj["config"]
    config = node_config(ctx)
    logging.basicConfig(
        level=config.node.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    try:
        agent = HostAgent(agent_config(config, connect), agent_name(name))
        sys.exit(agent.run())
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
