"""``-c/--config``, ``--run-dir`` and ``--json`` work before and after every
command (``node.cli.context``): parsed by the real ``edgenode`` group, for every
command it has, at every level of a nested group. When given in both places the
one after the command wins; an option typed anywhere beats the environment."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from node.cli.context import config_path, wants_json
from node.cli.main import cli


def command_paths(group: click.Group, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command's name path below ``group`` (groups included; the lazily
    imported ones too, ``node.cli.main.LAZY_COMMANDS``)."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        yield (*prefix, name)
        if isinstance(cmd, click.Group):
            yield from command_paths(cmd, (*prefix, name))


PATHS = list(command_paths(cli))


def required_args(path: tuple[str, ...]) -> list[str]:
    """What follows the options: placeholders for the command's required
    options and arguments; for a group (options between it and its command), its first
    command and that one's."""
    cmd: click.Command = cli
    for name in path:
        assert isinstance(cmd, click.Group)
        cmd = cmd.commands[name]
    if isinstance(cmd, click.Group):
        first = sorted(cmd.commands)[0]
        return [first, *required_args((*path, first))]
    arguments = [
        "x"
        for p in cmd.params
        if isinstance(p, click.Argument) and p.required
        for _ in range(max(1, p.nargs))
    ]
    # A required option (``worker --connect``) with a placeholder value.
    options = [
        x
        for p in cmd.params
        if isinstance(p, click.Option) and p.required
        for x in (p.opts[0], "x")
    ]
    return [*options, *arguments]


def parse(argv: list[str]) -> click.Context:
    """Parse ``edgenode ARGV`` down to its last command, without running it
    (the options' callbacks run, as they do in a real invocation)."""
    ctx = cli.make_context("edgenode", list(argv))
    while isinstance(ctx.command, click.Group):
        with warnings.catch_warnings():  # deprecated in click 8.2, still where the name is
            warnings.simplefilter("ignore", DeprecationWarning)
            rest = [*ctx.protected_args, *ctx.args]
        if not rest:
            break
        _, sub, args = ctx.command.resolve_command(ctx, rest)
        assert sub is not None
        ctx = sub.make_context(sub.name, args, parent=ctx)
    return ctx


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The options export what they are given (children inherit it): restored after each test.
    # (set first: monkeypatch restores only what it saw, and an unset variable it
    # merely "deletes" would stay set by the test after it)
    for name in ("EDGENODE_CONFIG", "EDGENODE_RUN_DIR"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_every_command_is_covered() -> None:
    assert {p[0] for p in PATHS} >= {
        "start",
        "stop",
        "status",
        "ask",
        "rules",
        "report",
        "capacity",
    }
    assert ("rules", "check") in PATHS and ("rules", "test") in PATHS


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
@pytest.mark.parametrize("place", ["before", "after"])
def test_global_options_before_or_after(tmp_path: Path, path: tuple[str, ...], place: str) -> None:
    options = ["-c", str(tmp_path / "a.toml"), "--run-dir", str(tmp_path / "run"), "--json"]
    argv = (
        [*options, *path, *required_args(path)]
        if place == "before"
        else [*path, *options, *required_args(path)]
    )
    ctx = parse(argv)
    assert ctx.command.name in (path[-1], *required_args(path)[:1])
    assert config_path(ctx) == str(tmp_path / "a.toml")
    assert os.environ["EDGENODE_CONFIG"] == str(tmp_path / "a.toml")
    assert os.environ["EDGENODE_RUN_DIR"] == str(tmp_path / "run")
    assert wants_json(ctx)


@pytest.mark.parametrize("path", PATHS, ids=["-".join(p) for p in PATHS])
def test_the_option_after_the_command_wins(tmp_path: Path, path: tuple[str, ...]) -> None:
    before = ["-c", str(tmp_path / "before.toml"), "--run-dir", str(tmp_path / "r1")]
    after = ["--config", str(tmp_path / "after.toml"), "--run-dir", str(tmp_path / "r2")]
    ctx = parse([*before, *path, *after, *required_args(path)])
    assert config_path(ctx) == str(tmp_path / "after.toml")
    assert os.environ["EDGENODE_RUN_DIR"] == str(tmp_path / "r2")
    assert not wants_json(ctx)  # a flag not given is not set


def test_options_beat_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGENODE_CONFIG", str(tmp_path / "env.toml"))
    monkeypatch.setenv("EDGENODE_RUN_DIR", str(tmp_path / "env-run"))
    ctx = parse(["status", "-c", str(tmp_path / "cli.toml"), "--run-dir", str(tmp_path / "cli")])
    assert config_path(ctx) == str(tmp_path / "cli.toml")
    assert os.environ["EDGENODE_RUN_DIR"] == str(tmp_path / "cli")
    # Only the environment (the parse above exported its options): the group's copy reads it.
    monkeypatch.setenv("EDGENODE_CONFIG", str(tmp_path / "env.toml"))
    monkeypatch.setenv("EDGENODE_RUN_DIR", str(tmp_path / "env-run"))
    ctx = parse(["status"])
    assert config_path(ctx) == str(tmp_path / "env.toml")
    assert os.environ["EDGENODE_RUN_DIR"] == str(tmp_path / "env-run")


def test_a_relative_path_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ctx = parse(["status", "-c", "my.toml", "--run-dir", "run"])
    assert config_path(ctx) == str(tmp_path / "my.toml")
    assert os.environ["EDGENODE_RUN_DIR"] == str(tmp_path / "run")
