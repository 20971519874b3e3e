"""What the capacity tests share: a config with a fixed budget, the CLI, fake cgroup hosts,
the limit read from them and a cgroup's memory reading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from node.capacity.budget import tightest_limit
from node.cli.capacity import capacity
from node.config import from_dict
from node.sandbox.cgroupfs import Host
from node.sandbox.driver import MemoryReading

MiB, GiB = 1 << 20, 1 << 30
TEXTBOOK = ["--memory", "8G", "--weights", "4.2G", "--kv-per-seq", "256M", "--reserve", "1.5G"]


#: The layout the capacity tests' arithmetic is written for (not the built-in default).
LAYOUT = {"count": 2, "slots": 1, "threads": 1}


def config(**sections: dict[str, Any]) -> Any:
    """A NodeConfig with a fixed budget, runtime, ``LAYOUT`` and plain attention
    (the figures below were worked out with its 32 MiB scratch; flash
    attention's is tested on its own), so plans depend neither on the host nor
    on the built-in defaults."""
    data: dict[str, dict[str, Any]] = {
        "capacity": {"memory_budget": "8G", "reserve": "1G", "runtime_overhead": "88M"},
        "workers": dict(LAYOUT),
        "model": {"flash_attn": False},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return from_dict(data)


def run_cli(tmp_path: Path, *args: str, toml: str = "") -> Any:
    """``edgenode capacity ARGS`` with ``toml`` as its config file, ``LAYOUT`` unless
    its ``[workers]`` says otherwise."""
    path = tmp_path / "edgenode.toml"
    path.write_text(with_layout(toml))
    return CliRunner().invoke(capacity, list(args), obj={"config": str(path)})


def with_layout(toml: str) -> str:
    """``toml`` with ``LAYOUT``'s keys added to its ``[workers]`` table and plain
    attention to its ``[model]`` table (each made if none), as ``config`` pins them."""
    toml = _with_keys(toml, "workers", {k: str(v) for k, v in LAYOUT.items()})
    return _with_keys(toml, "model", {"flash_attn": "false"})


def _with_keys(toml: str, table: str, keys: dict[str, str]) -> str:
    lines = [f"{k} = {v}\n" for k, v in keys.items() if f"\n{k} =" not in "\n" + toml]
    if f"[{table}]" in toml:
        return toml.replace(f"[{table}]\n", f"[{table}]\n" + "".join(lines), 1)
    return toml + f"\n[{table}]\n" + "".join(lines)


def fake_host(tmp_path: Path, mountinfo: str, proc_cgroup: str, files: dict[str, str]) -> Host:
    """A host whose /proc/self and cgroup files are plain files under ``tmp_path``."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(mountinfo)
    (tmp_path / "proc" / "self" / "cgroup").write_text(proc_cgroup)
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text + "\n")
    return Host(root=tmp_path, proc=tmp_path / "proc")


def cgroup_memory_limit(host: Host) -> int | None:
    """``tightest_limit`` of ``host``'s own cgroup, in bytes (None: no limit)."""
    limit = tightest_limit(host)
    return None if limit is None else limit.bytes


def memory_reading(current: int = 0, **fields: Any) -> MemoryReading:
    """A cgroup's ``MemoryReading`` of ``current`` bytes: no limit, peak or events
    unless ``fields`` (its other attributes, by name) give them."""
    blank: dict[str, Any] = {
        "peak": None,
        "limit": None,
        "high": None,
        "oom_kills": 0,
        "limit_hits": None,
        "high_events": None,
        "swap": None,
    }
    return MemoryReading(current=current, **(blank | fields))
