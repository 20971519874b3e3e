"""An unusable run or cache directory is a one-line ``Error:`` naming it, exit 1,
not a traceback; a refused start leaves no run directory it made (``edgenode``
run as a real process)."""

from __future__ import annotations

import os
import socket
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


#: Configs ``start`` refuses before any node runs (and what it says): a core this
#: process may not use, a plan that cannot fit.
REFUSED = {
    "cores": (
        f'[node]\ncpus = [{max(os.sched_getaffinity(0)) + 1}]\n\n[workers]\nengine = "test"\n',
        "Error: node.cpus names core(s)",
    ),
    "plan": (
        '[capacity]\nmemory_budget = "1G"\nreserve = "512M"\n\n[workers]\nengine = "test"\n'
        "count = 40\n",
        "Error: capacity: 40 worker(s) ",
    ),
}


@pytest.mark.parametrize("foreground", [False, True], ids=["background", "foreground"])
@pytest.mark.parametrize("refusal", sorted(REFUSED))
def test_a_refused_start_removes_the_run_dir_it_made(
    tmp_path: Path, refusal: str, foreground: bool
) -> None:
    toml, said = REFUSED[refusal]
    config = tmp_path / "edgenode.toml"
    config.write_text(toml)
    run_dir = tmp_path / "run"
    args = ["start", "--foreground"] if foreground else ["start", "--wait-s", "10"]
    done = edgenode("-c", str(config), "--run-dir", str(run_dir), *args, env={})
    assert done.returncode == 1, done
    assert done.stderr.splitlines()[-1].startswith(said), done.stderr
    assert not run_dir.exists()


def test_a_refused_start_keeps_a_run_dir_that_was_there(tmp_path: Path) -> None:
    toml, said = REFUSED["cores"]
    config = tmp_path / "edgenode.toml"
    config.write_text(toml)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    done = edgenode("-c", str(config), "--run-dir", str(run_dir), "start", env={})
    assert done.returncode == 1 and said in done.stderr, done
    assert run_dir.is_dir()


def test_a_foreground_start_on_an_endpoint_in_use_removes_the_run_dir_it_made(
    tmp_path: Path,
) -> None:
    """The endpoints are checked under the run directory's lock, so after the
    directory is made; a start refused there left it behind (break-it pass, session 17)."""
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "edgenode.toml"
        config.write_text(
            f'[node]\nfrontend = "tcp://127.0.0.1:{port}"\n\n[workers]\nengine = "test"\n'
        )
        run_dir = tmp_path / "run"
        done = edgenode("-c", str(config), "--run-dir", str(run_dir), "start", "--foreground",
                        env={})  # fmt: skip
    finally:
        taken.close()
    assert done.returncode == 1, done
    assert "node.frontend" in done.stderr, done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize(("command", "code"), [("status", 3), ("stop", 0)])
def test_status_and_stop_on_a_run_dir_that_is_a_file_say_so(
    tmp_path: Path, engine_config: Path, command: str, code: int
) -> None:
    # Both said only "edgenode is not running", as for an empty run dir, so a
    # mistyped --run-dir naming a file looked like a stopped node.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    done = edgenode("-c", str(engine_config), "--run-dir", str(a_file), command, env={})
    assert done.returncode == code, done
    assert done.stdout.startswith("edgenode is not running"), done
    assert f"run dir {a_file} is not a directory" in done.stdout, done
    assert a_file.read_text() == ""  # left as it was
