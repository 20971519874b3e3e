"""Node configuration: frozen dataclasses loaded from TOML and validated once.

Every key is documented in ``etc/edgenode.toml``, whose values equal the
defaults below (a unit test keeps them in step). Lookup order for the file:
``--config`` > ``$EDGENODE_CONFIG`` > ``/etc/edgenode/edgenode.toml`` > built-in
defaults. ``$EDGENODE_RUN_DIR`` overrides ``node.run_dir``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker.core import BrokerSettings
from broker.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

SYSTEM_CONFIG = Path("/etc/edgenode/edgenode.toml")
ENGINES = ("llama", "test")


@dataclass(frozen=True)
class NodeSection:
    """Where the node lives: run directory, endpoints, logging."""

    run_dir: str = ""
    frontend: str = ""
    backend: str = ""
    log_level: str = "info"
    start_timeout_ms: int = 120_000


@dataclass(frozen=True)
class ModelSection:
    """Which GGUF model the workers load and how (llama.cpp context parameters)."""

    path: str = "default"
    n_ctx: int = 2048
    n_batch: int = 512
    chat_format: str = ""
    repack: bool = False


@dataclass(frozen=True)
class WorkersSection:
    """The worker pool: how many processes, which engine, how they start and stop."""

    count: int = 2
    engine: str = "llama"
    threads: int = 1
    ready_timeout_ms: int = 60_000
    stop_grace_ms: int = 5000
    restart_backoff_ms: int = 500
    restart_backoff_max_ms: int = 30_000
    test_token_ms: int = 20
    test_load_ms: int = 0


@dataclass(frozen=True)
class NodeConfig:
    """The whole configuration. Picklable and JSON-able, so workers get a copy."""

    node: NodeSection = field(default_factory=NodeSection)
    model: ModelSection = field(default_factory=ModelSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    source: str = "built-in defaults"

    @property
    def run_dir(self) -> Path:
        """The run directory (pidfile, sockets, logs), resolved as documented."""
        return resolve_run_dir(self.node.run_dir)

    @property
    def frontend(self) -> str:
        """The client endpoint."""
        return self.node.frontend or f"ipc://{self.run_dir}/frontend.sock"

    @property
    def backend(self) -> str:
        """The worker endpoint (its ipc directory is made 0700)."""
        return self.node.backend or f"ipc://{self.run_dir}/workers/backend.sock"


def resolve_run_dir(configured: str = "") -> Path:
    """``$EDGENODE_RUN_DIR`` > ``configured`` > ``$XDG_RUNTIME_DIR/edgenode`` >
    ``/tmp/edgenode-<uid>``."""
    env = os.environ.get("EDGENODE_RUN_DIR")
    if env:
        return Path(env)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "edgenode"
    return Path(f"/tmp/edgenode-{os.getuid()}")


def config_path(explicit: str | None) -> Path | None:
    """The config file to read, or None for built-in defaults."""
    if explicit:
        return Path(explicit)
    env = os.environ.get("EDGENODE_CONFIG")
    if env:
        return Path(env)
    return SYSTEM_CONFIG if SYSTEM_CONFIG.exists() else None


def load_config(path: str | None = None) -> NodeConfig:
    """Read and validate the configuration.

    Raises:
        ConfigError: unreadable file, unknown section or key, wrong type or an
            out-of-range value; the message names the key.
    """
    chosen = config_path(path)
    if chosen is None:
        return validate(NodeConfig())
    try:
        data = tomllib.loads(chosen.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config {chosen}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {chosen} is not valid TOML: {exc}") from exc
    return validate(from_dict(data, source=str(chosen)))


def from_dict(data: dict[str, Any], source: str = "dict") -> NodeConfig:
    """Build a ``NodeConfig`` from parsed TOML (or a dict of the same shape)."""
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            raise ConfigError(f"[{name}] must be a table")
        sections[name] = _build(cls, raw, name)
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"unknown config section [{unknown[0]}]")
    return NodeConfig(**sections, source=source)


def to_dict(config: NodeConfig) -> dict[str, Any]:
    """The configuration as plain data (for handing to worker processes)."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in _SECTIONS}


def validate(config: NodeConfig) -> NodeConfig:
    """Check ranges and choices once, at start.

    Raises:
        ConfigError: the first invalid value found, with its key.
    """
    w, m, b = config.workers, config.model, config.broker
    _positive("workers.count", w.count, 0)
    _choice("workers.engine", w.engine, ENGINES)
    _choice("node.log_level", config.node.log_level, ("debug", "info", "warning", "error"))
    _positive("workers.threads", w.threads, 1)
    _positive("model.n_ctx", m.n_ctx, 64)
    _positive("model.n_batch", m.n_batch, 1)
    for name in (
        "max_queue",
        "default_timeout_ms",
        "max_timeout_ms",
        "default_max_tokens",
        "heartbeat_interval_ms",
        "heartbeat_liveness",
        "stall_timeout_ms",
        "cancel_grace_ms",
        "max_body_bytes",
    ):
        _positive(f"broker.{name}", getattr(b, name), 1)
    if b.default_timeout_ms > b.max_timeout_ms:
        raise ConfigError("broker.default_timeout_ms must not exceed broker.max_timeout_ms")
    if not m.path:
        raise ConfigError("model.path must be 'default' or a path to a GGUF file")
    return config


_SECTIONS: dict[str, type] = {
    "node": NodeSection,
    "model": ModelSection,
    "workers": WorkersSection,
    "broker": BrokerSettings,
}


def _build(cls: type, raw: dict[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown config key {section}.{key}")
        expected = type(getattr(cls(), key))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if type(value) is not expected:
            raise ConfigError(
                f"{section}.{key} must be {expected.__name__}, got {type(value).__name__}"
            )
    return cls(**raw)


def _positive(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
