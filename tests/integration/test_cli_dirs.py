"""An unusable run or cache directory is a one-line ``Error:`` naming it, exit 1,
not a traceback (``edgenode`` run as a real process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from node.testing import REPO


def edgenode(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **env},
        timeout=60,
    )


@pytest.fixture
def engine_config(tmp_path: Path) -> Path:
    config = tmp_path / "edgenode.toml"
    config.write_text('[workers]\nengine = "test"\ncount = 1\n\n[fallback]\nrules = ""\n')
    return config


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
@pytest.mark.parametrize("where", ["a-file", "under-a-file", "in-proc"])
def test_an_unusable_run_dir_is_an_error_naming_it(
    tmp_path: Path, engine_config: Path, where: str, foreground: bool
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    run_dir = {
        "a-file": a_file,
        "under-a-file": a_file / "run",
        "in-proc": Path("/proc/edgenode-run"),
    }[where]
    args = ["start", "--foreground"] if foreground else ["start", "--wait-s", "10"]
    done = edgenode("-c", str(engine_config), "--run-dir", str(run_dir), *args, env={})
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    # The error is the last line (a foreground node logs its start before it).
    assert done.stderr.splitlines()[-1].startswith(f"Error: unusable run directory {run_dir}:"), (
        done.stderr
    )


@pytest.mark.parametrize("command", [["start", "--foreground"], ["capacity"]])
def test_an_unusable_cache_dir_is_an_error_naming_it(tmp_path: Path, command: list[str]) -> None:
    a_file = tmp_path / "cache"
    a_file.write_text("")
    config = tmp_path / "edgenode.toml"
    config.write_text('[model]\npath = "default"\n\n[workers]\nengine = "llama"\n')
    done = edgenode(
        "-c",
        str(config),
        "--run-dir",
        str(tmp_path / "run"),
        *command,
        env={"EDGENODE_CACHE_DIR": str(a_file)},
    )
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"Error: unusable cache directory {a_file}:"), (
        done.stderr
    )
