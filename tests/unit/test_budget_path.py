"""The memory budget honours every limit on the node's cgroup path (fake cgroupfs trees).

v1: limit_in_bytes, memsw, the kernel's hierarchical figure in memory.stat, and
use_hierarchy; v2: memory.max and memory.high of each ancestor. The node's path:
the running node's, else workers.cgroup_root, else this process's own cgroup.
Real v1 cgroups: tests/system/test_budget_cgroups.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import node.capacity.budget
from capacitykit import cgroup_memory_limit, fake_host, memory_reading
from node.capacity.budget import (
    CgroupLimit,
    configured_budget,
    detect_budget,
    node_limit,
    tightest_limit,
)
from node.config import NodeConfig, PressureSection, from_dict
from node.pressure import LIMIT_TTL_S, PressureMonitor
from node.sandbox.driver import MemoryReading

MiB, GiB = 1 << 20, 1 << 30
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
UNLIMITED = "9223372036854771712"
MEM = "sys/fs/cgroup/memory"


def v1_stat(limit: str = UNLIMITED, memsw: str = UNLIMITED) -> str:
    return (
        f"cache 0\nrss 0\nhierarchical_memory_limit {limit}\n"
        f"hierarchical_memsw_limit {memsw}\ntotal_inactive_file 0"
    )


def v1_cgroup(path: str, limit: str = UNLIMITED, **extra: str) -> dict[str, str]:
    """The memory files of one v1 cgroup (``path`` under the memory mount)."""
    d = f"{MEM}/{path}".rstrip("/")
    files = {
        f"{d}/memory.limit_in_bytes": limit,
        f"{d}/memory.memsw.limit_in_bytes": extra.pop("memsw", limit),
        f"{d}/memory.use_hierarchy": extra.pop("use_hierarchy", "1"),
        f"{d}/memory.stat": extra.pop("stat", v1_stat()),
    }
    assert not extra
    return files


# ---------------------------------------------------------------- v1


def test_v1_the_kernels_hierarchical_limit_covers_ancestors_the_mount_hides(
    tmp_path: Path,
) -> None:
    """A container sees its subtree only: the limit set above it is invisible as a
    file, but the kernel's hierarchical_memory_limit in memory.stat carries it."""
    files = {
        **v1_cgroup(""),
        **v1_cgroup("app"),
        **v1_cgroup("app/node", stat=v1_stat(limit=str(768 * MiB))),
    }
    host = fake_host(tmp_path, V1_MOUNTS, "4:memory:/app/node\n0::/\n", files)
    limit = tightest_limit(host)
    assert limit is not None and limit.bytes == 768 * MiB
    assert limit.source.endswith("app/node/memory.stat hierarchical_memory_limit")


def test_v1_memsw_and_every_ancestor_count(tmp_path: Path) -> None:
    files = {**v1_cgroup(""), **v1_cgroup("p", memsw=str(900 * MiB)), **v1_cgroup("p/c")}
    host = fake_host(tmp_path, V1_MOUNTS, "4:memory:/p/c\n", files)
    assert tightest_limit(host) == CgroupLimit(
        900 * MiB, f"{tmp_path}/{MEM}/p/memory.memsw.limit_in_bytes"
    )


def test_v1_a_parent_that_does_not_account_its_children_does_not_limit_them(
    tmp_path: Path,
) -> None:
    """memory.use_hierarchy = 0: the parent's limit covers its own tasks only
    (cgroup-v1/memory.rst 6), so it is no budget for the node below it."""
    files = {
        **v1_cgroup(""),
        **v1_cgroup("p", limit=str(256 * MiB), use_hierarchy="0"),
        **v1_cgroup("p/c", limit=str(GiB)),
    }
    host = fake_host(tmp_path, V1_MOUNTS, "4:memory:/p/c\n", files)
    assert cgroup_memory_limit(host) == GiB


# ---------------------------------------------------------------- v2


def test_v2_an_ancestors_memory_high_counts_as_well_as_memory_max(tmp_path: Path) -> None:
    base = "sys/fs/cgroup/system.slice"
    files = {
        f"{base}/memory.max": str(2 * GiB),
        f"{base}/memory.high": str(1536 * MiB),  # throttled and reclaimed above it
        f"{base}/edgenode.service/memory.max": "max",
        f"{base}/edgenode.service/memory.high": "max",
    }
    host = fake_host(tmp_path, V2_MOUNT, "0::/system.slice/edgenode.service\n", files)
    limit = tightest_limit(host)
    assert limit is not None and limit.bytes == 1536 * MiB
    assert limit.source.endswith("system.slice/memory.high")


# ---------------------------------------------------------------- the node's path


def config(tmp_path: Path, **workers: str) -> NodeConfig:
    return from_dict({"node": {"run_dir": str(tmp_path / "run")}, "workers": workers})


def test_the_cgroup_root_is_the_nodes_path_when_no_node_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's tree goes under workers.cgroup_root: its limit is the budget,
    not the limits (none) of the shell's own cgroup."""
    monkeypatch.setattr(
        node.capacity.budget, "node_limit", node_limit
    )  # the real one, on a fake host
    files = {
        "sys/fs/cgroup/user.slice/memory.max": "max",
        "sys/fs/cgroup/edgenode.slice/memory.max": str(600 * MiB),
    }
    host = fake_host(tmp_path, V2_MOUNT, "0::/user.slice\n", files)
    cfg = config(tmp_path, cgroup_root="/edgenode.slice")
    assert detect_budget(cfg, host) == (
        600 * MiB,
        f"cgroup limit {tmp_path}/sys/fs/cgroup/edgenode.slice/memory.max",
    )
    off = config(tmp_path, cgroup_root="/edgenode.slice", sandbox="off")
    assert node_limit(off, host) is None


#: Stands for a running node: holds its run directory's lock (argv[1]), says so, sleeps.
HOLDER = """
import sys, time
from pathlib import Path
from node.pidfile import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def stranger(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process that stands for a running node: it holds ``tmp_path/run``'s lock."""
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"locked\n"
    yield proc
    proc.kill()
    proc.wait()
    proc.stdout.close()


def test_a_running_nodes_cgroup_is_the_path_capacity_reads_from_any_shell(
    tmp_path: Path, stranger: subprocess.Popen[bytes]
) -> None:
    """``edgenode capacity`` from a shell outside the node's cgroup sees the node's budget."""
    files = {
        **v1_cgroup(""),
        **v1_cgroup("shell"),
        **v1_cgroup("svc", limit=str(700 * MiB)),
        **v1_cgroup("svc/edgenode-1/node"),
    }
    host = fake_host(tmp_path, V1_MOUNTS, "4:memory:/shell\n", files)
    (tmp_path / "proc" / str(stranger.pid)).mkdir()
    (tmp_path / "proc" / str(stranger.pid) / "cgroup").write_text("4:memory:/svc/edgenode-1/node\n")
    cfg = config(tmp_path)
    assert tightest_limit(host) is None  # the shell's own path: no limit
    limit = node_limit(cfg, host)
    assert limit is not None and limit.bytes == 700 * MiB


def test_a_configured_budget_above_the_cgroup_limit_is_cut_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = CgroupLimit(GiB, "/sys/fs/cgroup/memory/p/memory.limit_in_bytes")
    monkeypatch.setattr(node.capacity.budget, "node_limit", lambda config, host=None: limit)
    cfg = from_dict({"capacity": {"memory_budget": "8G"}})
    budget, source = configured_budget(cfg)
    assert budget == GiB
    assert source == (
        "capacity.memory_budget 8 GiB cut to the cgroup limit "
        "/sys/fs/cgroup/memory/p/memory.limit_in_bytes"
    )
    below = from_dict({"capacity": {"memory_budget": "512M"}})
    assert configured_budget(below) == (512 * MiB, "capacity.memory_budget")


# ---------------------------------------------------------------- pressure


class Reading:
    def __init__(self, current: int, limit: int | None = None) -> None:
        self.reading = memory_reading(current, limit=limit)

    def memory(self, worker_id: str | None = None) -> MemoryReading | None:
        return self.reading


def test_pressure_measures_against_the_parents_limit_not_the_workers_sum() -> None:
    """The fault: the node's own cgroup has no limit, its parent has 1 GiB, the
    workers' limits sum to 3 GiB. At 900 MiB the kernel is about to OOM-kill,
    while the old budget (3 GiB) said 29 %: ``critical`` could never fire first."""
    parent = CgroupLimit(GiB, "/sys/fs/cgroup/memory/p/memory.limit_in_bytes")
    settings = PressureSection(poll_ms=0)
    mon = PressureMonitor(settings, Reading(980 * MiB), 3 * GiB, limit=lambda: parent)
    assert mon.poll(0.0) == "critical"
    snap = mon.snapshot()
    assert snap["budget"] == GiB
    assert snap["budget_source"] == "cgroup limit /sys/fs/cgroup/memory/p/memory.limit_in_bytes"
    # A configured pressure.budget above the limit is cut to it as well.
    configured = PressureSection(poll_ms=0, budget="4G")
    mon = PressureMonitor(configured, Reading(900 * MiB), None, limit=lambda: parent)
    assert mon.poll(0.0) == "high"
    assert mon.snapshot()["budget"] == GiB
    assert mon.snapshot()["budget_kind"] == "cgroup"


def test_the_budget_says_what_kind_it_is() -> None:
    """``status`` tells a lowered cgroup limit from the node's own figure by it."""
    limit = CgroupLimit(GiB, "/sys/fs/cgroup/memory/p/memory.limit_in_bytes")
    cases = [
        (PressureSection(poll_ms=0), None, "node"),
        (PressureSection(poll_ms=0), limit, "cgroup"),
        (PressureSection(poll_ms=0, budget="512M"), limit, "configured"),
        (PressureSection(poll_ms=0, budget="512M"), None, "configured"),
    ]
    for settings, path_limit, kind in cases:
        mon = PressureMonitor(settings, Reading(100 * MiB), 3 * GiB, limit=lambda p=path_limit: p)
        mon.poll(0.0)
        assert mon.snapshot()["budget_kind"] == kind, (settings, path_limit)


def test_pressure_reads_the_paths_limits_once_per_ttl_and_sees_a_new_limit_after_it() -> None:
    """Reading every ancestor's limit files on each 250 ms poll was a fifth of the
    broker's CPU at 4 concurrent; the path's limits are read once per ``LIMIT_TTL_S``
    and an operator's new, lower limit still turns the level within that time."""
    reads: list[float] = []
    limit = [CgroupLimit(4 * GiB, "/sys/fs/cgroup/memory/p/memory.limit_in_bytes")]

    def source() -> CgroupLimit:
        reads.append(0.0)
        return limit[0]

    mon = PressureMonitor(PressureSection(poll_ms=250), Reading(900 * MiB), None, limit=source)
    polls = [i * 0.25 for i in range(int(LIMIT_TTL_S / 0.25))]
    assert [mon.poll(t) for t in polls] == [None] * len(polls)
    assert len(reads) == 1
    limit[0] = CgroupLimit(GiB, "/sys/fs/cgroup/memory/p/memory.limit_in_bytes")
    assert mon.poll(LIMIT_TTL_S) == "high"
    assert len(reads) == 2
    assert mon.snapshot()["budget"] == GiB
