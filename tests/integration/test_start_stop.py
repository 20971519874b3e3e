"""``edgenode start`` and ``stop`` on real processes: one node per run directory,
success only for the node a start launched, ``stop`` signals only the lock
holder, and a failed start leaves nothing behind (real cgroups where the host
has them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from node.testing import (
    NodeProcess,
    cgroups_usable,
    free_port,
    node_cgroup_dirs,
    node_processes,
    wait_for,
)

NodeFactory = Callable[..., NodeProcess]

#: One light worker: ten nodes may start at once on a 2-core machine.
ONE_WORKER = {"count": 1, "slots": 1}


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated live process (``sleep``) that nobody may signal."""
    proc = subprocess.Popen(["sleep", "300"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def forge_pidfile(run_dir: Path, pid: int) -> None:
    """A pidfile naming ``pid`` with its true start time: it passes the old identity check."""
    created = psutil.Process(pid).create_time()
    (run_dir / "edgenode.pid").write_text(json.dumps({"pid": pid, "create_time": created}))


def run_files(run_dir: Path) -> list[str]:
    """What a node leaves in its run directory besides config, logs and the lock."""
    names = ("edgenode.pid", "frontend.sock", "workers/backend.sock")
    return [n for n in names if (run_dir / n).exists()]


@pytest.mark.timeout(240)
def test_ten_concurrent_starts_leave_exactly_one_node(make_node: NodeFactory) -> None:
    node = make_node(start=False, workers=ONE_WORKER)
    starts = [
        subprocess.Popen(
            node._argv("start", "--wait-s", "120"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        for _ in range(10)
    ]
    results = [(p.wait(200), *p.communicate()) for p in starts]
    winners = [r for r in results if r[0] == 0]
    losers = [r for r in results if r[0] != 0]
    assert len(winners) == 1, results
    assert len(losers) == 9
    # Exactly one node process serves the run directory: the one that answers.
    nodes = node_processes(node.run_dir)
    assert len(nodes) == 1, nodes
    for _code, _out, err in losers:
        assert "already running" in err or "in use by" in err, err
        # The node, not the start that launched it (gone once the node is up).
        assert f"pid {nodes[0]}," in err, (nodes, err)
    assert node.status()["pid"] == nodes[0]
    assert f"pid {nodes[0]}" in winners[0][1]
    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert node_processes(node.run_dir) == []
    assert run_files(node.run_dir) == []


@pytest.mark.parametrize("running", [True, False], ids=["node-running", "no-node"])
def test_stop_never_signals_the_process_a_pidfile_names(
    make_node: NodeFactory, sleeper: subprocess.Popen[bytes], running: bool
) -> None:
    node = make_node(start=running, workers=ONE_WORKER)
    node.run_dir.mkdir(exist_ok=True)
    forge_pidfile(node.run_dir, sleeper.pid)
    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert sleeper.poll() is None, "stop signalled an unrelated process"
    assert psutil.Process(sleeper.pid).status() != psutil.STATUS_ZOMBIE
    if running:
        # The lock holder, the real node, was the one stopped.
        assert node.proc is not None
        assert node.proc.wait(30) == 0
        assert f"pid {node.proc.pid}" in stopped.stdout
    else:
        assert "not running" in stopped.stdout


def test_a_node_on_a_wildcard_frontend_starts_answers_status_and_stops(
    make_node: NodeFactory,
) -> None:
    # It binds tcp://*:PORT; start, status and stop used to connect to that bind
    # address, which is no connect address: a zmq traceback, the node left running.
    port = free_port()
    node = make_node(
        start=False,
        workers=ONE_WORKER,
        node={"frontend": f"tcp://*:{port}"},
        security={"allow_plaintext": True},  # a wildcard is reachable from the network
    )
    started = node.cli("start", "--wait-s", "60")
    assert started.returncode == 0, started.stderr
    assert "edgenode running: 1 model worker(s) ready" in started.stdout
    [pid] = node_processes(node.run_dir)
    status = node.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["pid"] == pid
    asked = node.cli("ask", "hello", "--max-tokens", "4")
    assert asked.returncode == 0 and "Traceback" not in asked.stderr, asked.stderr
    stopped = node.cli("stop")
    assert stopped.returncode == 0 and f"pid {pid}" in stopped.stdout, stopped.stderr
    assert node_processes(node.run_dir) == []
    assert node.cli("status").returncode == 3  # not running


def test_start_on_a_frontend_held_by_another_node_names_it_and_fails(
    make_node: NodeFactory,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    holder = make_node(workers=ONE_WORKER, node={"frontend": endpoint})
    second = make_node(start=False, workers=ONE_WORKER, node={"frontend": endpoint})
    result = second.cli("start", "--wait-s", "60")
    assert result.returncode != 0, result.stdout
    assert "edgenode running" not in result.stdout
    assert endpoint in result.stderr and "in use" in result.stderr, result.stderr
    assert holder.proc is not None and f"pid {holder.proc.pid}" in result.stderr
    assert node_processes(second.run_dir) == []
    assert run_files(second.run_dir) == []
    assert holder.status()["all_ready"]  # the first node is untouched


def test_start_on_a_frontend_held_by_any_process_names_the_holder(
    make_node: NodeFactory,
) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        node = make_node(start=False, workers=ONE_WORKER, node={"frontend": endpoint})
        result = node.cli("start", "--wait-s", "60")
    assert result.returncode != 0, result.stdout
    assert endpoint in result.stderr and f"in use by pid {os.getpid()}" in result.stderr
    assert "Traceback" not in result.stderr
    assert node_processes(node.run_dir) == [] and run_files(node.run_dir) == []


@pytest.mark.skipif(not cgroups_usable(), reason="needs root and a cgroup memory controller")
def test_a_start_whose_workers_never_get_ready_stops_its_node_and_leaves_nothing(
    make_node: NodeFactory,
) -> None:
    node = make_node(
        start=False,
        # A load that sleeps makes no progress: killed after the 1 s READY timeout and
        # restarted; past --wait-s the start gives up at the first such kill.
        workers={
            **ONE_WORKER,
            "sandbox": "required",
            "test_load_ms": 60_000,
            "ready_timeout_ms": 1000,
        },
    )
    result = node.cli("start", "--wait-s", "3")
    assert result.returncode != 0, result.stdout
    assert "not ready" in result.stderr and "stopped" in result.stderr, result.stderr
    assert node_processes(node.run_dir) == []
    assert node_cgroup_dirs(node.run_dir) == []
    assert run_files(node.run_dir) == []


@pytest.mark.skipif(not cgroups_usable(), reason="needs root and a cgroup memory controller")
def test_a_start_that_fails_on_its_address_leaves_no_cgroup_socket_or_pidfile(
    make_node: NodeFactory,
) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    holder = make_node(workers=ONE_WORKER, node={"frontend": endpoint})
    node = make_node(
        start=False, workers={**ONE_WORKER, "sandbox": "required"}, node={"frontend": endpoint}
    )
    # Foreground: the node's own exit, with nothing between it and its cleanup.
    result = node.cli("start", "--foreground")
    assert result.returncode != 0
    assert "in use by pid" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert node_cgroup_dirs(node.run_dir) == []
    assert run_files(node.run_dir) == []
    wait_for(lambda: holder.status()["all_ready"])


#: A node that gets SIGTERM (as from ``edgenode stop``) right after it made its
#: cgroups, before it serves: argv[1] is its config.
STOPPED_WHILE_STARTING = """
import os, signal, sys
from node import pool
from node.app import Node
from node.config import load_config

opened = pool.WorkerPool.open

def open_then_stop(self):
    opened(self)
    os.kill(os.getpid(), signal.SIGTERM)

pool.WorkerPool.open = open_then_stop
sys.exit(Node(load_config(sys.argv[1])).run())
"""


def test_a_stop_while_the_node_starts_still_removes_what_it_made(make_node: NodeFactory) -> None:
    sandbox = "required" if cgroups_usable() else "off"
    node = make_node(start=False, workers={**ONE_WORKER, "sandbox": sandbox})
    result = subprocess.run(
        [sys.executable, "-c", STOPPED_WHILE_STARTING, str(node.config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "EDGENODE_RUN_DIR": str(node.run_dir)},
    )
    assert result.returncode == 0, result.stderr
    assert node_cgroup_dirs(node.run_dir) == []
    assert run_files(node.run_dir) == []


def slow_background_start(
    make_node: NodeFactory,
) -> tuple[NodeProcess, subprocess.Popen[str]]:
    """A background ``edgenode start`` whose worker takes 60 s to load: it is still
    waiting for READY while the test stops or signals it."""
    node = make_node(start=False, workers={**ONE_WORKER, "test_load_ms": 60_000})
    start = subprocess.Popen(
        node._argv("start", "--wait-s", "120"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    return node, start


@pytest.fixture
def foreign_flock() -> Iterator[Callable[[Path], list[psutil.Process]]]:
    """Starts ``flock -x DIR sh -c 'echo locked; exec sleep 300'`` (util-linux
    flock(1)): an unrelated process holding the run directory's lock. Returns
    the flock process and its child, once the lock is held."""
    procs: list[subprocess.Popen[str]] = []

    def hold(run_dir: Path) -> list[psutil.Process]:
        proc = subprocess.Popen(
            ["flock", "-x", str(run_dir), "sh", "-c", "echo locked; exec sleep 300"],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        flock = psutil.Process(proc.pid)
        return [flock, *flock.children()]

    yield hold
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def test_a_foreign_flock_on_the_run_dir_is_named_never_signalled(
    make_node: NodeFactory, foreign_flock: Callable[[Path], list[psutil.Process]]
) -> None:
    node = make_node(start=False, workers=ONE_WORKER)
    flock, sleep = foreign_flock(node.run_dir)
    stopped = node.cli("stop")
    assert stopped.returncode == 1, stopped.stdout
    assert f"pid {flock.pid}: flock -x {node.run_dir}" in stopped.stderr, stderr_of(stopped)
    assert "nothing was signalled" in stopped.stderr
    for proc in (flock, sleep):
        assert proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE, proc
    for mode in (("--wait-s", "30"), ("--foreground",)):
        started = node.cli("start", *mode)
        assert started.returncode == 1, started.stdout
        assert "already running" not in started.stderr, stderr_of(started)
        assert f"not an edgenode node (pid {flock.pid}: flock" in started.stderr
    assert node_processes(node.run_dir) == []
    assert flock.is_running() and sleep.is_running()


def stderr_of(result: subprocess.CompletedProcess[str]) -> str:
    return f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["at-once", "node-launched"])
def test_a_stop_right_after_a_background_start_stops_that_start_and_its_node(
    make_node: NodeFactory, when: str
) -> None:
    # Slow workers: the start is still waiting when the stop arrives.
    node, start = slow_background_start(make_node)
    try:
        if when == "node-launched":
            # The moment the node process exists, long before it is ready (and,
            # were the lock left to the node, before its imports are done).
            wait_for(lambda: node_processes(node.run_dir), timeout=30, every=0.005)
        # at-once: the start has been exec'd (Popen returns after exec), no more.
        stopped = node.cli("stop")
        wait_for(lambda: start.poll() is not None, timeout=60)  # not its --wait-s 120
        _out, err = start.communicate(timeout=10)
    finally:
        start.kill()
        start.wait()
    assert stopped.returncode == 0, stderr_of(stopped)
    assert "edgenode stopped" in stopped.stdout, stderr_of(stopped)
    assert start.returncode == 1, err
    assert "start interrupted (SIGTERM)" in err, err
    if when == "node-launched":
        assert "was stopped" in err, err
    assert node_processes(node.run_dir) == []
    assert run_files(node.run_dir) == []
    assert node.cli("stop").stdout.strip() == "edgenode is not running"


@pytest.mark.parametrize(
    "signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["Ctrl-C", "TERM", "HUP"]
)
def test_a_start_interrupted_or_killed_stops_the_node_it_launched(
    make_node: NodeFactory, signum: signal.Signals
) -> None:
    node, start = slow_background_start(make_node)
    try:
        wait_for(lambda: node_processes(node.run_dir), timeout=30)
        start.send_signal(signum)
        _out, err = start.communicate(timeout=60)
    finally:
        start.kill()
        start.wait()
    assert start.returncode == 1, err
    assert f"start interrupted ({signum.name})" in err and "was stopped" in err, err
    assert node_processes(node.run_dir) == []
    assert node_cgroup_dirs(node.run_dir) == []
    assert run_files(node.run_dir) == []
