"""CURVE key files (``node.security.keys``), the ``[security]`` config checks and
``node.endpoints.is_loopback``: real files in a temporary directory, real keys."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import zmq.auth

from broker.errors import ConfigError
from broker.security import CurveServer
from node import config as cfg
from node.config import from_dict
from node.endpoints import is_loopback, parse_endpoint
from node.security.keys import (
    allow,
    also_allow,
    client_keys,
    curve_servers,
    generate,
    load_allowed,
    load_keypair,
    local_keypair,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generate_makes_a_public_file_and_a_secret_only_its_owner_reads(tmp_path: Path) -> None:
    public, secret = generate(tmp_path / "keys", "node")
    assert (public.name, secret.name) == ("node.key", "node.key_secret")
    assert mode(secret) == 0o600 and mode(public) == 0o644
    pair = load_keypair("k", secret)
    assert zmq.auth.load_certificate(public) == (pair.public, None)
    assert len(pair.public) == len(pair.secret) == 40


def test_generate_never_overwrites_a_key(tmp_path: Path) -> None:
    _, secret = generate(tmp_path, "node")
    before = secret.read_bytes()
    with pytest.raises(ConfigError, match="exists"):
        generate(tmp_path, "node")
    assert secret.read_bytes() == before


@pytest.mark.parametrize("name", ["", "../evil", "a/b", ".hidden"])
def test_generate_refuses_a_name_that_is_not_a_plain_file_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="plain file name"):
        generate(tmp_path, name)


def test_a_secret_readable_by_others_is_refused(tmp_path: Path) -> None:
    _, secret = generate(tmp_path, "node")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_keypair("security.server_secret_key", secret)


def test_a_public_file_is_no_keypair(tmp_path: Path) -> None:
    public, _ = generate(tmp_path, "node")
    with pytest.raises(ConfigError, match="no secret key"):
        load_keypair("security.server_secret_key", public)


def test_a_missing_key_file_names_its_config_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"security\.backend_secret_key"):
        load_keypair("security.backend_secret_key", tmp_path / "none.key_secret")


def test_allow_copies_a_public_key_and_refuses_secrets_and_clashes(tmp_path: Path) -> None:
    public, secret = generate(tmp_path / "alice", "alice")
    allowed = tmp_path / "clients"
    copy = allow(public, allowed)
    assert copy == allowed / "alice.key"
    assert allow(public, allowed) == copy  # the same key again: nothing to do
    assert load_allowed("security.client_keys", allowed) == {load_keypair("k", secret).public}
    with pytest.raises(ConfigError, match="secret key"):
        allow(secret, allowed)
    other, _ = generate(tmp_path / "other", "alice")  # another key, the same name
    with pytest.raises(ConfigError, match="another key"):
        allow(other, allowed)


def test_an_allowlist_that_is_no_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"security\.client_keys"):
        load_allowed("security.client_keys", tmp_path / "missing")


def test_the_local_keypair_is_made_once_even_when_raced(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    found = []
    threads = [
        threading.Thread(target=lambda: found.append(local_keypair(run_dir))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(found)) == 1  # every caller holds the one key that won
    assert mode(run_dir) == 0o700 and mode(run_dir / "keys") == 0o700
    assert mode(run_dir / "keys" / "local.key_secret") == 0o600
    assert list((run_dir / "keys").iterdir()) == [run_dir / "keys" / "local.key_secret"]


def test_curve_servers_from_the_config_and_the_local_key_allowed(tmp_path: Path) -> None:
    _, node_secret = generate(tmp_path, "node")
    alice, _ = generate(tmp_path / "alice", "alice")
    allow(alice, tmp_path / "clients")
    config = from_dict(
        {
            "security": {
                "server_secret_key": str(node_secret),
                "client_keys": str(tmp_path / "clients"),
            }
        }
    )
    frontend, backend = curve_servers(config)
    assert backend is None
    assert frontend is not None
    assert frontend.public_key == load_keypair("k", node_secret).public
    assert frontend.allowed == {zmq.auth.load_certificate(alice)[0]}
    local = local_keypair(tmp_path / "run")
    widened = also_allow(frontend, local)
    assert widened is not None and widened.allowed == frontend.allowed | {local.public}
    keys = client_keys(config.security, tmp_path / "run")
    assert keys == {
        "server_public_key": frontend.public_key,
        "client_keypair": (local.public, local.secret),
    }
    assert client_keys(cfg.SecuritySection(), tmp_path / "run") == {}


def test_a_curve_server_refuses_a_key_that_is_not_z85_of_32_bytes() -> None:
    with pytest.raises(ValueError, match="40 bytes"):
        CurveServer(b"x" * 40, b"y" * 40, frozenset({b"short"}))


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.2.1:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("ipc:///tmp/x.sock", True),
        ("tcp://*:5555", False),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://192.168.1.20:5555", False),
        ("tcp://[fe80::1]:5555", False),
    ],
)
def test_which_endpoints_only_this_host_reaches(endpoint: str, loopback: bool) -> None:
    assert is_loopback(parse_endpoint("node.frontend", endpoint)) is loopback


@pytest.mark.parametrize(
    ("node", "key"),
    [
        ({"frontend": "tcp://*:5555"}, "node.frontend"),
        ({"frontend": "tcp://192.168.1.20:5555"}, "node.frontend"),
        ({"backend": "tcp://0.0.0.0:5556"}, "node.backend"),
    ],
)
def test_plaintext_where_other_hosts_reach_is_refused_unless_allowed(
    node: dict[str, str], key: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        cfg.validate(from_dict({"node": node}))
    assert key in refused.value.message and "allow_plaintext" in refused.value.message
    allowed = cfg.validate(from_dict({"node": node, "security": {"allow_plaintext": True}}))
    assert allowed.security.allow_plaintext


def test_curve_lifts_the_plaintext_refusal_side_by_side() -> None:
    secured = {"server_secret_key": "/k/node.key_secret", "client_keys": "/k/clients"}
    cfg.validate(from_dict({"node": {"frontend": "tcp://*:5555"}, "security": secured}))
    # The backend is a side of its own: the frontend's key does not cover it.
    with pytest.raises(ConfigError, match=r"node\.backend"):
        cfg.validate(
            from_dict(
                {
                    "node": {"frontend": "tcp://*:5555", "backend": "tcp://*:5556"},
                    "security": secured,
                }
            )
        )


@pytest.mark.parametrize(
    ("security", "message"),
    [
        ({"server_secret_key": "/k/node.key_secret"}, "go together"),
        ({"client_keys": "/k/clients"}, "go together"),
        ({"worker_keys": "/k/workers"}, "needs security.backend_secret_key"),
    ],
)
def test_keys_come_with_their_allowlist(security: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        cfg.validate(from_dict({"security": security}))


def an_allowlist(tmp_path: Path) -> tuple[Path, Path]:
    """An allowlist directory with alice's public key allowed; (directory, key file)."""
    public, _ = generate(tmp_path / "alice", "alice")
    copy = allow(public, tmp_path / "clients")
    return tmp_path / "clients", copy


@pytest.mark.parametrize("dir_mode", [0o777, 0o775, 0o757, 0o1777])
def test_an_allowlist_directory_others_can_write_to_is_refused(
    tmp_path: Path, dir_mode: int
) -> None:
    directory, _ = an_allowlist(tmp_path)
    directory.chmod(dir_mode)
    with pytest.raises(ConfigError) as refused:
        load_allowed("security.client_keys", directory)
    message = refused.value.message
    assert "security.client_keys" in message and str(directory) in message
    assert "writable by group or others" in message and "chmod go-w" in message
    directory.chmod(0o755)
    assert len(load_allowed("security.client_keys", directory)) == 1


@pytest.mark.parametrize("file_mode", [0o666, 0o646, 0o664])
def test_a_key_file_others_can_write_to_is_refused(tmp_path: Path, file_mode: int) -> None:
    directory, key = an_allowlist(tmp_path)
    key.chmod(file_mode)
    with pytest.raises(ConfigError) as refused:
        load_allowed("security.worker_keys", directory)
    message = refused.value.message
    assert "security.worker_keys" in message and str(key) in message and "chmod 644" in message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
@pytest.mark.parametrize("which", ["directory", "key"])
def test_an_allowlist_owned_by_another_user_is_refused(tmp_path: Path, which: str) -> None:
    directory, key = an_allowlist(tmp_path)
    path = directory if which == "directory" else key
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(ConfigError) as refused:
        load_allowed("security.client_keys", directory)
    message = refused.value.message
    assert str(path) in message and "owned by another user (uid 65534)" in message
    assert "chown" in message


def test_a_secret_key_file_in_an_allowlist_is_refused(tmp_path: Path) -> None:
    directory, _ = an_allowlist(tmp_path)
    _, secret = generate(tmp_path / "bad", "bad")
    shutil.copyfile(secret, directory / "bad.key")  # a secret renamed as a public key
    with pytest.raises(ConfigError) as refused:
        load_allowed("security.client_keys", directory)
    message = refused.value.message
    assert str(directory / "bad.key") in message and "holds a secret key" in message


def test_an_empty_client_allowlist_starts_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, node_secret = generate(tmp_path, "node")
    (tmp_path / "clients").mkdir()
    (tmp_path / "workers").mkdir()
    _, backend_secret = generate(tmp_path, "backend")
    config = from_dict(
        {
            "security": {
                "server_secret_key": str(node_secret),
                "client_keys": str(tmp_path / "clients"),
                "backend_secret_key": str(backend_secret),
                "worker_keys": str(tmp_path / "workers"),
            }
        }
    )
    with caplog.at_level(logging.WARNING, logger="node.security.keys"):
        frontend, backend = curve_servers(config)
    assert frontend is not None and frontend.allowed == frozenset()
    assert backend is not None and backend.allowed == frozenset()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "no client key allowed: only this host's own processes can connect" in warnings[0]
    assert "security.worker_keys" in warnings[1]
    # One allowed key: no warning.
    allow(generate(tmp_path / "alice", "alice")[0], tmp_path / "clients")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="node.security.keys"):
        curve_servers(config)
    assert not [r for r in caplog.records if "security.client_keys" in r.getMessage()]


def test_allow_refuses_a_directory_others_can_write_to_and_copies_0644_whatever_the_umask(
    tmp_path: Path,
) -> None:
    public, _ = generate(tmp_path / "alice", "alice")
    old = os.umask(0)
    try:
        copy = allow(public, tmp_path / "clients")
    finally:
        os.umask(old)
    assert mode(copy) == 0o644 and mode(tmp_path / "clients") == 0o755
    load_allowed("security.client_keys", tmp_path / "clients")  # the node takes it
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(ConfigError, match="chmod go-w"):
        allow(public, loose)
    assert list(loose.iterdir()) == []
