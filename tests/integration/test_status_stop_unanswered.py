"""``edgenode status`` and ``stop`` when the node does not answer, with real nodes:
a SIGSTOPped node is named as alive but silent (not "not running"), and ``stop``
continues it so that it stops normally; a node whose local client key is gone is
reported as such, and ``status`` does not make a new key the node would refuse."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from node.security.keys import generate, local_key_file
from node.testing import NodeProcess, free_port, wait_for

NodeFactory = Callable[..., NodeProcess]


@pytest.fixture
def stopped_node(make_node: NodeFactory) -> Iterator[tuple[NodeProcess, int]]:
    """A running node (one worker), then SIGSTOPped: (node, its pid). Continued
    at the end whatever the test did, so its cleanup can stop it."""
    node = make_node(workers={"count": 1})
    assert node.proc is not None
    pid = node.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED, timeout=10)
        yield node, pid
    finally:
        if node.proc.poll() is None:
            os.kill(pid, signal.SIGCONT)


def test_status_of_a_stopped_node_says_it_is_alive_but_does_not_answer(
    stopped_node: tuple[NodeProcess, int],
) -> None:
    node, pid = stopped_node
    done = node.cli("status")
    assert done.returncode == 3, done
    assert done.stdout.startswith(f"edgenode pid {pid} is alive but does not answer on "), done
    assert "(stopped? its state is stopped; kill -CONT" in done.stdout, done
    assert "not running" not in done.stdout
    ready = node.cli("status", "--ready")
    assert (ready.returncode, ready.stdout, ready.stderr) == (3, "", "")
    as_json = node.cli("status", "--json")
    assert as_json.returncode == 3, as_json
    view = json.loads(as_json.stdout)
    assert (view["running"], view["pid"], view["state"]) == (False, pid, "stopped")
    assert view["reason"].startswith(f"edgenode pid {pid} is alive")


def test_stop_continues_a_stopped_node_and_stops_it_cleanly(
    stopped_node: tuple[NodeProcess, int],
) -> None:
    node, pid = stopped_node
    assert node.proc is not None
    done = node.cli("stop", "--timeout-s", "20")
    assert done.returncode == 0, done
    assert done.stdout.strip() == f"edgenode stopped (pid {pid})"
    assert node.proc.wait(10) == 0  # its own clean stop, not a kill
    after = node.cli("status")
    assert after.returncode == 3 and "edgenode is not running" in after.stdout, after


def test_status_names_the_node_s_local_key_it_cannot_read(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "clients"
    allowed.mkdir()
    generate(keys, "node")
    node = make_node(
        workers={"count": 1},
        node={"frontend": f"tcp://127.0.0.1:{free_port()}"},
        security={"server_secret_key": str(keys / "node.key_secret"), "client_keys": str(allowed)},
    )
    assert node.cli("status").returncode == 0  # the local key works
    key = local_key_file(node.run_dir)
    key.unlink()
    done = node.cli("status")
    assert done.returncode == 3, done
    assert f"cannot read the node's client key {key}: No such file or directory" in done.stderr
    assert "not running" not in done.stdout + done.stderr
    ready = node.cli("status", "--ready")
    assert ready.returncode == 3 and ready.stdout == "", ready
    assert f"cannot read the node's client key {key}" in ready.stderr
    assert not key.exists()  # not made anew: the node would not let a new key in
    # With the node gone, a missing key is just "not running" (and still not made).
    assert node.stop() == 0
    gone = node.cli("status")
    assert gone.returncode == 3 and "edgenode is not running" in gone.stdout, gone
    assert not key.exists()
