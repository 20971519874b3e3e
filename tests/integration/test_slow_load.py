"""A worker's READY timeout judges its load by progress (node.supervisor.READY_CAP_FACTOR).

A load starved of CPU (the default ``workers.nice = 10`` on a busy host got 5-7 % of a
core) takes longer than ``workers.ready_timeout_ms`` yet makes progress: it is not
killed, and ``edgenode start`` waits for it past ``--wait-s``. A load that makes none
(SIGSTOP, or a worker that only wakes for heartbeats) is killed after the timeout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from node.engine import EngineSpec
from node.supervisor import LOAD_MIN_CPU_SHARE, Supervisor
from node.testing import REPO, NodeProcess, cgroups_usable, leftover_processes, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]

#: Nobody listens there: the worker loads, then waits for a broker forever.
NO_BROKER = "tcp://127.0.0.1:1"


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


#: A cgroup v1 cpu hierarchy this test may make a cgroup in (this host's kind).
CPU_V1 = Path("/sys/fs/cgroup/cpu")


@contextlib.contextmanager
def cpu_starved(share: float) -> Iterator[Path]:
    """A cpu cgroup (v1) whose processes get ``share`` of one core (cfs quota per
    100 ms period); yields its ``cgroup.procs``. Removed on exit, its processes
    moved back to the root first."""
    group = CPU_V1 / f"edgenode-test-starved-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(share * 100_000)))
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_V1 / "cgroup.procs").write_text(pid)
        group.rmdir()


def worker_pid(run_dir: Path) -> int | None:
    """The pid of the (first) model worker of the node serving ``run_dir``, once spawned."""
    for pid in leftover_processes(run_dir):
        with contextlib.suppress(psutil.Error):
            if "node.worker" in psutil.Process(pid).cmdline():
                return pid
    return None


#: How long the starved load should take (s): past the start's ``--wait-s`` (3 s) and
#: the 3 s READY timeout, within the 30 s cap (READY_CAP_FACTOR x the timeout).
STARVED_LOAD_S = 10.0


def load_cpu_seconds(make_node: NodeFactory) -> float:
    """CPU seconds a test-engine worker's start takes on this machine, unstarved (0.13 s
    on a fast day, ~0.45 s on a slow one: a fixed share made the starved load's length
    vary 3x with the machine)."""
    node = make_node(workers={"count": 1})
    (llm,) = node.status()["processes"]
    used = psutil.Process(llm["pid"]).cpu_times()
    node.stop()
    return float(used.user + used.system)


@pytest.mark.skipif(
    not cgroups_usable() or not os.access(CPU_V1 / "cgroup.procs", os.W_OK),
    reason="needs root, the sandbox and a cgroup v1 cpu hierarchy",
)
def test_a_cpu_starved_load_past_the_ready_timeout_is_not_killed_and_start_waits_for_it(
    make_node: NodeFactory,
) -> None:
    # The model worker is moved, as soon as it exists, into a cpu cgroup giving it the
    # share of a core that makes its start take ~STARVED_LOAD_S, past both the 3 s READY
    # timeout and the start's 3 s wait (the node itself runs at full speed), and within
    # the 30 s cap. At least 1.5 x the least progress the supervisor accepts
    # (LOAD_MIN_CPU_SHARE). No workers.cpu_quota: the worker joins no cpu cgroup of its
    # own and stays in the starved one.
    share = max(1.5 * LOAD_MIN_CPU_SHARE, load_cpu_seconds(make_node) / STARVED_LOAD_S)
    node = make_node(
        start=False,
        workers={"count": 1, "sandbox": "required", "ready_timeout_ms": 3000},
        # Liveness the starved worker can keep once serving (not the harness's 0.3 s):
        # this test is about its load, not the broker's heartbeats.
        broker={"heartbeat_interval_ms": 1000, "heartbeat_liveness": 10},
    )
    with cpu_starved(share) as procs:
        start = subprocess.Popen(
            node._argv("start", "--wait-s", "3"),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            pid = wait_for(lambda: worker_pid(node.run_dir), timeout=30, every=0.005)
            procs.write_text(str(pid))
            out, err = start.communicate(timeout=50)
            assert start.returncode == 0, err
            # The starved process itself became ready: never killed and respawned
            # (a respawn would be out of the starved cgroup, and fast).
            (llm,) = node.status()["processes"]
            assert (llm["pid"], llm["state"], llm["restarts"]) == (pid, "ready", 0), llm
            assert llm["last_exit"] == "" and llm["loading"] is None, llm
            assert "still loading after 3s and making progress" in out, (share, out)
            assert "edgenode running: 1 model worker(s) ready" in out
            assert "not READY" not in (node.run_dir / "logs" / "node.log").read_text()
        finally:
            if start.poll() is None:
                start.kill()
                start.wait()
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
        caps: set[int] = set()

        def loading() -> bool:
            sup.tick(time.monotonic())
            (row,) = sup.status()
            if row["loading"] is not None:
                seen.append(row["loading"]["cpu_s"])
                caps.add(row["loading"]["cap_ms"])
            return handle.state != "starting"

        wait_for(loading, timeout=40, every=0.05)
        assert "made no progress" in handle.last_exit, handle.last_exit
        assert seen and max(seen) > 0  # it did run: its imports took CPU time
        # The cap `edgenode start` reads instead of working it out: 10 x the 1.5 s timeout.
        assert caps == {15_000}
    finally:
        sup.stop(grace_s=5)
