"""What the capacity tests share: a config with a fixed budget, and the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from node.cli_capacity import capacity
from node.config import from_dict

MiB, GiB = 1 << 20, 1 << 30
TEXTBOOK = ["--memory", "8G", "--weights", "4.2G", "--kv-per-seq", "256M", "--reserve", "1.5G"]


def config(**sections: dict[str, Any]) -> Any:
    """A NodeConfig with a fixed budget and runtime, so plans do not depend on the host."""
    data: dict[str, dict[str, Any]] = {
        "capacity": {"memory_budget": "8G", "reserve": "1G", "runtime_overhead": "88M"}
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return from_dict(data)


def run_cli(tmp_path: Path, *args: str, toml: str = "[workers]\ncount = 2\n") -> Any:
    """``edgenode capacity ARGS`` with ``toml`` as its config file."""
    path = tmp_path / "edgenode.toml"
    path.write_text(toml)
    return CliRunner().invoke(capacity, list(args), obj={"config": str(path)})
