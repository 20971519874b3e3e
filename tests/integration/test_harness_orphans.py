"""A test or benchmark killed with SIGKILL leaves no node behind (``node/testing.py``).

The harness starts nodes in their own session, so nothing else would stop them:
orphan nodes were found running an hour later.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from node.testing import REPO, NodeProcess, leftover_processes, node_cgroup_dirs, wait_for

#: The harness under test: start a node, say what it made, then wait to be killed.
HARNESS = """
import json, sys, time
from node.testing import NodeProcess
node = NodeProcess(json.loads(sys.argv[1])).start()
status = node.status()
pids = [node.proc.pid] + [p["pid"] for p in status["processes"] if p["pid"]]
print(json.dumps({"run_dir": str(node.run_dir), "pids": pids}), flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Exited (a zombie counts: whoever inherited it may never reap it)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_killed_harness_takes_its_node_and_workers_along(tmp_path: Path) -> None:
    sections = {
        "workers": {"engine": "test", "count": 2, "test_token_ms": 10},
        "fallback": {"rules": ""},
    }
    stderr = tmp_path / "harness.err"
    with open(stderr, "wb") as err:
        harness = subprocess.Popen(
            [sys.executable, "-c", HARNESS, json.dumps(sections)],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=REPO,
        )
    assert harness.stdout is not None
    line = harness.stdout.readline()
    run_dir: Path | None = None
    try:
        assert line, stderr.read_text()
        made = json.loads(line)
        run_dir, pids = Path(made["run_dir"]), made["pids"]
        cgroups = node_cgroup_dirs(run_dir)  # none without cgroups (not root)
        assert len(pids) == 3 and not any(gone(p) for p in pids)

        harness.kill()
        harness.wait(timeout=10)

        # The node's SIGTERM path stops the workers and removes the cgroups.
        wait_for(lambda: all(gone(p) for p in pids), timeout=10)
        wait_for(lambda: not any(d.exists() for d in cgroups), timeout=5)
        assert leftover_processes(run_dir) == []
        assert "edgenode stopped" in (run_dir / "node-stdout.log").read_text()
    finally:
        harness.kill()
        harness.wait()
        harness.stdout.close()
        if run_dir is not None:
            for pid in leftover_processes(run_dir):
                psutil.Process(pid).kill()
            shutil.rmtree(run_dir, ignore_errors=True)


def test_a_node_is_started_from_the_main_thread_only() -> None:
    """Its parent-death signal would fire as soon as a helper thread that started it ended."""
    node = NodeProcess({"workers": {"engine": "test", "count": 1}, "fallback": {"rules": ""}})
    errors: list[BaseException] = []

    def start() -> None:
        try:
            node.start(timeout=5)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    try:
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "main thread" in str(errors[0])
        assert node.proc is None
    finally:
        node.cleanup()
