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

from broker.breaker import BreakerSettings
from broker.core import BrokerSettings
from broker.errors import ConfigError
from broker.routing import MODES, RoutingSettings
from node.units import parse_cores
from node.worker_memory import validate_memory

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

SYSTEM_CONFIG = Path("/etc/edgenode/edgenode.toml")
ENGINES = ("llama", "test")
#: The most sequences (slots) one worker may run: ``workers.slots`` in [1, MAX_SLOTS].
MAX_SLOTS = 64
#: ``workers.slots = "auto"``: sized by ``node.capacity.resolve_slots``.
AUTO_SLOTS = "auto"


@dataclass(frozen=True)
class NodeSection:
    """Where the node lives: run directory, endpoints, logging."""

    run_dir: str = ""
    frontend: str = ""
    backend: str = ""
    log_level: str = "info"
    start_timeout_ms: int = 120_000
    cpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelSection:
    """Which GGUF model the workers load and how (llama.cpp context parameters)."""

    path: str = "default"
    n_ctx: int = 2048
    n_batch: int = 512
    chat_format: str = ""
    repack: bool = False
    kv_type: str = "f16"


@dataclass(frozen=True)
class WorkersSection:
    """The worker pool: how many processes, which engine, how they start and stop."""

    count: int = 1
    engine: str = "llama"
    threads: int = 2
    #: Sequences per model worker: an integer in [1, ``MAX_SLOTS``] or "auto"
    #: (``node.capacity.resolve_slots`` turns it into an int at start).
    slots: int | str = 4
    ready_timeout_ms: int = 60_000
    stop_grace_ms: int = 5000
    restart_backoff_ms: int = 500
    restart_backoff_max_ms: int = 30_000
    test_token_ms: int = 20
    test_load_ms: int = 0
    #: Bytes; a worker's log above it is rotated when the worker (re)spawns (0 = never).
    log_max_bytes: int = 4 * 1024 * 1024
    # Isolation (issue 4): see etc/edgenode.toml, node/sandbox.py and node/affinity.py.
    sandbox: str = "auto"
    cgroup_root: str = ""
    memory_max: str | int = "1G"
    memory_high: str | int = ""
    cpu_quota: str | float = "max"
    cpus: tuple[int, ...] = ()
    nice: int = 10


@dataclass(frozen=True)
class CapacitySection:
    """The memory budget the capacity model plans against (see ``node.capacity``).

    Sizes are strings in binary units ("8G" = 8 GiB, "256M" = 256 MiB).
    """

    memory_budget: str = ""
    reserve: str = "1G"
    safety_margin: float = 0.1
    runtime_overhead: str = "88M"


@dataclass(frozen=True)
class FallbackSection:
    """The rule engine and the migration log.

    ``rules``: "default" (the set shipped with edgenode, = etc/rules.toml), a
    path, or "" for no rule worker. The log is ``<run_dir>/logs/migration.jsonl``,
    rotated at ``log_max_bytes`` with ``log_backups`` old files; rule answers
    below ``low_confidence`` are flagged for offline review.
    """

    rules: str = "default"
    low_confidence: float = 0.5
    log_max_bytes: int = 10 * 1024 * 1024
    log_backups: int = 3


@dataclass(frozen=True)
class PressureSection:
    """``[pressure]``: watermarks in percent of the budget, poll period in ms.

    ``budget`` = "" uses the node cgroup's own limit when it has one (systemd's
    MemoryMax), else the sum of the workers' limits; or a size like "3G".
    """

    high_pct: float = 85.0
    critical_pct: float = 95.0
    clear_pct: float = 75.0
    poll_ms: int = 250
    budget: str = ""


@dataclass(frozen=True)
class NodeConfig:
    """The whole configuration. Picklable and JSON-able, so workers get a copy."""

    node: NodeSection = field(default_factory=NodeSection)
    model: ModelSection = field(default_factory=ModelSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    capacity: CapacitySection = field(default_factory=CapacitySection)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    fallback: FallbackSection = field(default_factory=FallbackSection)
    pressure: PressureSection = field(default_factory=PressureSection)
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
    """The configuration as plain TOML/JSON data (tuples become lists)."""

    def plain(section: Any) -> dict[str, Any]:
        raw = dataclasses.asdict(section)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in raw.items()}

    return {name: plain(getattr(config, name)) for name in _SECTIONS}


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
    _slots(w.slots)
    _positive("workers.log_max_bytes", w.log_max_bytes, 0)
    _positive("model.n_ctx", m.n_ctx, 64)
    _positive("model.n_batch", m.n_batch, 1)
    _positive("broker.max_queue", b.max_queue, 0)  # 0 = 8 per pool slot
    for name in (
        "max_in_flight_per_client",
        "default_timeout_ms",
        "max_timeout_ms",
        "default_max_tokens",
        "heartbeat_interval_ms",
        "heartbeat_liveness",
        "stall_timeout_ms",
        "cancel_grace_ms",
        "max_body_bytes",
        "client_backlog",
    ):
        _positive(f"broker.{name}", getattr(b, name), 1)
    if b.default_timeout_ms > b.max_timeout_ms:
        raise ConfigError("broker.default_timeout_ms must not exceed broker.max_timeout_ms")
    if not m.path:
        raise ConfigError("model.path must be 'default' or a path to a GGUF file")
    _validate_isolation(w)
    _core_list("node.cpus", config.node.cpus)
    _choice("routing.mode", config.routing.mode, MODES)
    _positive("routing.ttft_budget_ms", config.routing.ttft_budget_ms, 0)
    p = config.pressure
    if not 0 < p.clear_pct <= p.high_pct <= p.critical_pct <= 100:
        raise ConfigError("pressure needs 0 < clear_pct <= high_pct <= critical_pct <= 100")
    if not 0.0 <= config.fallback.low_confidence <= 1.0:
        raise ConfigError("fallback.low_confidence must be in [0, 1]")
    return config


_SECTIONS: dict[str, type] = {
    "node": NodeSection,
    "model": ModelSection,
    "workers": WorkersSection,
    "broker": BrokerSettings,
    "capacity": CapacitySection,
    "routing": RoutingSettings,
    "breaker": BreakerSettings,
    "fallback": FallbackSection,
    "pressure": PressureSection,
}


#: Keys whose value may also have these types besides the default's (sizes as
#: integer bytes, CPU quotas as numbers of cores).
_ALSO_ACCEPTS: dict[str, tuple[type, ...]] = {
    "workers.memory_max": (int,),
    "workers.memory_high": (int,),
    "workers.cpu_quota": (int, float),
    "workers.slots": (str,),
}


def _build(cls: type, raw: dict[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(raw)
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown config key {section}.{key}")
        expected = type(getattr(cls(), key))
        if expected is tuple and isinstance(value, list):
            # TOML arrays become tuples: frozen configs stay immutable and hashable.
            values[key] = _int_tuple(f"{section}.{key}", value)
            continue
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        also = _ALSO_ACCEPTS.get(f"{section}.{key}", ())
        if isinstance(value, also) and not isinstance(value, bool):
            continue
        if type(value) is not expected:
            raise ConfigError(
                f"{section}.{key} must be {expected.__name__}, got {type(value).__name__}"
            )
    return cls(**values)


def _int_tuple(key: str, value: list[Any]) -> tuple[int, ...]:
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ConfigError(f"{key} must be a list of integers, got {value!r}")
    return tuple(value)


SANDBOX_MODES = ("auto", "required", "off")


def _validate_isolation(w: WorkersSection) -> None:
    """The sandbox and affinity keys (issue 4); cores are checked against the
    host's allowed set later, by ``node.affinity.plan_cpus`` at start."""
    _choice("workers.sandbox", w.sandbox, SANDBOX_MODES)
    if w.cgroup_root and (not w.cgroup_root.startswith("/") or ".." in w.cgroup_root.split("/")):
        raise ConfigError(
            f'workers.cgroup_root must be "" or a cgroup path like "/edgenode.slice", '
            f"got {w.cgroup_root!r}"
        )
    validate_memory(w)  # a size or "max"; "auto" is checked against the plan at start
    try:
        parse_cores(w.cpu_quota)
    except ValueError as exc:
        raise ConfigError(f"workers.cpu_quota: {exc}") from exc
    _core_list("workers.cpus", w.cpus)
    if not 0 <= w.nice <= 19:
        raise ConfigError(f"workers.nice must be 0..19, got {w.nice}")


def is_auto_slots(slots: int | str) -> bool:
    """Whether ``workers.slots`` is "auto" (any case, spaces around allowed)."""
    return isinstance(slots, str) and slots.strip().lower() == AUTO_SLOTS


def _slots(slots: int | str) -> None:
    """``workers.slots``: an integer in [1, MAX_SLOTS] or "auto".

    Raises:
        ConfigError: anything else, naming the key.
    """
    if is_auto_slots(slots):
        return
    if isinstance(slots, str) or not 1 <= slots <= MAX_SLOTS:
        raise ConfigError(
            f'workers.slots must be an integer in [1, {MAX_SLOTS}] or "auto", got {slots!r}'
        )


def _core_list(key: str, cpus: tuple[int, ...]) -> None:
    if any(c < 0 for c in cpus) or len(set(cpus)) != len(cpus):
        raise ConfigError(f"{key} must list distinct core numbers >= 0, got {list(cpus)}")


def _positive(key: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
