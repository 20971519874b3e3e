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
from typing import Any, Literal, get_args

from broker.breaker import BreakerSettings
from broker.client_request import MAX_TOKENS_LIMIT
from broker.errors import ConfigError
from broker.kinds import ROUTING_MODES
from broker.protocol import message_limits
from broker.records import BrokerSettings
from broker.routing import RoutingSettings
from node.capacity.worker_limits import validate_memory
from node.endpoints import is_loopback, parse_endpoint
from node.engine import ModelEngineName
from node.observe.listen import parse_listen
from node.observe.logs import LOG_FORMATS, LogFormat
from node.sandbox.driver import SANDBOX_MODES, SandboxMode
from node.sandbox.niceness import check_slice
from node.units import parse_cores, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

SYSTEM_CONFIG = Path("/etc/edgenode/edgenode.toml")
ENGINES: tuple[str, ...] = get_args(ModelEngineName)
#: The node's ipc socket files in its run directory, when ``node.frontend`` /
#: ``node.backend`` are not set (the node removes them when it stops).
FRONTEND_SOCKET = "frontend.sock"
BACKEND_SOCKET = "workers/backend.sock"
#: The most sequences (slots) one worker may run: ``workers.slots`` in [1, MAX_SLOTS].
MAX_SLOTS = 64
#: ``workers.slots = "auto"``: sized by ``node.capacity.plan.resolve_slots``.
AUTO_SLOTS = "auto"
#: ``workers.cpus = "auto"``: the host keeps the first allowed core, the node the
#: rest (``node.sandbox.cores.reserved_cores``); a list names the cores, [] none.
AUTO_CORES: Literal["auto"] = "auto"
#: ``workers.cpus``: the cores reserved for the workers, or "auto".
CoreSetting = tuple[int, ...] | Literal["auto"]


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
    flash_attn: bool = True  # node.engine.flash_attn_on: why on, and what it changes


@dataclass(frozen=True)
class WorkersSection:
    """The worker pool: how many processes, which engine, how they start and stop."""

    count: int = 1
    engine: ModelEngineName = "llama"
    threads: int = 2
    #: Compute on one thread while the host starves the workers' threads
    #: (``node.llama.threads``); false keeps ``threads`` always.
    adaptive_threads: bool = True
    #: Sequences per model worker: an integer in [1, ``MAX_SLOTS``] or "auto"
    #: (``node.capacity.plan.resolve_slots`` turns it into an int at start).
    slots: int | str = 4
    ready_timeout_ms: int = 60_000
    stop_grace_ms: int = 5000
    restart_backoff_ms: int = 500
    restart_backoff_max_ms: int = 30_000
    test_token_ms: int = 20
    test_load_ms: int = 0
    #: Bytes; a worker's log above it is rotated when the worker (re)spawns (0 = never).
    log_max_bytes: int = 4 * 1024 * 1024
    # Isolation: see etc/edgenode.toml, node.sandbox.cgroups and node.sandbox.cores.
    sandbox: SandboxMode = "auto"
    cgroup_root: str = ""
    memory_max: str | int = "1G"
    memory_high: str | int = ""
    cpu_quota: str | float = "max"
    #: Reserved cores; "auto" leaves the first allowed core to the host (one-core hosts
    #: share it), [] reserves none (node.sandbox.cores.reserved_cores).
    cpus: CoreSetting = AUTO_CORES
    nice: int = 10
    #: µs; the model workers' scheduler slice (node.sandbox.niceness.set_slice), 0 = the kernel's.
    slice_us: int = 100
    #: The model workers' ``oom_score_adj`` (node.sandbox.oom): the OOM killer takes them first.
    oom_score_adj: int = 500


@dataclass(frozen=True)
class CapacitySection:
    """The memory budget the capacity model plans against (see ``node.capacity.plan``).

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
    """``[pressure]``: memory watermarks in percent of the budget, poll period in ms,
    and the host's CPU pressure line.

    ``budget`` = "" uses the tightest memory limit on the node's cgroup path
    (``node.capacity.budget``: systemd's MemoryMax, a parent's limit), else the sum of
    the workers' limits; or a size like "3G" (never above that cgroup limit).
    ``cpu_warn_pct`` / ``cpu_clear_pct``: PSI ``some avg10`` (percent of the
    last ~10 s in which a runnable task waited for a CPU, ``node.pressure``) at
    which CPU pressure becomes ``high`` and below which it is ``ok`` again;
    ``cpu_warn_pct`` = 0 ignores CPU pressure. ``cpu_psi``: "" reads the node
    cgroup's ``cpu.pressure`` on cgroup v2, else /proc/pressure/cpu; or the path
    of another PSI file, e.g. the host's main workload's cgroup's ``cpu.pressure``.
    """

    high_pct: float = 85.0
    critical_pct: float = 95.0
    clear_pct: float = 75.0
    poll_ms: int = 250
    budget: str = ""
    cpu_warn_pct: float = 50.0
    cpu_clear_pct: float = 25.0
    cpu_psi: str = ""


@dataclass(frozen=True)
class LoggingSection:
    """``[logging]``: how the node and its workers write their logs
    (``node.observe.logs``); the level is ``node.log_level``."""

    format: LogFormat = "text"


@dataclass(frozen=True)
class SecuritySection:
    """``[security]``: CURVE on the frontend and the backend (``node.security.keys``).

    ``server_secret_key``: the frontend's keypair file (``NAME.key_secret``); set,
    every client must prove a key listed in ``client_keys`` (a directory of public
    key files). ``backend_secret_key`` and ``worker_keys``: the same for the
    workers' backend (remote workers, host agents). "" = that side is plaintext,
    which a non-loopback tcp endpoint refuses unless ``allow_plaintext``.
    """

    server_secret_key: str = ""
    client_keys: str = ""
    backend_secret_key: str = ""
    worker_keys: str = ""
    allow_plaintext: bool = False


@dataclass(frozen=True)
class MetricsSection:
    """``[metrics]``: the Prometheus endpoint (``node.observe``). ``listen`` = ""
    (off) or "HOST:PORT" with an IP address or localhost (``node.observe.listen``)."""

    listen: str = ""


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
    logging: LoggingSection = field(default_factory=LoggingSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    source: str = "built-in defaults"

    @property
    def run_dir(self) -> Path:
        """The run directory (pidfile, sockets, logs), resolved as documented."""
        return resolve_run_dir(self.node.run_dir)

    @property
    def frontend(self) -> str:
        """The client endpoint."""
        return self.node.frontend or f"ipc://{self.run_dir / FRONTEND_SOCKET}"

    @property
    def backend(self) -> str:
        """The worker endpoint (its ipc directory is made 0700)."""
        return self.node.backend or f"ipc://{self.run_dir / BACKEND_SOCKET}"


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
        ConfigError: unreadable or non-UTF-8 file, unknown section or key, wrong
            type or an out-of-range value; the message names the key (or the file).
    """
    chosen = config_path(path)
    if chosen is None:
        return validate(NodeConfig())
    try:
        data = tomllib.loads(chosen.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read config {chosen}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:  # TOML files are UTF-8 (toml.io, "Spec")
        raise ConfigError(
            f"{chosen}: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "a TOML config must be UTF-8 text"
        ) from exc
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


#: The largest value a C ``int`` takes: llama.cpp's context parameters (n_ctx,
#: n_batch, n_threads) are 32-bit; a larger TOML integer would wrap around.
INT32_MAX = 2**31 - 1
#: ``workers.ready_timeout_ms`` floor (ms): a fresh interpreter alone takes a few
#: hundred ms to start, so below a second no worker (even the test engine's) can
#: register, and every spawn is killed and respawned in a loop.
MIN_READY_TIMEOUT_MS = 1000
#: Ceiling of every duration key (ms): 2**31-1, ~24.8 days. Each one ends in a
#: zmq poll timeout (libzmq's ``zmq_poll`` takes a C int of ms: a longer
#: heartbeat made every worker die of OverflowError and respawn forever), a
#: ``time.sleep`` or a deadline; no edge node waits longer for anything.
MAX_DURATION_MS = INT32_MAX
#: Shortest worker silence (``broker.heartbeat_interval_ms`` x ``heartbeat_liveness``,
#: ms) a config may set. A worker's heartbeats come from a Python thread, which a
#: busy host wakes late by milliseconds to tens of them: at 1 x 1 every worker was
#: declared dead right after READY, restarted and killed again, 284 times in 2.5
#: min, and the node never became ready (break-it pass, session 19; 5 x 2 served
#: on an idle host, the default 500 x 3 on a loaded one: docs/bench/figures.md,
#: "Heartbeat defaults").
MIN_SILENCE_MS = 100
#: ``workers.count`` ceiling: each worker is a process with an interpreter, an
#: engine and a cgroup of its own (tens of MiB even for the test engine); 1024 is
#: beyond any edge device, and above it a typo forks the host out of memory.
MAX_WORKERS = 1024
#: ``broker.max_queue`` and ``broker.client_backlog`` ceiling: queued requests
#: and backlogged finals are held in the broker's memory, each up to
#: ``broker.max_body_bytes``; 65536 of the 256 KiB default are 16 GiB, more than an
#: edge device has, so above it the "bounded" queue bounds nothing.
MAX_QUEUE = 65_536
#: The most requests one node can hold at once (a full queue and every slot of the
#: largest pool): ``broker.max_in_flight_per_client`` and ``breaker.half_open_probes``
#: above it never bind.
MAX_IN_FLIGHT = MAX_QUEUE + MAX_WORKERS * MAX_SLOTS
#: ``broker.retry_cache_bytes`` ceiling: the kept replies are in the broker's
#: memory; 16 GiB (as for ``MAX_QUEUE``) is more than an edge device has.
MAX_MEMORY_BYTES = 16 * 2**30
#: Ceiling of byte-size keys (log rotation sizes): the largest file size (``off_t``
#: is signed 64-bit); a larger integer could not cross msgpack either.
MAX_FILE_BYTES = 2**63 - 1
#: ``fallback.log_backups`` ceiling: every rollover walks the backups one by one
#: (``logging.handlers.RotatingFileHandler.doRollover`` loops over ``backupCount``),
#: so a huge count would hang the broker at its first rollover.
MAX_LOG_BACKUPS = 1000
#: ``workers.cpu_quota`` ceiling in cores: x86-64's largest CONFIG_NR_CPUS
#: (MAXSMP). Above it a quota means nothing; infinity would overflow the µs.
MAX_CPU_QUOTA = 8192
#: ``model.kv_type`` names (``node.capacity.plan.KV_TYPES`` maps them to GGML types;
#: a unit test keeps the two in step).
KV_TYPE_NAMES = ("f16", "q8_0", "q4_0")
LOG_LEVELS = ("debug", "info", "warning", "error")

#: Range ``(lowest, highest)`` of every numeric key: counts from their minimum,
#: durations > 0 where zero is harmful (0 allowed where it means "none"/"at once",
#: as documented in etc/edgenode.toml), fractions in [0, 1]. Every key has a
#: ceiling, with its reason at the constant: durations ``MAX_DURATION_MS``, byte
#: sizes ``MAX_FILE_BYTES``, counts what the node can hold.
_BOUNDS: dict[str, tuple[float, float]] = {
    "node.start_timeout_ms": (1, MAX_DURATION_MS),
    "model.n_ctx": (64, INT32_MAX),
    "model.n_batch": (1, INT32_MAX),
    "workers.count": (0, MAX_WORKERS),
    "workers.threads": (1, INT32_MAX),
    "workers.ready_timeout_ms": (MIN_READY_TIMEOUT_MS, MAX_DURATION_MS),
    "workers.stop_grace_ms": (0, MAX_DURATION_MS),
    "workers.restart_backoff_ms": (1, MAX_DURATION_MS),  # 0 doubles to 0: a hot respawn loop
    "workers.restart_backoff_max_ms": (1, MAX_DURATION_MS),
    "workers.test_token_ms": (0, MAX_DURATION_MS),  # a time.sleep per token
    "workers.test_load_ms": (0, MAX_DURATION_MS),
    "workers.log_max_bytes": (0, MAX_FILE_BYTES),
    "workers.nice": (0, 19),
    "workers.slice_us": (0, 100_000),  # and not 1..99: ``check_slice``
    "workers.oom_score_adj": (0, 1000),  # lowering needs CAP_SYS_RESOURCE: not offered
    "broker.max_queue": (0, MAX_QUEUE),  # 0 = 8 per pool slot
    "broker.default_timeout_ms": (1, MAX_DURATION_MS),
    "broker.max_timeout_ms": (1, MAX_DURATION_MS),
    # A request asks for at most the protocol's cap; a default above it made
    # every request without max_tokens a 413.
    "broker.default_max_tokens": (1, MAX_TOKENS_LIMIT),
    "broker.heartbeat_interval_ms": (1, MAX_DURATION_MS),
    # Its product with the interval is a duration too (checked in ``validate``). At 1
    # the normal gap between two heartbeats is the limit itself: 100 ms x 1 declared
    # workers dead 7 times in 23 s, even before any load (break-it pass, session 19).
    "broker.heartbeat_liveness": (2, MAX_DURATION_MS),
    "broker.stall_timeout_ms": (1, MAX_DURATION_MS),
    "broker.cancel_grace_ms": (1, MAX_DURATION_MS),
    "broker.max_in_flight_per_client": (1, MAX_IN_FLIGHT),
    "broker.client_backlog": (1, MAX_QUEUE),
    "broker.retry_ttl_ms": (0, MAX_DURATION_MS),  # 0 = keep no replies
    "broker.retry_cache_entries": (0, MAX_QUEUE),  # 0 = keep no replies
    "broker.retry_cache_bytes": (0, MAX_MEMORY_BYTES),
    "routing.ttft_budget_ms": (0, MAX_DURATION_MS),  # 0 = no budget
    # [breaker]: the lower ends repeat BreakerSettings' own checks, which run first.
    "breaker.window_ms": (1, MAX_DURATION_MS),
    # ``status`` shows it; more calls than a C int in one window never come.
    "breaker.minimum_calls": (1, INT32_MAX),
    "breaker.slow_call_ms": (1, MAX_DURATION_MS),
    "breaker.open_wait_ms": (0, MAX_DURATION_MS),  # also replies' retry_after_ms
    "breaker.half_open_probes": (1, MAX_IN_FLIGHT),
    "breaker.half_open_max_wait_ms": (0, MAX_DURATION_MS),  # 0 = unlimited
    "fallback.low_confidence": (0.0, 1.0),
    "fallback.log_max_bytes": (0, MAX_FILE_BYTES),
    "fallback.log_backups": (0, MAX_LOG_BACKUPS),
    "pressure.poll_ms": (1, MAX_DURATION_MS),
}
#: Keys whose value is one of a fixed set.
_CHOICES: dict[str, tuple[str, ...]] = {
    "node.log_level": LOG_LEVELS,
    "model.kv_type": KV_TYPE_NAMES,
    "workers.engine": ENGINES,
    "workers.sandbox": SANDBOX_MODES,
    "routing.mode": ROUTING_MODES,
    "logging.format": LOG_FORMATS,
}
#: Keys with a check of their own in ``validate`` (or, for ``[breaker]`` and
#: ``broker.service_estimate`` and ``broker.dispatch``, in the section's ``__post_init__``).
CHECKED_APART = frozenset(
    {
        "node.run_dir",
        "node.frontend",
        "node.backend",
        "node.cpus",
        "model.path",
        "workers.slots",
        "workers.cgroup_root",
        "workers.memory_max",
        "workers.memory_high",
        "workers.cpu_quota",
        "workers.cpus",
        "broker.service_estimate",
        "broker.dispatch",
        "broker.max_body_bytes",  # broker.protocol.message_limits
        "capacity.memory_budget",
        "capacity.reserve",
        "capacity.runtime_overhead",
        "capacity.safety_margin",
        "pressure.high_pct",
        "pressure.critical_pct",
        "pressure.clear_pct",
        "pressure.budget",
        "pressure.cpu_warn_pct",
        "pressure.cpu_clear_pct",
        "pressure.cpu_psi",
        "security.server_secret_key",
        "security.client_keys",
        "security.worker_keys",
        "breaker.failure_rate_pct",
        "breaker.slow_call_rate_pct",
        "breaker.half_open_successes",
        "metrics.listen",  # node.observe.listen.parse_listen
    }
)
#: Keys with no range: their type is all there is to check (``repack``), or they
#: name something only the start can check (a chat format llama-cpp-python knows,
#: a rules file: refused then with a clear error).
FREE_KEYS = frozenset(
    {
        "model.repack",
        "model.flash_attn",
        "workers.adaptive_threads",
        "model.chat_format",
        "fallback.rules",
        "security.backend_secret_key",  # a key file: read (and refused) at start
        "security.allow_plaintext",
    }
)


def validate(config: NodeConfig) -> NodeConfig:
    """Check every key's range or choice once, at load (see ``_BOUNDS``, ``_CHOICES``,
    ``CHECKED_APART``).

    Raises:
        ConfigError: the first invalid value found; the message names its key.
    """
    for key, (low, high) in _BOUNDS.items():
        _in_range(key, _value(config, key), low, high)
    for key, choices in _CHOICES.items():
        _choice(key, _value(config, key), choices)
    w, b, p = config.workers, config.broker, config.pressure
    _slots(w.slots)
    message_limits(b.max_body_bytes)  # its range; every socket's limits come from it
    if b.default_timeout_ms > b.max_timeout_ms:
        raise ConfigError("broker.default_timeout_ms must not exceed broker.max_timeout_ms")
    silence = b.heartbeat_interval_ms * b.heartbeat_liveness
    if not MIN_SILENCE_MS <= silence <= MAX_DURATION_MS:
        raise ConfigError(
            "broker.heartbeat_interval_ms x broker.heartbeat_liveness (the silence that marks "
            f"a worker dead) must be {MIN_SILENCE_MS} .. {MAX_DURATION_MS} ms, got "
            f"{b.heartbeat_interval_ms} x {b.heartbeat_liveness}"
        )
    if b.stall_timeout_ms < 2 * b.heartbeat_interval_ms:
        # A worker's progress reaches the broker with its heartbeats, one an interval:
        # shorter, a busy worker is judged between two reports. At 1 ms every request
        # killed its worker as stalled (break-it pass 2, session 19).
        raise ConfigError(
            "broker.stall_timeout_ms must be at least 2 x broker.heartbeat_interval_ms (a "
            "worker reports its progress with its heartbeats), got "
            f"{b.stall_timeout_ms} < 2 x {b.heartbeat_interval_ms}"
        )
    if w.restart_backoff_max_ms < w.restart_backoff_ms:
        raise ConfigError(
            "workers.restart_backoff_max_ms must be >= workers.restart_backoff_ms, "
            f"got {w.restart_backoff_max_ms} < {w.restart_backoff_ms}"
        )
    if not config.model.path:
        raise ConfigError("model.path must be 'default' or a path to a GGUF file")
    _validate_isolation(w)
    _core_list("node.cpus", config.node.cpus)
    _validate_endpoints(config)
    _validate_pressure(p)
    if not 0 <= config.capacity.safety_margin < 1:  # as node.capacity.plan.Plan demands
        raise ConfigError(
            f"capacity.safety_margin must be in [0, 1), got {config.capacity.safety_margin}"
        )
    for key in ("capacity.memory_budget", "capacity.reserve", "capacity.runtime_overhead"):
        _size(key, _value(config, key), empty_ok=key == "capacity.memory_budget")
    _size("pressure.budget", p.budget, empty_ok=True)
    parse_listen("metrics.listen", config.metrics.listen)
    return config


def _value(config: NodeConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def _validate_endpoints(config: NodeConfig) -> None:
    """Endpoints parse (``node.endpoints``): tcp ports 1..65535, ipc paths that fit
    a socket address; a default endpoint's path comes from the run directory, so
    a run directory too long for it is named as such; the two must differ."""
    n = config.node
    parse_endpoint("node.frontend" if n.frontend else "node.run_dir", config.frontend)
    parse_endpoint("node.backend" if n.backend else "node.run_dir", config.backend)
    if config.frontend == config.backend:
        raise ConfigError(
            f"node.frontend and node.backend must differ, both are {config.frontend!r}"
        )
    _validate_security(config)


def _validate_security(config: NodeConfig) -> None:
    """Keys come in pairs (a server key and its allowlist), and a non-loopback tcp
    endpoint needs CURVE unless ``security.allow_plaintext``: anyone on that
    network could otherwise ask the model, or register as a worker and read
    users' prompts. The key files themselves are read at start."""
    s = config.security
    if bool(s.server_secret_key) != bool(s.client_keys):
        raise ConfigError(
            "security.server_secret_key and security.client_keys go together: the "
            "frontend's keypair file and the directory of allowed client public keys"
        )
    if s.worker_keys and not s.backend_secret_key:
        raise ConfigError("security.worker_keys needs security.backend_secret_key")
    if s.allow_plaintext:
        return
    sides = (
        ("node.frontend", config.frontend, s.server_secret_key, "server_secret_key"),
        ("node.backend", config.backend, s.backend_secret_key, "backend_secret_key"),
    )
    for key, text, secured, secret_key in sides:
        endpoint = parse_endpoint(key, text)
        if endpoint.transport == "tcp" and not secured and not is_loopback(endpoint):
            raise ConfigError(
                f"{key} {text} is reachable from other hosts without CURVE: set "
                f"security.{secret_key} (edgenode keys generate), or "
                "security.allow_plaintext = true to serve it unauthenticated"
            )


def _size(key: str, value: str, empty_ok: bool) -> None:
    if empty_ok and value == "":
        return
    try:
        parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


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
    "logging": LoggingSection,
    "security": SecuritySection,
    "metrics": MetricsSection,
}


#: Keys whose value may also have these types besides the default's (sizes as
#: integer bytes, CPU quotas as numbers of cores).
_ALSO_ACCEPTS: dict[str, tuple[type, ...]] = {
    "workers.memory_max": (int,),
    "workers.memory_high": (int,),
    "workers.cpu_quota": (int, float),
    "workers.slots": (str,),
    "workers.cpus": (tuple,),
}
#: What a value of a TOML type is called in an error ("workers.cpus must be a
#: string or a list, got an integer"): the user wrote TOML, not Python.
_TOML_TYPES: dict[type, str] = {
    str: "a string",
    int: "an integer",
    float: "a float",
    bool: "true or false",
    tuple: "a list",
    list: "a list",
    dict: "a table",
}


def _build(cls: type, raw: dict[str, Any], section: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = dict(raw)
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"unknown config key {section}.{key}")
        expected = type(getattr(cls(), key))
        also = _ALSO_ACCEPTS.get(f"{section}.{key}", ())
        if (expected is tuple or tuple in also) and isinstance(value, list):
            # TOML arrays become tuples: frozen configs stay immutable and hashable.
            values[key] = _int_tuple(f"{section}.{key}", value)
            continue
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, also) and not isinstance(value, bool):
            continue
        if type(value) is not expected:
            wanted = " or ".join(dict.fromkeys(_toml_type(t) for t in (expected, *also)))
            raise ConfigError(f"{section}.{key} must be {wanted}, got {_toml_type(type(value))}")
    return cls(**values)


def _toml_type(kind: type) -> str:
    """``int`` -> "an integer": a TOML value's type in an error message."""
    return _TOML_TYPES.get(kind, kind.__name__)


def _int_tuple(key: str, value: list[Any]) -> tuple[int, ...]:
    bad = [v for v in value if not isinstance(v, int) or isinstance(v, bool)]
    if bad:
        raise ConfigError(f"{key} must be a list of integers, got {_toml_type(type(bad[0]))} in it")
    return tuple(value)


def _validate_isolation(w: WorkersSection) -> None:
    """The sandbox and affinity keys (cgroups, cores, nice levels); cores are checked against the
    host's allowed set later, by ``node.sandbox.cores.plan_cpus`` at start."""
    if w.cgroup_root and (not w.cgroup_root.startswith("/") or ".." in w.cgroup_root.split("/")):
        raise ConfigError(
            f'workers.cgroup_root must be "" or a cgroup path like "/edgenode.slice", '
            f"got {w.cgroup_root!r}"
        )
    validate_memory(w)  # a size or "max"; "auto" is checked against the plan at start
    try:
        cores = parse_cores(w.cpu_quota)
    except ValueError as exc:
        raise ConfigError(f"workers.cpu_quota: {exc}") from exc
    if cores is not None and not cores <= MAX_CPU_QUOTA:
        raise ConfigError(
            f'workers.cpu_quota must be at most {MAX_CPU_QUOTA} cores or "max", got {w.cpu_quota!r}'
        )
    if isinstance(w.cpus, str):
        if w.cpus != AUTO_CORES:
            raise ConfigError(
                f'workers.cpus must be "auto" or a list of core numbers, got {w.cpus!r}'
            )
    else:
        _core_list("workers.cpus", w.cpus)
    check_slice(w.slice_us)


def _validate_pressure(p: PressureSection) -> None:
    """``[pressure]``: the memory watermarks in order, the CPU line above its clear line.

    Raises:
        ConfigError: a value out of range, naming the key.
    """
    if not 0 < p.clear_pct <= p.high_pct <= p.critical_pct <= 100:
        raise ConfigError(
            "pressure.clear_pct, pressure.high_pct and pressure.critical_pct need "
            f"0 < clear <= high <= critical <= 100, got {p.clear_pct}, {p.high_pct}, "
            f"{p.critical_pct}"
        )
    if p.cpu_psi and not p.cpu_psi.startswith("/"):
        raise ConfigError(
            f'pressure.cpu_psi must be "" or an absolute path to a PSI file, got {p.cpu_psi!r}'
        )
    if p.cpu_warn_pct == 0:
        return  # CPU pressure ignored: cpu_clear_pct is not used
    if not 0 < p.cpu_warn_pct <= 100:
        raise ConfigError(
            f"pressure.cpu_warn_pct must be 0 (off) or in (0, 100], got {p.cpu_warn_pct}"
        )
    if not 0 < p.cpu_clear_pct < p.cpu_warn_pct:
        raise ConfigError(
            "pressure.cpu_clear_pct must be in (0, pressure.cpu_warn_pct) "
            f"= (0, {p.cpu_warn_pct}), got {p.cpu_clear_pct}"
        )


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


def _in_range(key: str, value: float, low: float, high: float) -> None:
    """``low <= value <= high``; written so that NaN (TOML ``nan``) fails too."""
    if not low <= value <= high:
        raise ConfigError(f"{key} must be in [{low}, {high}], got {value}")


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
