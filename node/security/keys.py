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
import logging
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

log = logging.getLogger(__name__)


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
    """Copy the public key file into the allowlist ``directory`` (made 0755 if
    missing; the copy is 0644); returns the copy.

    Raises:
        ConfigError: the file is unreadable or not a key file, holds a secret key
            (hand out ``NAME.key``, never ``NAME.key_secret``), a different key
            of that name is already allowed, or the directory is one the node
            would refuse (writable by others, another user's: ``load_allowed``).
    """
    public, secret = _load("edgenode keys allow", public_file)
    if secret is not None:
        raise ConfigError(
            f"{public_file} holds a secret key; allow the public file (NAME.key) instead"
        )
    target = directory / public_file.name
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    # The node would refuse this allowlist at start (``load_allowed``): say so now.
    _check_private("edgenode keys allow", directory, "chmod go-w")
    if target.exists():
        if _load("edgenode keys allow", target)[0] == public:
            return target
        raise ConfigError(f"{target} already allows another key; rename {public_file.name}")
    shutil.copyfile(public_file, target)
    os.chmod(target, 0o644)  # whatever the umask: others may read it, never write it
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

    The allowlist decides who gets in, so it must be as private as a secret
    key file (the checks ssh makes of ``authorized_keys``): the directory and
    each key file owned by this user or root and writable by nobody else.

    Raises:
        ConfigError: the directory is missing or unreadable; it or a key file
            in it is writable by group or others, or owned by another user
            (anyone could then allow a key); a ``*.key`` file holds a secret key
            (it leaks that secret to whoever reads the directory). The message
            names ``key``, the file and the fix.
    """
    if not directory.is_dir():
        raise ConfigError(f"{key}: {directory} is not a directory of public key files")
    _check_private(key, directory, "chmod go-w")
    try:
        files = sorted(directory.glob("*.key"))  # what zmq.auth.load_certificates reads
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read the keys in {directory}: {exc}") from exc
    found = set()
    for path in files:
        if not path.is_file():
            continue
        _check_private(key, path, "chmod 644")
        public, secret = _load(key, path)
        if secret is not None:
            raise ConfigError(
                f"{key}: {path} holds a secret key: an allowlist takes public keys only"
                " (NAME.key); remove it, and make a new keypair if others could read it"
            )
        found.add(public)
    return frozenset(found)


def _check_private(key: str, path: Path, fix: str) -> None:
    """Refuse ``path`` (an allowlist directory or key file) if anyone but its
    owner could change it, or its owner is neither this user nor root.

    Raises:
        ConfigError: naming ``key``, ``path``, its mode or owner, and the fix.
    """
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022:
        raise ConfigError(
            f"{key}: {path} is writable by group or others (mode {mode:o}), so they could"
            f" allow a key of their own; {fix} it"
        )
    if info.st_uid not in (0, os.geteuid()):
        raise ConfigError(
            f"{key}: {path} is owned by another user (uid {info.st_uid}), who could allow a"
            f" key of their own; chown it to the node's user (uid {os.geteuid()}) or root"
        )


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
    ``[security]`` (None for a plaintext side). An allowlist directory with no
    key in it logs a WARNING: only this host's own processes (the local key)
    can then connect on that side.

    Raises:
        ConfigError: a key file or allowlist directory that cannot be used
            (``load_keypair``, ``load_allowed``).
    """
    s = config.security
    extra: frozenset[bytes] = frozenset()
    frontend = backend = None
    if s.server_secret_key:
        pair = load_keypair("security.server_secret_key", Path(s.server_secret_key))
        allowed = load_allowed("security.client_keys", Path(s.client_keys))
        if not allowed:
            log.warning(
                "security.client_keys: %s is empty: no client key allowed: only this host's"
                " own processes can connect (edgenode keys allow NAME.key)",
                s.client_keys,
            )
        frontend = CurveServer(pair.public, pair.secret, allowed | extra)
    if s.backend_secret_key:
        pair = load_keypair("security.backend_secret_key", Path(s.backend_secret_key))
        allowed = (
            load_allowed("security.worker_keys", Path(s.worker_keys))
            if s.worker_keys
            else frozenset()
        )
        if s.worker_keys and not allowed:
            log.warning(
                "security.worker_keys: %s allows no key: only this host's own workers"
                " can register (edgenode keys allow --worker NAME.key)",
                s.worker_keys,
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
