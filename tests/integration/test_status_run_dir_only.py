"""``edgenode status --run-dir DIR`` without ``-c``: the node recorded its
frontend (and its CURVE server key) in its pidfile, so status finds a node that
listens on TCP, plaintext or CURVE, from the run dir alone."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from node.interpreter import module_command
from node.security.keys import generate
from node.testing import REPO, NodeProcess, free_port


def status_without_config(node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``edgenode status --run-dir DIR ARGS`` with no config (built-in defaults)."""
    argv = module_command("node.cli", "status", "--run-dir", str(node.run_dir), *args)
    env = {k: v for k, v in os.environ.items() if k != "EDGENODE_CONFIG"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)


def test_status_finds_a_tcp_node_from_its_run_dir(
    make_node: Callable[..., NodeProcess],
) -> None:
    port = free_port()
    node = make_node(workers={"count": 1}, node={"frontend": f"tcp://127.0.0.1:{port}"})
    record = json.loads((node.run_dir / "edgenode.pid").read_text())
    assert record["frontend"] == f"tcp://127.0.0.1:{port}"
    assert record["server_public_key"] is None
    done = status_without_config(node, "--ready")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    done = status_without_config(node, "--json")
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["running"] is True
    assert node.stop() == 0
    # Stopped: the pidfile is gone, nothing answers.
    done = status_without_config(node, "--ready")
    assert done.returncode == 3, done


def test_status_finds_a_curve_node_from_its_run_dir(
    make_node: Callable[..., NodeProcess], tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    generate(keys, "node")
    (tmp_path / "clients").mkdir()
    port = free_port()
    node = make_node(
        workers={"count": 1},
        node={"frontend": f"tcp://127.0.0.1:{port}"},
        security={
            "server_secret_key": str(keys / "node.key_secret"),
            "client_keys": str(tmp_path / "clients"),
        },
    )
    record = json.loads((node.run_dir / "edgenode.pid").read_text())
    assert record["server_public_key"] == (keys / "node.key").read_text().split('"')[1]
    done = status_without_config(node, "--ready")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
