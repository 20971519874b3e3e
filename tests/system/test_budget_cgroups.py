"""The memory budget honours a parent cgroup's limit, on real v1 cgroups (root, v1 or
hybrid host): a parent with a memory limit, the node started inside a child of it.

The fault: the pressure budget came from the node's own cgroup (no limit) or,
without one, from the workers' limits summed, so inside a limited parent it
was larger than what the kernel enforces and ``critical`` could never fire
before the OOM killer; ``edgenode capacity`` run from a shell outside the
node's cgroup saw the host's RAM. Now ``status`` (plan and pressure) and
``capacity`` from any shell name the same budget: the parent's limit.
Fake v2 trees and the other v1 files: tests/unit/test_budget_path.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from node.sandbox.cgroupfs import Host
from node.sandbox.layout import read_layout
from node.testing import NodeProcess, wait_for

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]
MiB = 1 << 20
LIMIT = 800 * MiB
#: Joins the cgroup.procs file given as argv[1], touches argv[2] MiB, then waits.
HOG = """
import sys, time
open(sys.argv[1], "w").write("0")
block = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def parent() -> Iterator[Path]:
    """A v1 memory cgroup with an 800 MiB limit (and a child ``shell``) under this
    process's own; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    layout = read_layout(Host())
    if "memory" not in layout.v1 or "memory" not in layout.own_v1:
        pytest.skip("no cgroup v1 memory controller (v2 is covered by fake trees)")
    directory = layout.v1["memory"].dir_of(layout.own_v1["memory"]) / f"en-budget-{os.getpid()}"
    directory.mkdir()
    try:
        (directory / "memory.limit_in_bytes").write_text(str(LIMIT))
        (directory / "shell").mkdir()
        yield directory
    finally:
        # Leaves first; a node's tree left by a failed test goes too once it is empty.
        for d in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
            wait_for(lambda d=d: not (d / "cgroup.procs").read_text().split())
            d.rmdir()
        directory.rmdir()


@contextlib.contextmanager
def inside(cgroup: Path) -> Iterator[None]:
    """Run this process in ``cgroup`` (its children started meanwhile stay there)."""
    home = Path(f"/proc/{os.getpid()}/cgroup").read_text()
    memory = next(line.split(":", 2)[2] for line in home.splitlines() if ":memory:" in line)
    back = read_layout(Host()).v1["memory"].dir_of(memory) / "cgroup.procs"
    (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    try:
        yield
    finally:
        back.write_text(str(os.getpid()))


def capacity_from_this_shell(node: NodeProcess) -> dict[str, object]:
    """``edgenode capacity --json`` run from the test's own cgroup, not the node's."""
    result = node.cli("capacity", "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, object] = json.loads(result.stdout)
    return data


def test_a_node_inside_a_limited_parent_budgets_the_parents_limit_everywhere(
    parent: Path,
    make_node: NodeFactory,  # this order: the node is stopped before rmdir
) -> None:
    with inside(parent / "shell"):
        node = make_node(
            workers={"count": 1, "sandbox": "required", "memory_max": "1G"},
            capacity={"reserve": "64M"},
            pressure={"high_pct": 60.0, "critical_pct": 95.0, "clear_pct": 50.0, "poll_ms": 100},
        )
    assert node.proc is not None
    assert f"{parent.name}/shell" in Path(f"/proc/{node.proc.pid}/cgroup").read_text()
    limit_file = f"cgroup limit {parent}/memory.limit_in_bytes"

    status = wait_for(lambda: (s := node.status())["memory"].get("budget") and s)
    assert (status["memory"]["budget"], status["capacity"]["budget"]) == (LIMIT, LIMIT)
    plan = capacity_from_this_shell(node)
    assert plan["budget"] == LIMIT
    assert status["memory"]["budget_source"] == limit_file
    assert status["capacity"]["budget_source"] == plan["budget_source"] == limit_file

    # 520 MiB in the node's cgroup is 65 % of the parent's limit: high pressure,
    # where the old budget (1 GiB of worker limit + the node's share) said ~45 %.
    leaf = Path(status["sandbox"]["cgroup"]) / "node" / "cgroup.procs"
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(leaf), "520"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        high = wait_for(lambda: (s := node.status())["pressure"] != "ok" and s)
        assert high["memory"]["used_pct"] >= 60.0
    finally:
        hog.kill()
        hog.wait()
        if hog.stdout is not None:
            hog.stdout.close()
    assert hog.returncode == -9  # killed by the test, not by the OOM killer
    wait_for(lambda: node.status()["pressure"] == "ok")
    assert node.stop() == 0


def test_capacity_inside_a_child_of_a_limited_parent_plans_the_parents_limit(
    parent: Path, tmp_path: Path
) -> None:
    config = tmp_path / "edgenode.toml"
    config.write_text('[workers]\nengine = "test"\ncount = 1\n[capacity]\nreserve = "64M"\n')
    procs = parent / "shell" / "cgroup.procs"
    join = f"open({str(procs)!r}, 'w').write('0'); import runpy; runpy.run_module"
    cmd = [
        sys.executable,
        "-c",
        f"import sys; {join}('node.cli', run_name='__main__')",
        "-c",
        str(config),
        "--run-dir",
        str(tmp_path / "run"),
        "capacity",
        "--json",
    ]
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2]
    )
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["budget"] == LIMIT
    assert plan["budget_source"] == f"cgroup limit {parent}/memory.limit_in_bytes"
