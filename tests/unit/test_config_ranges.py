"""Every config key is range-checked at load, and the error names the key.

``BAD`` holds at least one harmful value for every key that has a range or a
set of choices; a test keeps it covering every key of the config.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import tomllib
from click.testing import CliRunner

from broker.client_request import MAX_TOKENS_LIMIT
from broker.errors import ConfigError
from node import config as cfg
from node.capacity.plan import KV_TYPES
from node.cli import main as node_cli
from node.cli.main import cli
from node.config import NodeConfig, from_dict, load_config, to_dict

#: (key, a value that must be refused). Several per key where the range has two
#: ends or zero is the harmful case.
BAD: list[tuple[str, Any]] = [
    ("node.run_dir", "/tmp/" + "d" * 120),  # its default ipc paths would not fit
    ("node.frontend", "tcp://127.0.0.1:0"),
    ("node.frontend", "tcp://127.0.0.1:65536"),
    ("node.frontend", "tcp://127.0.0.1"),
    ("node.frontend", "udp://127.0.0.1:5555"),
    ("node.frontend", "ipc://" + "/p" * 60),
    ("node.backend", "tcp://127.0.0.1:-1"),
    ("node.backend", "ipc://"),
    ("node.log_level", "loud"),
    ("node.start_timeout_ms", 0),
    ("node.start_timeout_ms", -1),
    ("node.cpus", [-1]),
    ("model.path", ""),
    ("model.n_ctx", 32),
    ("model.n_ctx", 2**31),
    ("model.n_batch", 0),
    ("model.n_batch", 2**40),
    ("model.repack", 1),
    ("model.kv_type", "f32"),
    ("workers.count", -1),
    ("workers.engine", "onnx"),
    ("workers.threads", 0),
    ("workers.threads", 2**31),
    ("workers.slots", 0),
    ("workers.ready_timeout_ms", 0),
    ("workers.ready_timeout_ms", -1),
    ("workers.ready_timeout_ms", 999),
    ("workers.stop_grace_ms", -1),
    ("workers.restart_backoff_ms", 0),
    ("workers.restart_backoff_ms", -500),
    ("workers.restart_backoff_max_ms", 0),
    ("workers.restart_backoff_max_ms", 100),  # below restart_backoff_ms (500)
    ("workers.test_token_ms", -1),
    ("workers.test_load_ms", -1),
    ("workers.log_max_bytes", -1),
    ("workers.sandbox", "maybe"),
    ("workers.cgroup_root", "relative/path"),
    ("workers.memory_max", "lots"),
    ("workers.memory_max", -1),
    ("workers.memory_high", "2G"),  # above memory_max (1G)
    ("workers.cpu_quota", 0),
    ("workers.cpu_quota", -1.5),
    ("workers.cpu_quota", math.inf),
    ("workers.cpu_quota", math.nan),
    ("workers.cpus", [1, 1]),
    ("workers.cpus", "all"),
    ("workers.cpus", 1),
    ("workers.nice", -1),
    ("workers.nice", 20),
    ("workers.slice_us", 100_001),
    ("workers.slice_us", 50),  # the kernel would clamp it to 100: said, not silently
    ("workers.oom_score_adj", -1),  # below the inherited value needs CAP_SYS_RESOURCE
    ("workers.oom_score_adj", 1001),
    ("broker.max_body_bytes", 0),
    ("broker.max_queue", -1),
    ("broker.default_timeout_ms", 0),
    ("broker.default_timeout_ms", 700_000),  # above max_timeout_ms
    ("broker.max_timeout_ms", -1),
    ("broker.default_max_tokens", 0),
    ("broker.heartbeat_interval_ms", 0),
    ("broker.heartbeat_liveness", 0),
    ("broker.heartbeat_liveness", 1),  # the normal gap between heartbeats is the limit
    ("broker.stall_timeout_ms", 999),  # below 2 x the 500 ms interval: judged between reports
    ("broker.stall_timeout_ms", 0),
    ("broker.cancel_grace_ms", -1),
    ("broker.max_in_flight_per_client", 0),
    ("broker.service_estimate", "guess"),
    ("broker.dispatch", "nearest"),
    ("capacity.memory_budget", "much"),
    ("capacity.reserve", "-1G"),
    ("capacity.reserve", ""),
    ("capacity.safety_margin", -0.1),
    ("capacity.safety_margin", 1.0),
    ("capacity.safety_margin", 1.5),
    ("capacity.safety_margin", math.nan),
    ("capacity.runtime_overhead", "88 apples"),
    ("routing.mode", "yolo"),
    ("logging.format", "logfmt"),
    ("routing.ttft_budget_ms", -1),
    ("breaker.window_ms", 0),
    ("breaker.minimum_calls", 0),
    ("breaker.failure_rate_pct", 0.0),
    ("breaker.failure_rate_pct", 101.0),
    ("breaker.slow_call_rate_pct", math.nan),
    ("breaker.slow_call_ms", 0),
    ("breaker.open_wait_ms", -1),
    ("breaker.half_open_probes", 0),
    ("breaker.half_open_successes", 3),  # above half_open_probes (2)
    ("breaker.half_open_max_wait_ms", -1),
    ("fallback.low_confidence", 1.5),
    ("fallback.low_confidence", -0.5),
    ("fallback.log_max_bytes", -1),
    ("fallback.log_backups", -1),
    ("pressure.high_pct", 50.0),  # below clear_pct (75)
    ("pressure.critical_pct", 101.0),
    ("pressure.clear_pct", 0.0),
    ("pressure.clear_pct", math.nan),
    ("pressure.poll_ms", 0),
    ("pressure.poll_ms", -250),
    ("pressure.budget", "3 gigs"),
    ("broker.client_backlog", 0),
    ("pressure.cpu_warn_pct", 101.0),
    ("pressure.cpu_warn_pct", -5.0),
    ("pressure.cpu_clear_pct", 60.0),  # above cpu_warn_pct (50)
    ("pressure.cpu_clear_pct", math.nan),
    ("pressure.cpu_psi", "proc/pressure/cpu"),  # not absolute
    ("metrics.listen", "9464"),  # no host
    ("metrics.listen", "127.0.0.1:0"),
    ("metrics.listen", "127.0.0.1:65536"),
    ("metrics.listen", "127.0.0.1"),
    ("metrics.listen", "example.org:9464"),  # a name, not an address
    ("metrics.listen", "::1:9464"),  # IPv6 without brackets
    ("metrics.listen", "[127.0.0.1]:9464"),  # brackets around IPv4
    ("metrics.listen", "http://127.0.0.1:9464"),
    # Above each ceiling (issue 11, break-it): durations reach a zmq poll (a C int of
    # ms), counts and sizes what the node can hold, max_tokens the protocol's cap.
    ("node.frontend", "tcp://lo:5555"),  # an interface: served, but no client connects
    ("node.frontend", "tcp://no-such-host.invalid:5555"),
    ("node.backend", "tcp://::1:5556"),  # IPv6 without brackets
    ("node.start_timeout_ms", 2**31),
    ("workers.count", 1025),
    ("workers.ready_timeout_ms", 2**31),
    ("workers.stop_grace_ms", 2**31),
    ("workers.restart_backoff_ms", 2**31),
    ("workers.restart_backoff_max_ms", 2**31),
    ("workers.test_token_ms", 99_999_999_999_999),
    ("workers.test_load_ms", 2**31),
    ("workers.log_max_bytes", 2**63),
    ("broker.max_queue", 65_537),
    ("broker.default_timeout_ms", 2**31),
    ("broker.max_timeout_ms", 2**31),
    ("broker.default_max_tokens", 100_000),
    ("broker.default_max_tokens", MAX_TOKENS_LIMIT + 1),
    ("broker.heartbeat_interval_ms", 99_999_999_999_999),
    ("broker.heartbeat_interval_ms", 2**30),  # x 3 misses: above the longest duration
    ("broker.heartbeat_liveness", 2**31),
    ("broker.heartbeat_liveness", 2**23),  # x the 500 ms default: above the longest duration
    # Below the shortest silence (x the default liveness 3: 99 ms): every worker was
    # declared dead right after READY, and the node never became ready.
    ("broker.heartbeat_interval_ms", 33),
    ("broker.stall_timeout_ms", 2**31),
    ("broker.cancel_grace_ms", 2**31),
    ("broker.max_in_flight_per_client", cfg.MAX_IN_FLIGHT + 1),
    ("broker.client_backlog", 99_999_999_999_999_999),
    ("broker.retry_ttl_ms", 2**31),
    ("broker.retry_ttl_ms", -1),
    ("broker.retry_cache_entries", 65_537),
    ("broker.retry_cache_bytes", cfg.MAX_MEMORY_BYTES + 1),
    ("routing.ttft_budget_ms", 2**31),
    ("breaker.window_ms", 2**31),
    ("breaker.minimum_calls", 2**31),
    ("breaker.slow_call_ms", 2**31),
    ("breaker.open_wait_ms", 2**31),
    ("breaker.half_open_probes", cfg.MAX_IN_FLIGHT + 1),
    ("breaker.half_open_max_wait_ms", 2**31),
    ("fallback.log_max_bytes", 2**63),
    ("fallback.log_backups", 1001),
    ("fallback.log_backups", 2**40),
    ("pressure.poll_ms", 2**31),
    # [security]: a server key without its allowlist, and the other way round.
    ("security.server_secret_key", "/etc/edgenode/node.key_secret"),
    ("security.client_keys", "/etc/edgenode/clients"),
    ("security.worker_keys", "/etc/edgenode/workers"),
]


def _no_node(*_args: Any) -> None:
    raise AssertionError("a node was started")


def _data(key: str, value: Any) -> dict[str, Any]:
    section, name = key.split(".")
    return {section: {name: value}}


@pytest.mark.parametrize(("key", "value"), BAD, ids=[f"{k}={v!r}"[:60] for k, v in BAD])
def test_a_value_out_of_range_is_refused_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        cfg.validate(from_dict(_data(key, value)))
    assert key in info.value.message, info.value.message


def test_every_key_with_a_range_has_a_bad_value_above() -> None:
    keys = {f"{s}.{k}" for s, values in to_dict(NodeConfig()).items() for k in values}
    tested = {k for k, _ in BAD}
    assert keys - cfg.FREE_KEYS <= tested and tested <= keys, (keys - tested, tested - keys)


def test_validate_declares_a_check_for_every_key() -> None:
    keys = {f"{s}.{k}" for s, values in to_dict(NodeConfig()).items() for k in values}
    declared = set(cfg._BOUNDS) | set(cfg._CHOICES) | cfg.CHECKED_APART | cfg.FREE_KEYS
    assert declared == keys


def test_kv_type_names_follow_the_capacity_model() -> None:
    assert tuple(KV_TYPES) == cfg.KV_TYPE_NAMES


@pytest.mark.parametrize(
    "text",
    [
        '[node]\nfrontend = "tcp://127.0.0.1:5555"\nbackend = "tcp://127.0.0.1:5556"\n',
        '[node]\nfrontend = "tcp://*:65535"\n[security]\nallow_plaintext = true\n',
        '[node]\nfrontend = "tcp://[::1]:5555"\n',
        "[workers]\nready_timeout_ms = 1000\nrestart_backoff_ms = 1\nrestart_backoff_max_ms = 1\n",
        "[capacity]\nsafety_margin = 0.0\n[fallback]\nlow_confidence = 1.0\n",
        "[workers]\ncount = 0\nstop_grace_ms = 0\ntest_token_ms = 0\noom_score_adj = 0\n",
        "[workers]\noom_score_adj = 1000\n",
        '[node]\nfrontend = "tcp://0.0.0.0:5555"\nbackend = "tcp://[::]:5556"\n'
        "[security]\nallow_plaintext = true\n",
        '[node]\nfrontend = "tcp://localhost:5555"\n',
        f"[broker]\ndefault_max_tokens = {MAX_TOKENS_LIMIT}\nmax_queue = 65536\n",
        "[broker]\nheartbeat_interval_ms = 715827882\nmax_timeout_ms = 2147483647\n"
        "stall_timeout_ms = 2147483647\n",
        "[broker]\nheartbeat_interval_ms = 50\nheartbeat_liveness = 2\n",  # the shortest
        "[broker]\nstall_timeout_ms = 1000\n",  # 2 x the default heartbeat interval
        "[workers]\ncount = 1024\ntest_token_ms = 2147483647\n[fallback]\nlog_backups = 1000\n",
    ],
)
def test_values_at_the_ends_of_their_ranges_load(tmp_path: Path, text: str) -> None:
    path = tmp_path / "edgenode.toml"
    path.write_text(text)
    loaded = to_dict(load_config(str(path)))
    for section, values in tomllib.loads(text).items():
        assert {k: loaded[section][k] for k in values} == values


def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "edgenode.toml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.message.startswith(f"{path}: not UTF-8"), info.value.message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[workers]\nready_timeout_ms = 0\n", "workers.ready_timeout_ms"),
        ("[workers]\nrestart_backoff_ms = -5\n", "workers.restart_backoff_ms"),
        ('[node]\nfrontend = "tcp://127.0.0.1:99999"\n', "node.frontend"),
        ("[pressure]\npoll_ms = -1\n", "pressure.poll_ms"),
        ("[capacity]\nsafety_margin = nan\n", "capacity.safety_margin"),
        ("[workers]\ncpu_quota = inf\n", "workers.cpu_quota"),
        ("[broker]\nheartbeat_interval_ms = 99999999999999\n", "broker.heartbeat_interval_ms"),
        ('[node]\nfrontend = "tcp://lo:5555"\n', "node.frontend"),
        (b"\xff\xfe\x00garbage", "{path}: not UTF-8"),
    ],
)
@pytest.mark.parametrize("command", ["start", "status", "stop"])
def test_the_cli_reports_a_bad_value_by_key_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str | bytes, key: str, command: str
) -> None:
    path = tmp_path / "edgenode.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    # The CLI exports both for the node it starts; restore them after the test.
    monkeypatch.setenv("EDGENODE_CONFIG", str(path))
    monkeypatch.setenv("EDGENODE_RUN_DIR", str(tmp_path))
    # Should a value ever pass, no node may start from a unit test.
    monkeypatch.setattr(node_cli, "_start_background", _no_node)
    monkeypatch.setattr(node_cli, "Node", _no_node)
    result = CliRunner().invoke(cli, ["-c", str(path), "--run-dir", str(tmp_path), command])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    assert f"Error: {key.format(path=path)}" in result.output
    assert "Traceback" not in result.output
