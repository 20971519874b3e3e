"""Which cgroup filesystems a host has and where this process sits in them.

Read once at ``Sandbox.open`` from /proc/self/mountinfo and /proc/self/cgroup
(proc(5)). ``kind`` decides the driver: ``v2`` (unified), ``v1`` (legacy),
``hybrid`` (v1 controllers plus a v2 mount, normally controller-less; the v1
driver serves it) or ``none``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from broker.errors import SandboxError
from node.sandbox.cgroupfs import Host, read_optional

_V1_CONTROLLERS = frozenset(
    {
        "cpu",
        "cpuacct",
        "cpuset",
        "memory",
        "devices",
        "freezer",
        "net_cls",
        "net_prio",
        "blkio",
        "perf_event",
        "hugetlb",
        "pids",
        "rdma",
        "misc",
    }
)


@dataclass(frozen=True)
class Mount:
    """One cgroup mount: where it is, which hierarchy path it shows, its v1 controllers."""

    point: Path
    root: str
    controllers: frozenset[str]

    def dir_of(self, cgroup: str) -> Path:
        """The directory of a cgroup path as /proc/self/cgroup shows it."""
        if self.root != "/" and (cgroup == self.root or cgroup.startswith(self.root + "/")):
            cgroup = cgroup[len(self.root) :]
        return self.point / cgroup.lstrip("/")


@dataclass(frozen=True)
class Layout:
    """``kind``: ``v2`` (unified), ``v1`` (legacy), ``hybrid`` (v1 controllers plus a
    v2 mount, normally controller-less) or ``none``."""

    kind: str
    v1: Mapping[str, Mount]
    v2: Mount | None
    own_v1: Mapping[str, str]
    own_v2: str | None


def ancestry(mount: Mount, start: Path) -> Iterator[Path]:
    """``start`` and its ancestors that exist under ``mount``, deepest first, the
    mount point last (a ``cgroup_root`` not created yet is skipped; ancestors above
    the mount, e.g. outside a container's cgroup namespace, are not visible)."""
    for directory in [start, *start.parents]:
        if not directory.is_relative_to(mount.point):
            return
        if directory.is_dir():
            yield directory


def v1_memory_ancestry(mount: Mount, start: Path) -> Iterator[Path]:
    """``ancestry`` in a v1 memory hierarchy, cut below the first parent that does
    not account its children (``memory.use_hierarchy`` 0, cgroup-v1/memory.rst 6):
    ``start`` and the cgroups whose memory limits (and ``memory.failcnt``) cover it.
    A missing or unreadable ``memory.use_hierarchy`` counts as 1, the only value
    since Linux 5.11 (which deprecated the non-hierarchical mode)."""
    for directory in ancestry(mount, start):
        yield directory
        try:
            flag = read_optional(directory.parent / "memory.use_hierarchy")
        except SandboxError:  # unreadable: as if absent
            flag = None
        if flag == "0":
            return


def parse_layout(mountinfo: str, proc_cgroup: str, root: Path = Path("/")) -> Layout:
    """Read the mounts from /proc/self/mountinfo and this process's cgroups from
    /proc/self/cgroup (proc(5)); mount points are placed under ``root``."""
    v1, v2 = _parse_mounts(mountinfo, root)
    own_v1, own_v2 = _parse_own(proc_cgroup)
    kind = ("hybrid" if v2 else "v1") if v1 else ("v2" if v2 else "none")
    return Layout(kind, v1, v2, own_v1, own_v2)


def read_layout(host: Host, pid: int | None = None) -> Layout:
    """``parse_layout`` of the host's /proc/self files; with ``pid``, that process's
    cgroups (/proc/<pid>/cgroup) under this process's mounts.

    Raises:
        OSError: a /proc file cannot be read (no such process, no procfs).
    """
    return parse_layout(
        (host.proc / "self" / "mountinfo").read_text(),
        (host.proc / ("self" if pid is None else str(pid)) / "cgroup").read_text(),
        host.root,
    )


def _parse_mounts(mountinfo: str, root: Path) -> tuple[dict[str, Mount], Mount | None]:
    """The v1 mount of each controller (the first one wins) and the first v2 mount."""
    v1: dict[str, Mount] = {}
    v2: Mount | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3] if len(fields) > dash + 3 else ""
        point = root / _unescape(fields[4]).lstrip("/")
        if fstype == "cgroup2" and v2 is None:
            v2 = Mount(point, _unescape(fields[3]), frozenset())
        elif fstype == "cgroup":
            controllers = frozenset(options.split(",")) & _V1_CONTROLLERS
            mount = Mount(point, _unescape(fields[3]), controllers)
            for controller in controllers:
                v1.setdefault(controller, mount)
    return v1, v2


def _parse_own(proc_cgroup: str) -> tuple[dict[str, str], str | None]:
    """This process's cgroup per v1 controller, and its v2 cgroup (the ``0::`` line)."""
    own_v1: dict[str, str] = {}
    own_v2: str | None = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            own_v2 = parts[2]
        for controller in filter(None, parts[1].split(",")):
            own_v1[controller] = parts[2]
    return own_v1, own_v2


def _unescape(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)
