"""A worker's READY timeout judges its load by progress (node.supervisor.READY_CAP_FACTOR).

A load starved of CPU (the default ``workers.nice = 10`` on a busy host got 5-7 % of a
core) takes longer than ``workers.ready_timeout_ms`` yet makes progress: it is not
killed, and ``edgenode start`` waits for it past ``--wait-s``. A load that makes none
(SIGSTOP, or a worker that only wakes for heartbeats) is killed after the timeout.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from node.engine import EngineSpec
from node.sandbox.cgroupfs import Host
from node.sandbox.layout import read_layout
from node.supervisor import Supervisor
from node.testing import NodeProcess, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]

#: Nobody listens there: the worker loads, then waits for a broker forever.
NO_BROKER = "tcp://127.0.0.1:1"


def cgroups_usable() -> bool:
    """Root and a cgroup hierarchy the sandbox can use (as tests/integration/test_start_stop.py)."""
    if os.geteuid() != 0:
        return False
    try:
        layout = read_layout(Host())
    except OSError:
        return False
    return "memory" in layout.v1 or layout.v2 is not None


def unregistered_spec(worker_id: str = "llm-0") -> WorkerSpec:
    """A test-engine worker that cannot register (no broker)."""
    engine = EngineSpec(kind="test", model_path="test", n_ctx=512, n_batch=64, threads=1)
    return WorkerSpec(worker_id=worker_id, backend=NO_BROKER, engine=engine)


def killed_for(sup: Supervisor, worker_id: str, timeout: float) -> str:
    """Tick until ``worker_id``'s process is killed and reaped; its exit reason."""
    handle = sup.handles[worker_id]

    def reaped() -> bool:
        sup.tick(time.monotonic())
        return handle.state == "restarting"

    wait_for(reaped, timeout=timeout, every=0.05)
    return handle.last_exit


@pytest.mark.skipif(not cgroups_usable(), reason="needs root and a cgroup cpu controller")
def test_a_cpu_starved_load_past_the_ready_timeout_is_not_killed_and_start_waits_for_it(
    make_node: NodeFactory,
) -> None:
    # 4 % of a core (cpu.max) for a worker whose start takes ~0.45 s of CPU: ~11 s
    # or more of loading, past both the 4 s READY timeout and the start's 6 s wait
    # (which leaves the node itself, at full speed, time to answer on a busy host),
    # and well within the 40 s cap.
    node = make_node(
        start=False,
        workers={
            "count": 1,
            "sandbox": "required",
            "cpu_quota": 0.04,
            "ready_timeout_ms": 4000,
        },
        # Liveness the starved worker can keep once serving (not the harness's 0.3 s):
        # this test is about its load, not the broker's heartbeats.
        broker={"heartbeat_interval_ms": 1000, "heartbeat_liveness": 10},
    )
    try:
        result = node.cli("start", "--wait-s", "6", timeout=55)
        assert result.returncode == 0, result.stderr
        assert "still loading after 6s and making progress" in result.stdout, result.stdout
        assert "edgenode running: 1 worker(s) ready" in result.stdout
        (llm,) = node.status()["processes"]
        assert (llm["state"], llm["restarts"], llm["last_exit"]) == ("ready", 0, ""), llm
        assert llm["loading"] is None  # ready: no load any more
        assert "not READY" not in (node.run_dir / "logs" / "node.log").read_text()
    finally:
        node.cli("stop")


def test_a_worker_stopped_during_its_load_is_killed_after_the_ready_timeout(
    tmp_path: Path,
) -> None:
    sup = Supervisor([unregistered_spec()], tmp_path / "logs", 1.5, 5.0, 5.0)
    try:
        sup.start()
        pid = sup.handles["llm-0"].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # in the middle of its imports: a hung load
        reason = killed_for(sup, "llm-0", timeout=20)
        assert "not READY" in reason and "made no progress" in reason, reason
        assert "SIGKILL" in reason
    finally:
        sup.stop(grace_s=5)


def test_a_loaded_worker_that_only_heartbeats_is_not_progress_and_is_killed(
    tmp_path: Path,
) -> None:
    # Loaded, it polls for a broker that never answers: a few µs of CPU per heartbeat
    # are not a load making progress (LOAD_MIN_CPU_SHARE).
    sup = Supervisor([unregistered_spec()], tmp_path / "logs", 1.5, 5.0, 5.0)
    try:
        sup.start()
        handle = sup.handles["llm-0"]
        seen: list[float] = []

        def loading() -> bool:
            sup.tick(time.monotonic())
            (row,) = sup.status()
            if row["loading"] is not None:
                seen.append(row["loading"]["cpu_s"])
            return handle.state != "starting"

        wait_for(loading, timeout=40, every=0.05)
        assert "made no progress" in handle.last_exit, handle.last_exit
        assert seen and max(seen) > 0  # it did run: its imports took CPU time
    finally:
        sup.stop(grace_s=5)
