"""CURVE key files: generate, allow, load (pyzmq's ``zmq.auth`` certificate format).

A keypair is two files made by ``zmq.auth.create_certificates``: ``NAME.key``
(the public key, to hand out) and ``NAME.key_secret`` (both keys; mode 0600,
never leaves its host). An allowlist is a directory of public key files
(``edgenode keys allow`` copies one in); ``zmq.auth.load_certificates`` reads it.

The node's own processes hold one more keypair, the *local* key, made at the
first need in ``<run dir>/keys/local.key_secret`` (the run directory is 0700):
the node allows it on its CURVE sockets, so its workers (on a CURVE backend)
and ``edgenode status``/``ask``/``start`` on this host (as the node's user) get
in without an operator listing them.

Raises ``ConfigError`` naming the ``[security]`` key for every file problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.auth

from broker.errors import ConfigError
from broker.security import CurveServer
from node.config import NodeConfig, SecuritySection

#: The local keypair's name in ``<run dir>/keys``.
LOCAL_KEY = "local"
#: A secret key file's mode: owner read/write only (as ssh demands of its keys).
SECRET_MODE = 0o600


@dataclass(frozen=True)
class Keypair:
    """A CURVE keypair, Z85 text (40 bytes each)."""

    public: bytes
    secret: bytes


def generate(directory: Path, name: str) -> tuple[Path, Path]:
    """Make ``directory/NAME.key`` and ``NAME.key_secret`` (0600); returns both paths.

    Raises:
        ConfigError: ``name`` is not a plain file name, or either file exists
            (a key is never overwritten: clients may already trust it).
    """
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name")
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists; remove it first or choose another name")
    directory.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret is never readable by others, not even briefly
    try:
        made_public, made_secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(made_secret, SECRET_MODE)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def allow(public_file: Path, directory: Path) -> Path:
    """Copy the public key file into the allowlist ``directory``; returns the copy.

    Raises:
        ConfigError: the file is unreadable or not a key file, holds a secret key
            (hand out ``NAME.key``, never ``NAME.key_secret``), or a different key
            of that name is already allowed.
    """
    public, secret = _load("edgenode keys allow", public_file)
    if secret is not None:
        raise ConfigError(
            f"{public_file} holds a secret key; allow the public file (NAME.key) instead"
        )
    target = directory / public_file.name
    if target.exists():
        if _load("edgenode keys allow", target)[0] == public:
            return target
        raise ConfigError(f"{target} already allows another key; rename {public_file.name}")
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(public_file, target)
    return target


def load_keypair(key: str, path: Path) -> Keypair:
    """The keypair in a ``NAME.key_secret`` file named by config key ``key``.

    Raises:
        ConfigError: unreadable, no secret key in it, or readable by group or others.
    """
    public, secret = _load(key, path)
    if secret is None:
        raise ConfigError(f"{key}: {path} holds no secret key (give NAME.key_secret)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{key}: {path} is readable by others (mode {mode:o}); chmod 600 it")
    return Keypair(public, secret)


def load_public(key: str, path: Path) -> bytes:
    """The public key (Z85) in a key file (``NAME.key``, or a ``NAME.key_secret``)
    named by config key or option ``key``: e.g. the gateway's backend key a host
    agent's workers must find at the other end (``node.remote.agent``).

    Raises:
        ConfigError: unreadable, or not a key file.
    """
    return _load(key, path)[0]


def load_allowed(key: str, directory: Path) -> frozenset[bytes]:
    """The public keys (Z85) of every ``*.key`` file in ``directory``.

    Raises:
        ConfigError: the directory is missing or unreadable.
    """
    if not directory.is_dir():
        raise ConfigError(f"{key}: {directory} is not a directory of public key files")
    try:
        found = zmq.auth.load_certificates(directory)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read the keys in {directory}: {exc}") from exc
    return frozenset(found)


def local_keypair(run_dir: Path) -> Keypair:
    """The node's local keypair (see the module docstring), made if missing.

    Safe to race (``edgenode start`` and its node both ask): the file is made
    aside and linked into place, so every caller reads the one that won.
    """
    final = local_key_file(run_dir)
    keys = final.parent
    if not final.exists():
        run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        keys.mkdir(mode=0o700, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=keys) as aside:
            _, secret = generate(Path(aside), LOCAL_KEY)
            with contextlib.suppress(FileExistsError):
                os.link(secret, final)
    return load_keypair("local key", final)


def local_key_file(run_dir: Path) -> Path:
    """Where ``local_keypair`` keeps the local keypair (for the workers' ``WorkerSpec``)."""
    return run_dir / "keys" / f"{LOCAL_KEY}.key_secret"


def also_allow(server: CurveServer | None, key: Keypair) -> CurveServer | None:
    """``server`` with ``key``'s public key allowed too (None stays None)."""
    if server is None:
        return None
    return dataclasses.replace(server, allowed=server.allowed | {key.public})


def curve_servers(config: NodeConfig) -> tuple[CurveServer | None, CurveServer | None]:
    """The frontend's and the backend's CURVE keys and allowlists from
    ``[security]`` (None for a plaintext side).

    Raises:
        ConfigError: a key file or allowlist directory that cannot be used.
    """
    s = config.security
    extra: frozenset[bytes] = frozenset()
    frontend = backend = None
    if s.server_secret_key:
        pair = load_keypair("security.server_secret_key", Path(s.server_secret_key))
        allowed = load_allowed("security.client_keys", Path(s.client_keys))
        frontend = CurveServer(pair.public, pair.secret, allowed | extra)
    if s.backend_secret_key:
        pair = load_keypair("security.backend_secret_key", Path(s.backend_secret_key))
        allowed = (
            load_allowed("security.worker_keys", Path(s.worker_keys))
            if s.worker_keys
            else frozenset()
        )
        backend = CurveServer(pair.public, pair.secret, allowed | extra)
    return frontend, backend


def client_keys(security: SecuritySection, run_dir: Path) -> dict[str, Any]:
    """The ``Client`` keywords for a process of this host talking to the node of
    ``run_dir`` (its ``[security]`` is ``security``):
    ``server_public_key`` and the local ``client_keypair`` with a CURVE frontend,
    nothing without.

    Raises:
        ConfigError: the server key file cannot be read.
    """
    s = security
    if not s.server_secret_key:
        return {}
    server = _load("security.server_secret_key", Path(s.server_secret_key))[0]
    local = local_keypair(run_dir)
    return {"server_public_key": server, "client_keypair": (local.public, local.secret)}


def _load(key: str, path: Path) -> tuple[bytes, bytes | None]:
    """``zmq.auth.load_certificate`` with a ``ConfigError`` naming ``key``."""
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: cannot read a CURVE key from {path}: {exc}") from exc
