"""``edgenode worker``: run this board's workers for a node on another board."""

from __future__ import annotations

import sys

import click

from broker.errors import EdgeNodeError
from node.cli.context import node_config
from node.observe.logs import configure as configure_logs
from node.remote.agent import AGENT_ROLE, HostAgent, agent_config, agent_keys, agent_name


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
    "--key",
    type=click.Path(dir_okay=False),
    help="This agent's keypair (NAME.key_secret, mode 0600) for a CURVE backend; the "
    "gateway allows its NAME.key with `edgenode keys allow --worker`.",
)
@click.option(
    "--server-key",
    type=click.Path(dir_okay=False),
    help="The gateway's backend public key file (NAME.key of its backend_secret_key).",
)
@click.pass_context
def worker(
    ctx: click.Context,
    connect: str,
    name: str | None,
    key: str | None,
    server_key: str | None,
) -> None:
    """Run this board's model workers (a host agent) for the node at --connect.

    The agent owns this board's cgroups, cores and capacity plan and supervises
    its workers (restarts with backoff); the workers register with the gateway's
    broker as NAME.llm-N, and with --key and --server-key prove this agent's key
    to the gateway's CURVE backend. It runs in the foreground until SIGTERM or Ctrl-C.
    -c/--config is this board's config (workers, model, capacity, node.cpus,
    node.run_dir, security.allow_plaintext).
    """
    config = node_config(ctx)
    configure_logs(config.node.log_level, config.logging.format, AGENT_ROLE)
    try:
        keys = agent_keys(key, server_key)
        agent = HostAgent(agent_config(config, connect, keys), agent_name(name), keys)
        sys.exit(agent.run())
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
