"""The sandbox on fake cgroupfs trees: v2, v1 and hybrid layouts, limits, readings,
stale reaping, degraded modes; plus the size parser and the config keys it reads.

The fake kernel creates the interface files a real ``mkdir`` would (with a new
cgroup's default values), refuses ``rmdir`` of a busy cgroup, and makes SIGKILL
take a pid out of every ``cgroup.procs``. No real process is ever signalled.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
from pathlib import Path

import pytest

from broker.errors import ConfigError, SandboxError
from node.capacity.worker_limits import memory_high_bytes
from node.config import WorkersSection, from_dict, validate
from node.sandbox.cgroupfs import V1_UNLIMITED, Host
from node.sandbox.cgroups import Sandbox, cgroup_name, join_cgroup, limits_for, options_for
from node.sandbox.cores import plan_workers
from node.sandbox.driver import Limits, SandboxOptions
from node.sandbox.layout import parse_layout
from node.units import format_size, parse_size

NODE_PID = 4242
SERVICE = "/system.slice/edgenode.service"
UNL = str(V1_UNLIMITED)
EVENTS = "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n"

V1_ONLY = (
    "memory.limit",
    "memory.memsw",
    "memory.usage",
    "memory.max_usage",
    "memory.failcnt",
    "memory.oom_control",
    "memory.swappiness",
    "cpu.cfs",
    "cpu.shares",
)
#: What a fresh cgroup's files hold (cgroup-v2.rst, cgroup-v1/memory.rst, cpusets.rst).
NEW_CGROUP = {
    "cgroup.procs": "",
    "cgroup.subtree_control": "",
    "cgroup.kill": "",
    "memory.current": "0",
    "memory.peak": "0",
    "memory.max": "max",
    "memory.high": "max",
    "memory.swap.max": "max",
    "memory.swap.current": "0",
    "memory.oom.group": "0",
    "memory.events": EVENTS,
    "cpu.max": "max 100000",
    "cpu.weight": "100",
    "cpuset.cpus": "",
    "cpuset.mems": "",
    "memory.limit_in_bytes": UNL,
    "memory.memsw.limit_in_bytes": UNL,
    "memory.usage_in_bytes": "0",
    "memory.max_usage_in_bytes": "0",
    "memory.memsw.usage_in_bytes": "0",
    "memory.failcnt": "0",
    "memory.memsw.failcnt": "0",
    "memory.oom_control": OOM_CONTROL,
    "memory.swappiness": "60",
    "cpu.cfs_period_us": "100000",
    "cpu.cfs_quota_us": "-1",
    "cpu.shares": "1024",
}
V2_ROOT = {
    "cgroup.procs": "1\n",
    "cgroup.controllers": "cpuset cpu io memory pids",
    "cgroup.subtree_control": "cpuset cpu io memory pids",
    "cpuset.cpus.effective": "0-3",
}
#: The v2 interface files of a non-root cgroup with cpu, cpuset and memory enabled.
V2_CGROUP = [name for name in NEW_CGROUP if not name.startswith(V1_ONLY)] + ["cgroup.controllers"]
V1_ROOTS = {
    "memory": {
        "cgroup.procs": "1\n",
        "memory.usage_in_bytes": "1000000",
        "memory.limit_in_bytes": UNL,
        "memory.memsw.limit_in_bytes": UNL,
        "memory.max_usage_in_bytes": "0",
        "memory.memsw.usage_in_bytes": "0",
        "memory.failcnt": "0",
        "memory.memsw.failcnt": "0",
        "memory.oom_control": OOM_CONTROL,
        "memory.swappiness": "60",
    },
    "cpu,cpuacct": {
        "cgroup.procs": "1\n",
        "cpu.cfs_period_us": "100000",
        "cpu.shares": "1024",
        "cpu.cfs_quota_us": "-1",
    },
    "cpuset": {"cgroup.procs": "1\n", "cpuset.cpus": "0-3", "cpuset.mems": "0"},
}
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
    "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd\n"
)
HYBRID_UNIFIED = "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"


class FakeKernel:
    """A cgroupfs made of plain files under ``tmp_path``, with just enough kernel."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.proc = tmp_path / "proc"
        (self.proc / "self").mkdir(parents=True)
        self.killed: list[int] = []
        self.denied: set[Path] = set()  # files a non-root node may not write

    # -- what a kernel does
    def mkdir(self, path: Path) -> None:
        os.mkdir(path)
        for item in path.parent.iterdir():
            if item.is_file() and item.name in NEW_CGROUP:
                (path / item.name).write_text(NEW_CGROUP[item.name])
        controllers = path.parent / "cgroup.subtree_control"
        if controllers.exists():
            enabled = [c.lstrip("+") for c in controllers.read_text().split()]
            (path / "cgroup.controllers").write_text(" ".join(enabled))

    def rmdir(self, path: Path) -> None:
        if any(p.is_dir() for p in path.iterdir()) or self.procs(path):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
        for item in path.iterdir():
            item.unlink()
        os.rmdir(path)

    def kill(self, pid: int, sig: int) -> None:
        assert sig == signal.SIGKILL
        self.killed.append(pid)
        for procs in self.root.rglob("cgroup.procs"):
            self._drop(procs, pid)

    def write(self, path: Path, value: str) -> None:
        if not path.exists():  # cgroupfs has no O_CREAT
            raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        if path in self.denied:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        if path.name == "cgroup.procs":
            self._attach(path.parent, int(value))
        elif path.name == "cgroup.kill":
            for sub in path.parent.rglob("cgroup.procs"):
                for pid in self.procs(sub.parent):
                    self.kill(pid, signal.SIGKILL)
        elif path.name == "cgroup.subtree_control":
            self._subtree_control(path, value)
        else:
            path.write_text(value)

    def _attach(self, cgroup: Path, pid: int) -> None:
        top = self._top(cgroup)
        for name in ("cpuset.cpus", "cpuset.mems"):  # cpusets.rst 1.9 (v1)
            if "sys/fs/cgroup/cpuset" in str(cgroup) and not (cgroup / name).read_text():
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(cgroup))
        control = cgroup / "cgroup.subtree_control"
        if cgroup != top and control.exists() and control.read_text().split():
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(cgroup))  # v2 rule
        for procs in top.rglob("cgroup.procs"):
            self._drop(procs, pid)
        (cgroup / "cgroup.procs").write_text(" ".join(map(str, [*self.procs(cgroup), pid])))

    def _subtree_control(self, path: Path, value: str) -> None:
        enabled = path.read_text().split()
        for word in value.split():
            name = word[1:]
            if word.startswith("+"):
                if self.procs(path.parent) and path.parent != self._top(path.parent):
                    raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
                enabled = sorted({*enabled, name})
            else:
                enabled = [c for c in enabled if c != name]
        path.write_text(" ".join(enabled))

    def _top(self, cgroup: Path) -> Path:
        """The hierarchy's root: a v1 controller mount, else the v2 mount."""
        tops = [self.root / "sys/fs/cgroup" / h for h in V1_ROOTS] + [self.root / "sys/fs/cgroup"]
        return next(t for t in tops if cgroup.is_relative_to(t))

    @staticmethod
    def _drop(procs: Path, pid: int) -> None:
        kept = [p for p in procs.read_text().split() if p != str(pid)]
        procs.write_text("\n".join(kept))

    def host(self, pid: int = NODE_PID) -> Host:
        return Host(self.root, self.proc, pid, self.mkdir, self.rmdir, self.kill, self.write)

    # -- building trees
    def mount_v2(self, own: str = SERVICE, at: str = "sys/fs/cgroup") -> Path:
        top = self.root / at
        top.mkdir(parents=True)
        for name, value in V2_ROOT.items():
            (top / name).write_text(value)
        for name in V2_CGROUP:  # the root lacks some, but children get them all
            if not (top / name).exists():
                (top / name).write_text(NEW_CGROUP.get(name, ""))
        own_dir = self.make(top, own)
        for d in [own_dir, *own_dir.parents][: len(own_dir.relative_to(top).parts)]:
            # systemd enables the controllers down to a delegated unit.
            (d / "cgroup.controllers").write_text(V2_ROOT["cgroup.controllers"])
            if d != own_dir:
                (d / "cgroup.subtree_control").write_text(V2_ROOT["cgroup.controllers"])
        (own_dir / "cgroup.procs").write_text(f"{NODE_PID}\n")
        return own_dir

    def mount_v1(self, own: dict[str, str], skip: tuple[str, ...] = ()) -> dict[str, Path]:
        dirs: dict[str, Path] = {}
        for hierarchy, files in V1_ROOTS.items():
            if hierarchy in skip:
                continue
            top = self.root / "sys/fs/cgroup" / hierarchy
            top.mkdir(parents=True)
            for name, value in files.items():
                (top / name).write_text(value)
            path = own.get(hierarchy.split(",")[0], "/")
            dirs[hierarchy] = self.make(top, path)
            (dirs[hierarchy] / "cgroup.procs").write_text(f"{NODE_PID}\n")
        return dirs

    def make(self, top: Path, cgroup: str) -> Path:
        path = top
        for part in filter(None, cgroup.split("/")):
            path = path / part
            if not path.exists():
                self.mkdir(path)
        return path

    def set_self(self, mountinfo: str, cgroup: str) -> None:
        (self.proc / "self" / "mountinfo").write_text(mountinfo)
        (self.proc / "self" / "cgroup").write_text(cgroup)

    def live(self, pid: int) -> None:
        (self.proc / str(pid)).mkdir()
        (self.proc / str(pid) / "cmdline").write_bytes(b"python\0-m\0node.cli\0start\0")

    @staticmethod
    def procs(path: Path) -> list[int]:
        procs = path / "cgroup.procs"
        return [int(p) for p in procs.read_text().split()] if procs.exists() else []


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return FakeKernel(tmp_path)


def v2_host(kernel: FakeKernel, own: str = SERVICE) -> Path:
    own_dir = kernel.mount_v2(own)
    kernel.set_self(V2_MOUNT, f"0::{own}\n")
    return own_dir


def v1_host(kernel: FakeKernel, hybrid: bool = True, skip: tuple[str, ...] = ()) -> dict[str, Path]:
    own = {"memory": SERVICE, "cpu": SERVICE, "cpuset": "/"}
    dirs = kernel.mount_v1(own, skip)
    mounts = "".join(
        line for line in V1_MOUNTS.splitlines(keepends=True) if not any(s in line for s in skip)
    )
    kernel.set_self(
        mounts + (HYBRID_UNIFIED if hybrid else ""),
        f"4:memory:{SERVICE}\n3:cpuset:/\n2:cpu,cpuacct:{SERVICE}\n1:name=systemd:{SERVICE}\n0::/\n",
    )
    return dirs


def opts(mode: str = "required", **kw: object) -> SandboxOptions:
    base: dict[str, object] = {"need": frozenset({"memory", "cpu", "cpuset"}), **kw}
    return SandboxOptions(mode=mode, **base)  # type: ignore[arg-type]


LIMITS = Limits(
    memory_max=512 * 2**20, memory_high=460 * 2**20, cpu_quota_us=50_000, cpus=(1,), nice=10
)

# ---------------------------------------------------------------- detection


def test_layout_of_this_kind_of_host_is_hybrid_and_uses_v1_paths() -> None:
    layout = parse_layout(V1_MOUNTS + HYBRID_UNIFIED, "4:memory:/a/b\n3:cpuset:/\n0::/\n")
    assert layout.kind == "hybrid"
    assert layout.v1["memory"].point == Path("/sys/fs/cgroup/memory")
    assert layout.v1["cpu"] is layout.v1["cpuacct"]  # one co-mounted hierarchy
    assert "systemd" not in layout.v1 and "name=systemd" not in layout.v1
    assert layout.own_v1 == {"memory": "/a/b", "cpuset": "/"} and layout.own_v2 == "/"
    assert layout.v2 is not None and layout.v2.point == Path("/sys/fs/cgroup/unified")


def test_layout_kinds() -> None:
    assert parse_layout(V2_MOUNT, "0::/x\n").kind == "v2"
    assert parse_layout(V1_MOUNTS, "4:memory:/\n").kind == "v1"
    assert parse_layout("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n", "").kind == "none"


def test_mount_root_and_escapes_are_honoured(tmp_path: Path) -> None:
    # A container sees its cgroup mounted at its own root; a space is "\040" in mountinfo.
    info = "50 40 0:30 /docker/abc /sys/fs/cgroup/my\\040mem rw - cgroup cgroup rw,memory\n"
    layout = parse_layout(info, "4:memory:/docker/abc/svc\n", root=tmp_path)
    mount = layout.v1["memory"]
    assert mount.point == tmp_path / "sys/fs/cgroup/my mem"
    assert mount.dir_of("/docker/abc/svc") == tmp_path / "sys/fs/cgroup/my mem/svc"
    assert mount.dir_of("/svc") == tmp_path / "sys/fs/cgroup/my mem/svc"  # cgroup namespace


# ---------------------------------------------------------------- cgroup v2


def test_v2_nested_own_cgroup_gets_node_leaf_and_workers(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    box = Sandbox(opts(nice=10), kernel.host())
    box.open()
    base = own / "edgenode"
    assert box.active and box.driver.kind == "v2" and box.layout == "v2"
    assert box.base == str(base)
    assert kernel.procs(base / "node") == [NODE_PID]  # the node left its own cgroup
    assert (own / "cgroup.subtree_control").read_text() == "cpu cpuset memory"
    assert (base / "cgroup.subtree_control").read_text() == "cpu cpuset memory"
    # The tree weighs what a nice-10 process does among its siblings; inside it
    # the node's leaf keeps the default (100) ahead of the workers (11).
    assert (base / "cpu.weight").read_text() == "11"
    assert (base / "node" / "cpu.weight").read_text() == "100"

    paths = box.create_worker("llm-0", LIMITS)
    wdir = base / "worker-llm-0"
    assert paths == (str(wdir / "cgroup.procs"),)
    assert (wdir / "memory.max").read_text() == str(512 * 2**20)
    assert (wdir / "memory.high").read_text() == str(460 * 2**20)
    assert (wdir / "memory.swap.max").read_text() == "0"
    assert (wdir / "memory.oom.group").read_text() == "1"
    assert (wdir / "cpu.max").read_text() == "50000 100000"
    assert (wdir / "cpu.weight").read_text() == "11"  # nice 10: 110 / 1024 of nice 0's 100
    assert (wdir / "cpuset.cpus").read_text() == "1"

    box.attach("llm-0", 5001)
    assert box.holds("llm-0", 5001) and not box.holds("llm-0", 5002)
    assert box.cgroup_of("llm-0") == str(wdir)

    box.close()
    assert kernel.killed == [5001]  # via cgroup.kill
    assert not base.exists()
    assert kernel.procs(own) == [NODE_PID]  # moved back home
    assert (own / "cgroup.subtree_control").read_text() == ""  # as it was
    assert not box.active


def test_v2_readings_max_peak_and_oom_events(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", Limits(memory_max=None, memory_high=None))
        wdir = own / "edgenode" / "worker-llm-0"
        assert (wdir / "memory.max").read_text() == "max"
        assert (wdir / "cpu.max").read_text() == "max 100000"
        assert (wdir / "cpuset.cpus").read_text() == ""  # no cores given: inherit
        (wdir / "memory.current").write_text("300000000\n")
        (wdir / "memory.peak").write_text("400000000\n")
        (wdir / "memory.events").write_text(EVENTS.replace("oom_kill 0", "oom_kill 2"))
        reading = box.memory("llm-0")
        assert reading is not None
        assert (reading.current, reading.peak, reading.limit, reading.high) == (
            300_000_000,
            400_000_000,
            None,
            None,
        )
        assert reading.oom_kills == 2 and reading.limit_hits == 0 and reading.swap == 0
        assert not reading.over_high
        (wdir / "memory.high").write_text("200000000\n")
        over = box.memory("llm-0")
        assert over is not None and over.over_high and over.as_dict()["over_high"] is True
        assert box.memory("nobody") is None


def test_v2_without_swap_accounting_or_peak_skips_those_files(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    for name in ("memory.swap.max", "memory.swap.current", "memory.peak", "cgroup.kill"):
        for d in (own, own.parent, own.parent.parent):
            (d / name).unlink(missing_ok=True)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        wdir = own / "edgenode" / "worker-llm-0"
        assert not (wdir / "memory.swap.max").exists()  # never created by a write
        reading = box.memory("llm-0")
        assert reading is not None and reading.peak is None and reading.swap is None


def test_v2_own_cgroup_with_other_processes(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    (own / "cgroup.procs").write_text(f"{NODE_PID}\n999\n")
    with pytest.raises(SandboxError, match="no internal processes") as info:
        Sandbox(opts(), kernel.host()).open()
    assert "required" in info.value.message
    assert not (own / "edgenode").exists()  # the failed open undid itself

    box = Sandbox(opts("auto"), kernel.host())
    box.open()
    assert not box.active and "999" in box.reason
    assert box.create_worker("llm-0", LIMITS) == ()
    assert box.memory("llm-0") is None


def test_v2_without_memory_controller_like_a_hybrid_unified_mount(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    (own / "cgroup.controllers").write_text("pids")
    with pytest.raises(SandboxError, match="memory"):
        Sandbox(opts(), kernel.host()).open()
    box = Sandbox(opts("auto"), kernel.host())
    box.open()
    assert not box.active and box.status()["backend"] == "none"


def test_v2_delegated_root_instead_of_own(kernel: FakeKernel) -> None:
    own = v2_host(kernel, own="/user.slice/session-1.scope")
    delegated = kernel.make(kernel.root / "sys/fs/cgroup", "/edgenode.delegated")
    with Sandbox(opts(cgroup_root="/edgenode.delegated"), kernel.host()) as box:
        assert box.base == str(delegated / "edgenode")
        box.create_worker("llm-0", LIMITS)
    assert not (delegated / "edgenode").exists() and delegated.exists()  # root left alone
    assert kernel.procs(own) == [NODE_PID]


def test_delegated_root_on_v1_for_a_non_root_node(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel)
    roots = [kernel.make(kernel.root / "sys/fs/cgroup" / h, "/deleg") for h in V1_ROOTS]
    for d in (dirs["memory"], dirs["cpuset"], dirs["cpu,cpuacct"]):
        kernel.denied.add(d / "cgroup.procs")  # where it came from is not its to write
    for name in ("cpuset.cpus", "cpuset.mems"):  # what setup-cgroup.sh copies down
        (roots[2] / name).write_text((roots[2].parent / name).read_text())
    with Sandbox(opts(cgroup_root="/deleg"), kernel.host()) as box:
        assert box.base == str(roots[0] / "edgenode")  # the memory hierarchy's
        box.create_worker("llm-0", LIMITS)
        assert (roots[2] / "edgenode" / "cpuset.mems").read_text() == "0"
    for root in roots:  # the node ends in the delegated root; what it made is gone
        assert kernel.procs(root) == [NODE_PID] and not (root / "edgenode").exists()


def test_empty_delegated_v1_cpuset_is_explained(kernel: FakeKernel) -> None:
    v1_host(kernel)
    for hierarchy in V1_ROOTS:  # made by hand, without copying cpus/mems down
        kernel.make(kernel.root / "sys/fs/cgroup" / hierarchy, "/deleg")
    with pytest.raises(SandboxError, match="a v1 cpuset without cpus/mems"):
        Sandbox(opts(cgroup_root="/deleg"), kernel.host()).open()


def test_cgroup_name_is_stable_per_run_dir_and_distinct_between_nodes(tmp_path: Path) -> None:
    one, two = tmp_path / "a", tmp_path / "b"
    assert cgroup_name(one) == cgroup_name(tmp_path / "x" / ".." / "a")
    assert cgroup_name(one) != cgroup_name(two)
    assert cgroup_name(one).startswith("edgenode-") and len(cgroup_name(one)) == 17


def test_missing_delegated_root_is_a_clear_error(kernel: FakeKernel) -> None:
    v2_host(kernel)
    with pytest.raises(SandboxError, match="does not exist"):
        Sandbox(opts(cgroup_root="/nope"), kernel.host()).open()


# ---------------------------------------------------------------- cgroup v1 / hybrid


def test_hybrid_uses_v1_and_copies_cpuset_from_the_parent(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel)
    with Sandbox(opts(nice=10), kernel.host()) as box:
        assert box.driver.kind == "v1" and box.layout == "hybrid"
        mem_base = dirs["memory"] / "edgenode"
        cpuset_base = dirs["cpuset"] / "edgenode"  # own cpuset is "/": a child of the root
        cpu_base = dirs["cpu,cpuacct"] / "edgenode"
        assert (cpu_base / "cpu.shares").read_text() == "110"  # the tree: nice 10's weight
        assert (cpu_base / "node" / "cpu.shares").read_text() == "1024"  # the broker: nice 0's
        for base in (mem_base, cpuset_base, cpu_base):
            assert kernel.procs(base / "node") == [NODE_PID]
        for d in (cpuset_base, cpuset_base / "node"):
            assert (d / "cpuset.cpus").read_text() == "0-3"
            assert (d / "cpuset.mems").read_text() == "0"

        paths = box.create_worker("llm-0", LIMITS)
        assert sorted(paths) == sorted(
            str(b / "worker-llm-0" / "cgroup.procs") for b in (mem_base, cpuset_base, cpu_base)
        )
        w = "worker-llm-0"
        assert (cpuset_base / w / "cpuset.cpus").read_text() == "1"
        assert (cpuset_base / w / "cpuset.mems").read_text() == "0"
        assert (mem_base / w / "memory.limit_in_bytes").read_text() == str(512 * 2**20)
        assert (mem_base / w / "memory.memsw.limit_in_bytes").read_text() == str(512 * 2**20)
        assert (mem_base / w / "memory.swappiness").read_text() == "0"
        assert (cpu_base / w / "cpu.cfs_quota_us").read_text() == "50000"
        assert (cpu_base / w / "cpu.cfs_period_us").read_text() == "100000"
        assert (cpu_base / w / "cpu.shares").read_text() == "110"  # nice 10's CFS weight

        box.attach("llm-0", 5001)
        assert box.holds("llm-0", 5001)
    for base in (mem_base, cpuset_base, cpu_base):
        assert not base.exists()
    assert kernel.procs(dirs["memory"]) == [NODE_PID] and kernel.procs(dirs["cpuset"]) == [NODE_PID]


def test_v1_readings_unlimited_oom_control_failcnt_and_watermark(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel, hybrid=False)
    with Sandbox(opts(), kernel.host()) as box:
        assert box.layout == "v1"
        box.create_worker("llm-0", Limits(memory_max=None, memory_high=100_000_000))
        w = dirs["memory"] / "edgenode" / "worker-llm-0"
        assert (w / "memory.limit_in_bytes").read_text() == "-1"
        (w / "memory.limit_in_bytes").write_text(UNL)  # what the kernel reads back for -1
        (w / "memory.usage_in_bytes").write_text("150000000")
        (w / "memory.memsw.usage_in_bytes").write_text("150004096")
        (w / "memory.max_usage_in_bytes").write_text("160000000")
        (w / "memory.oom_control").write_text(OOM_CONTROL.replace("oom_kill 0", "oom_kill 1"))
        (w / "memory.failcnt").write_text("37")
        reading = box.memory("llm-0")
        assert reading is not None
        assert reading.limit is None and reading.current == 150_000_000
        assert reading.peak == 160_000_000 and reading.swap == 4096
        assert reading.oom_kills == 1 and reading.limit_hits == 37 and reading.high_events is None
        assert reading.high == 100_000_000 and reading.over_high  # v1: the node's own watermark
        node = box.memory()
        assert node is not None and node.high is None


def test_v1_above_limit_hits_are_the_ancestors_failcnts_up_to_the_mount(
    kernel: FakeKernel,
) -> None:
    """What tells a kill by a limit above a worker's cgroup on v1: the failcnts of the
    node's tree and its parents (the mount point included: a container's cgroup has
    its limit there; the host's root has none, its counters stay 0), not the
    worker's own, nor its siblings'; a parent that does not account its children
    (memory.use_hierarchy 0, Linux < 5.11) ends the path."""
    dirs = v1_host(kernel, hybrid=False)
    own = dirs["memory"]  # <mount>/system.slice/edgenode.service
    top = own.parent.parent
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        box.create_worker("llm-1", LIMITS)
        base = own / "edgenode"
        (base / "worker-llm-0" / "memory.failcnt").write_text("500")  # its own: not above
        (base / "worker-llm-1" / "memory.failcnt").write_text("600")  # a sibling's
        for d, failcnt, memsw in (
            (base, 90, 2),
            (own, 0, 5),
            (own.parent, 300, 0),
            (top, 4000, 0),
        ):
            (d / "memory.failcnt").write_text(str(failcnt))
            (d / "memory.memsw.failcnt").write_text(str(memsw))
        reading = box.memory("llm-0")
        assert reading is not None
        assert (reading.limit_hits, reading.above_limit_hits) == (500, 4397)
        assert reading.own_limit_ooms is None  # v1 has no such count
        node = box.memory()
        # Only a worker's death is judged: the node's reading (the pressure poll's,
        # every 250 ms) does not walk the ancestors.
        assert node is not None and node.above_limit_hits is None
        (own.parent / "memory.use_hierarchy").write_text("0")
        cut = box.memory("llm-0")
        assert cut is not None and cut.above_limit_hits == 97


def test_v2_own_limit_ooms_are_the_workers_local_oom_events(kernel: FakeKernel) -> None:
    """v2's ``oom`` event: an OOM at this cgroup's own memory.max. memory.events is
    hierarchical since 5.2 (a tree's count includes its workers'), so the local
    file is read where the kernel has it."""
    own = v2_host(kernel)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        base = own / "edgenode"
        wdir = base / "worker-llm-0"
        (wdir / "memory.events").write_text(EVENTS.replace("oom 0", "oom 2"))
        (base / "memory.events").write_text(EVENTS.replace("oom 0", "oom 5"))
        reading = box.memory("llm-0")
        assert reading is not None
        assert (reading.own_limit_ooms, reading.above_limit_hits) == (2, None)
        node = box.memory()
        assert node is not None and node.own_limit_ooms == 5  # a kernel before 5.2
        (base / "memory.events.local").write_text(EVENTS.replace("oom 0", "oom 3"))
        node = box.memory()
        assert node is not None and node.own_limit_ooms == 3
        (wdir / "memory.events").write_text("max 0\noom_kill 0\n")  # no oom key
        reading = box.memory("llm-0")
        assert reading is not None and reading.own_limit_ooms is None


def test_v1_a_respawned_worker_does_not_show_the_dead_ones_peak(kernel: FakeKernel) -> None:
    # A new user saw PEAK 402 MiB for a worker still loading at 80 KiB after a restart.
    dirs = v1_host(kernel, hybrid=False)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        w = dirs["memory"] / "edgenode" / "worker-llm-0"
        (w / "memory.max_usage_in_bytes").write_text("421527552")  # the dead process's peak
        box.create_worker("llm-0", LIMITS)  # the respawn reuses the cgroup
        assert (w / "memory.max_usage_in_bytes").read_text() == "0"


def test_v1_without_memsw_writes_only_the_limit(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel)
    for d in (dirs["memory"], dirs["memory"].parent, dirs["memory"].parent.parent):
        (d / "memory.memsw.limit_in_bytes").unlink(missing_ok=True)
        (d / "memory.memsw.usage_in_bytes").unlink(missing_ok=True)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        w = dirs["memory"] / "edgenode" / "worker-llm-0"
        assert (w / "memory.limit_in_bytes").read_text() == str(512 * 2**20)
        assert not (w / "memory.memsw.limit_in_bytes").exists()
        reading = box.memory("llm-0")
        assert reading is not None and reading.swap is None


def test_v1_memsw_never_below_the_limit_while_writing(kernel: FakeKernel) -> None:
    v1_host(kernel)
    writes: list[str] = []

    def recording(path: Path, value: str) -> None:
        if path.name.startswith("memory.") and "limit" in path.name:
            writes.append(path.name)
        kernel.write(path, value)

    with Sandbox(opts(), dataclasses.replace(kernel.host(), write=recording)) as box:
        box.create_worker("llm-0", Limits(memory_max=100 * 2**20))  # a cut: limit first
        assert writes == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
        writes.clear()
        box.create_worker("llm-0", Limits(memory_max=200 * 2**20))  # a raise: memsw first
        assert writes == ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]


def test_v1_missing_cpuset_fails_required_and_is_skipped_in_auto(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel, skip=("cpuset",))
    with pytest.raises(SandboxError, match="cpuset"):
        Sandbox(opts(), kernel.host()).open()
    assert not (dirs["memory"] / "edgenode").exists()
    with Sandbox(opts("auto"), kernel.host()) as box:
        assert box.active
        assert len(box.create_worker("llm-0", LIMITS)) == 2  # memory and cpu only
    # Merely wanted (cores split without a reservation): skipped without complaint.
    quiet = opts("required", need=frozenset({"memory"}), want=frozenset({"cpuset"}))
    with Sandbox(quiet, kernel.host()) as box:
        assert box.active and len(box.create_worker("llm-0", LIMITS)) == 1


# ---------------------------------------------------------------- stale and removal


def test_stale_tree_of_a_dead_node_is_reaped(kernel: FakeKernel) -> None:
    own = v2_host(kernel)
    base = own / "edgenode"
    for d in (base, base / "node", base / "worker-llm-0", base / "worker-llm-1"):
        kernel.mkdir(d)
    (base / "node" / "cgroup.procs").write_text("777\n")  # no /proc/777: that node is dead
    (base / "worker-llm-0" / "cgroup.procs").write_text("888\n")
    (base / "worker-llm-0" / "cgroup.kill").unlink()  # kernel < 5.14: one SIGKILL per pid
    box = Sandbox(opts(), kernel.host())
    box.open()
    assert kernel.killed == [888]
    assert not (base / "worker-llm-0").exists() and not (base / "worker-llm-1").exists()
    assert len(box.status()["reaped"]) == 2  # type: ignore[arg-type]
    box.close()
    assert not base.exists()


def test_tree_of_a_live_node_is_never_touched(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel)
    base = dirs["memory"] / "edgenode"
    for d in (base, base / "node", base / "worker-llm-0"):
        kernel.mkdir(d)
    (base / "node" / "cgroup.procs").write_text("777\n")
    (base / "worker-llm-0" / "cgroup.procs").write_text("888\n")
    kernel.live(777)
    with pytest.raises(SandboxError, match=r"running process \(pid 777: python -m node.cli"):
        Sandbox(opts(), kernel.host()).open()
    box = Sandbox(opts("auto"), kernel.host())
    box.open()
    assert not box.active and "777" in box.reason
    box.close()
    assert kernel.killed == [] and kernel.procs(base / "worker-llm-0") == [888]


def test_remove_worker_kills_leftovers_then_removes_leaves_first(kernel: FakeKernel) -> None:
    dirs = v1_host(kernel)
    with Sandbox(opts(), kernel.host()) as box:
        box.create_worker("llm-0", LIMITS)
        box.attach("llm-0", 6001)
        w = dirs["memory"] / "edgenode" / "worker-llm-0"
        kernel.mkdir(w / "sub")  # something the worker made itself
        (w / "sub" / "cgroup.procs").write_text("6002\n")
        box.remove_worker("llm-0")
        assert sorted(set(kernel.killed)) == [6001, 6002]
        assert not w.exists() and box.memory("llm-0") is None
        box.remove_worker("llm-0")  # idempotent


def test_recreating_a_worker_cgroup_resets_it(kernel: FakeKernel) -> None:
    v2_host(kernel)
    with Sandbox(opts(), kernel.host()) as box:
        paths = box.create_worker("llm-0", LIMITS)
        box.attach("llm-0", 7001)
        (Path(paths[0]).parent / "cgroup.kill").unlink()
        assert box.create_worker("llm-0", LIMITS) == paths  # the restart of a crashed worker
        assert kernel.killed == [7001]


def test_off_mode_touches_nothing(kernel: FakeKernel) -> None:
    box = Sandbox(opts("off"), kernel.host())  # no mountinfo at all: never read
    box.open()
    assert not box.active and box.create_worker("llm-0", LIMITS) == ()
    assert box.status()["reason"] == 'workers.sandbox = "off"'
    box.close()


def test_host_without_cgroups(kernel: FakeKernel) -> None:
    kernel.set_self("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n", "")
    with pytest.raises(SandboxError, match='"required", but no cgroup filesystem'):
        Sandbox(opts(), kernel.host()).open()
    box = Sandbox(opts("auto"), kernel.host())
    box.open()
    assert not box.active and box.layout == "none"


def test_bad_worker_ids_and_modes(kernel: FakeKernel) -> None:
    v2_host(kernel)
    with Sandbox(opts(), kernel.host()) as box:
        for bad in ("../x", "a/b", "", ".hidden", "node"):
            with pytest.raises(SandboxError, match="cannot name a cgroup"):
                box.create_worker(bad, LIMITS)
    with pytest.raises(SandboxError, match=r"workers\.sandbox"):
        Sandbox(SandboxOptions(mode="sometimes"))


def test_join_cgroup_writes_this_process(tmp_path: Path) -> None:
    (tmp_path / "cgroup.procs").write_text("")
    join_cgroup([str(tmp_path / "cgroup.procs")])
    assert (tmp_path / "cgroup.procs").read_text() == str(os.getpid())
    with pytest.raises(SandboxError, match="cannot write"):
        join_cgroup([str(tmp_path / "gone" / "cgroup.procs")], pid=1)
    join_cgroup([])  # no sandbox: nothing to do


# ---------------------------------------------------------------- config and sizes


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8G", 8 * 2**30),
        ("256M", 256 * 2**20),
        ("1.5G", 3 * 2**29),
        ("4096", 4096),
        ("512K", 512 * 1024),
        ("512k", 512 * 1024),
        ("2GiB", 2 * 2**30),
        ("2GB", 2 * 2**30),
        (" 1T ", 2**40),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1", "1.2.3G", "12X", "lots", True, -5])
def test_parse_size_refuses(text: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(3 * 2**29) == "1.5 GiB" and format_size(512) == "512 B"
    assert format_size(256 * 2**20) == "256 MiB"


def test_config_keys_become_limits_and_options() -> None:
    cfg = from_dict(
        {
            "workers": {
                "memory_max": "512M",
                "cpu_quota": 0.5,
                "cpus": [1],
                "sandbox": "required",
                "cgroup_root": "/edgenode.delegated",
            }
        }
    )
    w = validate(cfg).workers
    assert w.cpus == (1,)
    limits = limits_for(w, cpus=(1,))
    assert limits == Limits(
        memory_max=512 * 2**20,
        memory_high=512 * 2**20 * 9 // 10,
        cpu_quota_us=50_000,
        cpus=(1,),
        nice=10,  # the default workers.nice
    )
    o = options_for(w, name="edgenode-x")
    assert o == SandboxOptions(
        "required",
        "/edgenode.delegated",
        "edgenode-x",
        frozenset({"memory", "cpu", "cpuset"}),
        nice=10,
    )
    defaults = options_for(WorkersSection())
    assert defaults.need == {"memory"} and defaults.mode == "auto"
    # "auto" reserves core 1 of two: a cpuset is wanted (affinity pins anyway), not needed.
    auto = options_for(WorkersSection(), plan_workers(WorkersSection(), allowed=(0, 1)))
    assert auto.need == {"memory"} and auto.want == {"cpuset"}
    assert limits_for(WorkersSection()).memory_max == 2**30
    assert limits_for(WorkersSection(memory_max=2**29)).memory_max == 2**29
    assert memory_high_bytes(WorkersSection(memory_max="max")) is None


@pytest.mark.parametrize(
    ("workers", "named"),
    [
        ({"sandbox": "maybe"}, "workers.sandbox"),
        ({"memory_max": "lots"}, "workers.memory_max"),
        ({"memory_max": "1M"}, "workers.memory_max"),
        ({"memory_high": "2G"}, "workers.memory_high"),
        ({"cpu_quota": 0}, "workers.cpu_quota"),
        ({"cpu_quota": "fast"}, "workers.cpu_quota"),
        ({"cpus": [1, 1]}, "workers.cpus"),
        ({"cpus": [-1]}, "workers.cpus"),
        ({"cpus": ["1"]}, "workers.cpus"),
        ({"cpus": 1}, "workers.cpus"),
        ({"nice": 20}, "workers.nice"),
        ({"nice": -5}, "workers.nice"),
        ({"cgroup_root": "relative"}, "workers.cgroup_root"),
        ({"cgroup_root": "/a/../b"}, "workers.cgroup_root"),
        ({"memory_max": True}, "workers.memory_max"),
    ],
)
def test_bad_isolation_keys_name_the_key(workers: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        validate(from_dict({"workers": workers}))
