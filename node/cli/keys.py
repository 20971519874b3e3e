"""``edgenode keys``: make CURVE keypairs and allow public keys (``node.security.keys``).

Register with ``cli.add_command(keys)`` in ``node.cli.main``. ``generate`` needs no
config; ``allow`` copies a public key into the allowlist directory the config names
(``security.client_keys``, or ``security.worker_keys`` with ``--worker``). A running
node reads its allowlists at start: restart it to apply a change.

Exit codes: 0 done, 1 a file problem (the message says which file and why).
"""

from __future__ import annotations

from pathlib import Path

import click

from broker.errors import ConfigError
from node.cli.context import node_config
from node.security.keys import allow as allow_key
from node.security.keys import generate as generate_keys


@click.group()
def keys() -> None:
    """Manage CURVE keys: keypairs for the node, its clients and remote workers."""


@keys.command()
@click.argument("name")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("."),
    show_default=True,
    help="Where to write NAME.key and NAME.key_secret.",
)
def generate(name: str, directory: Path) -> None:
    """Make a keypair: NAME.key (public, hand it out) and NAME.key_secret (mode 0600)."""
    try:
        public, secret = generate_keys(directory, name)
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(f"public key: {public}")
    click.echo(f"secret key: {secret} (mode 0600; keep it on this host)")


@keys.command()
@click.argument("public_key_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--worker",
    is_flag=True,
    help="Allow it on the backend (security.worker_keys) instead of the frontend.",
)
@click.pass_context
def allow(ctx: click.Context, public_key_file: Path, worker: bool) -> None:
    """Allow the key in PUBLIC_KEY_FILE (NAME.key) to connect."""
    s = node_config(ctx).security
    key, directory = (
        ("security.worker_keys", s.worker_keys)
        if worker
        else ("security.client_keys", s.client_keys)
    )
    if not directory:
        raise click.ClickException(f"{key} is not set in the config: name the allowlist directory")
    try:
        target = allow_key(public_key_file, Path(directory))
    except ConfigError as exc:
        raise click.ClickException(exc.message) from exc
    click.echo(f"allowed: {target} (restart the node to apply)")
