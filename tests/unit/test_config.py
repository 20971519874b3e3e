"""Node configuration: the shipped TOML, strict loading, round trips."""

from __future__ import annotations

import dataclasses
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ConfigError
from node import config as cfg
from node.config import NodeConfig, from_dict, load_config, to_dict

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "edgenode.toml"
DEFAULTS = NodeConfig()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "edgenode.toml"
    path.write_text(text)
    return str(path)


def config_error(data: dict[str, Any]) -> str:
    """The message of the ConfigError that ``from_dict`` + ``validate`` raise for ``data``."""
    with pytest.raises(ConfigError) as info:
        cfg.validate(from_dict(data))
    return info.value.message


def test_shipped_file_equals_the_builtin_defaults() -> None:
    loaded = load_config(str(SHIPPED))
    assert loaded.source == str(SHIPPED)
    assert dataclasses.replace(loaded, source=DEFAULTS.source) == DEFAULTS


def test_shipped_file_documents_every_key() -> None:
    data = tomllib.loads(SHIPPED.read_text())
    assert set(data) == {
        "node",
        "model",
        "workers",
        "broker",
        "capacity",
        "routing",
        "breaker",
        "fallback",
        "pressure",
        "logging",
        "security",
        "metrics",
    }
    for section, values in to_dict(DEFAULTS).items():
        assert set(data[section]) == set(values), section


def test_no_file_means_builtin_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EDGENODE_CONFIG", raising=False)
    monkeypatch.setattr(cfg, "SYSTEM_CONFIG", tmp_path / "absent.toml")
    assert load_config() == DEFAULTS


def test_env_variable_selects_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = write(tmp_path, "[broker]\nmax_queue = 7\n")
    monkeypatch.setenv("EDGENODE_CONFIG", path)
    loaded = load_config()
    assert loaded.broker.max_queue == 7 and loaded.source == path
    assert load_config(str(SHIPPED)).broker.max_queue == 64  # --config wins over the env


def test_partial_file_keeps_other_defaults(tmp_path: Path) -> None:
    loaded = load_config(write(tmp_path, '[workers]\ncount = 4\nengine = "test"\n'))
    assert loaded.workers.count == 4 and loaded.workers.engine == "test"
    assert loaded.workers.threads == DEFAULTS.workers.threads
    assert loaded.model == DEFAULTS.model and loaded.broker == DEFAULTS.broker


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("[broker]\nmax_queu = 3\n", "broker.max_queu"),
        ("[model]\nn_ctx = 2048\nctx = 1\n", "model.ctx"),
        ("[brokers]\nmax_queue = 3\n", "brokers"),
        ('log_level = "info"\n', "log_level"),
    ],
    ids=["typo-key", "extra-key", "unknown-section", "top-level-key"],
)
def test_unknown_key_or_section_is_named(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert named in info.value.message


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('[broker]\nmax_queue = "64"\n', "broker.max_queue"),
        ("[broker]\nmax_queue = 64.0\n", "broker.max_queue"),
        ("[broker]\nmax_queue = true\n", "broker.max_queue"),
        ("[workers]\nengine = 1\n", "workers.engine"),
        ('[model]\npath = ["a"]\n', "model.path"),
        ("[node]\nrun_dir = false\n", "node.run_dir"),
        ("model = 3\n", "[model]"),
    ],
    ids=[
        "str-for-int",
        "float-for-int",
        "bool-for-int",
        "int-for-str",
        "list-for-str",
        "bool-for-str",
        "section-not-table",
    ],
)
def test_wrong_type_is_named(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert named in info.value.message


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"broker": {"max_queue": -1}}, "broker.max_queue"),  # 0 = 8 per pool slot
        ({"broker": {"max_in_flight_per_client": 0}}, "broker.max_in_flight_per_client"),
        ({"broker": {"heartbeat_liveness": 0}}, "broker.heartbeat_liveness"),
        ({"broker": {"default_timeout_ms": 700_000}}, "broker.default_timeout_ms"),
        ({"workers": {"count": -1}}, "workers.count"),
        ({"workers": {"engine": "onnx"}}, "workers.engine"),
        ({"model": {"n_ctx": 32}}, "model.n_ctx"),
        ({"model": {"path": ""}}, "model.path"),
        ({"node": {"log_level": "loud"}}, "node.log_level"),
        ({"node": {"cpus": [0, 0]}}, "node.cpus"),
        ({"node": {"cpus": [-2]}}, "node.cpus"),
    ],
)
def test_out_of_range_values_are_named(data: dict[str, Any], named: str) -> None:
    assert named in config_error(data)


@pytest.mark.parametrize("slots", [1, 4, 64, "auto", "AUTO", " Auto "])
def test_workers_slots_takes_an_integer_in_1_to_64_or_auto(slots: int | str) -> None:
    assert cfg.validate(from_dict({"workers": {"slots": slots}})).workers.slots == slots
    assert cfg.is_auto_slots(slots) == isinstance(slots, str)


def test_the_default_layout_is_one_worker_of_four_slots_on_two_threads() -> None:
    w = DEFAULTS.workers
    assert (w.count, w.slots, w.threads) == (1, 4, 2) and not cfg.is_auto_slots(w.slots)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("slots = 0", 'workers.slots must be an integer in [1, 64] or "auto", got 0'),
        ("slots = 65", 'workers.slots must be an integer in [1, 64] or "auto", got 65'),
        ("slots = -2", "got -2"),
        ('slots = "many"', "got 'many'"),
        ('slots = "4"', "got '4'"),  # a number in quotes is not a count
        ("slots = true", "workers.slots must be an integer or a string, got true or false"),
        ("slots = 2.5", "workers.slots must be an integer or a string, got a float"),
        ("slots = [2]", "workers.slots must be an integer or a string, got a list"),
    ],
)
def test_bad_workers_slots_are_named_without_a_traceback(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f"[workers]\n{text}\n"))
    assert message in info.value.message
    assert "workers.slots" in info.value.message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[workers]\ncpus = 1", "workers.cpus must be a string or a list, got an integer"),
        ("[workers]\ncpus = true", "workers.cpus must be a string or a list, got true or false"),
        ('[workers]\ncpus = "all"', 'workers.cpus must be "auto" or a list of core numbers'),
        ('[node]\ncpus = "auto"', "node.cpus must be a list, got a string"),
        ("[model]\nn_ctx = 2.5", "model.n_ctx must be an integer, got a float"),
        ("[workers]\ncpus = [true]", "workers.cpus must be a list of integers, got true or false"),
        ('[workers]\ncpus = ["1"]', "workers.cpus must be a list of integers, got a string in it"),
    ],
)
def test_a_value_of_the_wrong_toml_type_is_named_in_toml_words(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text + "\n"))
    assert message in info.value.message


def test_zero_workers_is_allowed() -> None:
    assert cfg.validate(from_dict({"workers": {"count": 0}})).workers.count == 0


def test_unreadable_and_invalid_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[broker\nmax_queue = 1\n"))


def test_from_dict_round_trips_through_to_dict() -> None:
    custom = from_dict(
        {
            "node": {"run_dir": "/run/edge", "log_level": "debug"},
            "model": {"path": "/models/m.gguf", "n_ctx": 4096},
            "workers": {"count": 3, "engine": "test", "test_token_ms": 1},
            "broker": {"max_queue": 8, "heartbeat_interval_ms": 100, "cancel_grace_ms": 50},
        },
        source="custom",
    )
    assert custom.model.n_ctx == 4096 and custom.broker.cancel_grace_ms == 50
    again = from_dict(to_dict(custom), source="custom")
    assert again == custom
    assert from_dict(to_dict(DEFAULTS), source=DEFAULTS.source) == DEFAULTS


def test_to_dict_is_plain_data_and_the_config_pickles() -> None:
    data = to_dict(DEFAULTS)
    assert tomllib.loads(_as_toml(data)) == data  # only TOML-able scalars inside
    assert pickle.loads(pickle.dumps(DEFAULTS)) == DEFAULTS


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULTS.broker.max_queue = 1  # type: ignore[misc]


def _as_toml(data: dict[str, dict[str, Any]]) -> str:
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, str):
                lines.append(f'{key} = "{value}"')
            elif isinstance(value, bool):
                lines.append(f"{key} = {str(value).lower()}")
            elif isinstance(value, list):
                assert all(type(v) is int for v in value), (key, value)
                lines.append(f"{key} = {value}")
            else:
                assert type(value) in (int, float), (key, value)
                lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
