"""The cgroup v1 driver, for legacy and hybrid hosts: the same relative path in
each controller's hierarchy (memory, cpu, cpuset: what systemd's
CGROUP_DELEGATION.md advises).

Which files each worker gets and why (the memsw write order, the cpuset copied
from the parent, the watermark v1 lacks): "Per worker" in node/sandbox/cgroups.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from broker.errors import SandboxError
from node.sandbox.cgroupfs import (
    NODE_LEAF,
    Host,
    destroy,
    empty_cgroups,
    make_cgroup,
    move_node,
    parse_keyed,
    parse_limit,
    put,
    read_int,
    read_optional,
    read_value,
    reap_stale,
    write_if_present,
)
from node.sandbox.cores import format_cpus
from node.sandbox.driver import (
    Limits,
    MemoryReading,
    SandboxOptions,
    close_trees,
    select_controllers,
)
from node.sandbox.layout import Layout, v1_memory_ancestry
from node.sandbox.niceness import nice_weight


@dataclass
class _Hierarchy:
    """The node's directories in one v1 hierarchy (one mount, maybe several controllers)."""

    controllers: set[str]
    original: Path
    parent: Path
    base: Path

    @property
    def leaf(self) -> Path:
        return self.base / NODE_LEAF


class V1Driver:
    """Legacy and hybrid hosts: the same relative path in each controller's hierarchy."""

    kind = "v1"

    def __init__(self, host: Host, layout: Layout, opts: SandboxOptions, strict: bool) -> None:
        self.host, self.opts, self.strict, self.layout = host, opts, strict, layout
        self.trees: list[_Hierarchy] = []
        self.high: dict[str, int | None] = {}
        self.owned = False  # set once no live node owns the bases: only then may close() clean up
        self.entered = False
        self.reaped: list[str] = []

    def open(self) -> None:
        self.trees = self._plan()
        self.reaped = reap_stale(self.host, [t.base for t in self.trees if t.base.is_dir()])
        self.owned = True
        for tree in self.trees:
            make_cgroup(self.host, tree.base)
            make_cgroup(self.host, tree.leaf)
            if "cpuset" in tree.controllers:
                _copy_cpuset(self.host, tree.parent, tree.base)
                _copy_cpuset(self.host, tree.base, tree.leaf)
            if "cpu" in tree.controllers:
                # The tree is one entity among the host's: at the root of a v1
                # hierarchy its workers would otherwise weigh as one nice-0
                # process (their autogroups no longer apply in a cpu cgroup).
                put(self.host, tree.base / "cpu.shares", str(nice_weight(self.opts.nice)))
        self.entered = True
        move_node(self.host, [t.leaf for t in self.trees])

    def _plan(self) -> list[_Hierarchy]:
        """One ``_Hierarchy`` per mount that holds a controller in use, memory's first."""
        use = select_controllers(
            set(self.layout.v1), self.opts, self.strict, "the cgroup v1 mounts"
        )
        by_mount: dict[Path, _Hierarchy] = {}
        for controller in sorted(use, key=lambda c: (c != "memory", c)):  # memory first
            mount = self.layout.v1[controller]
            if mount.point in by_mount:
                by_mount[mount.point].controllers.add(controller)
                continue
            own = self.layout.own_v1.get(controller, "/")
            parent = mount.dir_of(self.opts.cgroup_root or own)
            if not parent.is_dir():
                raise SandboxError(f"cgroup {parent} does not exist (workers.cgroup_root?)")
            tree = _Hierarchy({controller}, mount.dir_of(own), parent, parent / self.opts.name)
            by_mount[mount.point] = tree
        return list(by_mount.values())

    def _tree(self, controller: str) -> _Hierarchy | None:
        return next((t for t in self.trees if controller in t.controllers), None)

    def create(self, name: str, limits: Limits) -> tuple[Path, ...]:
        dirs = [t.base / name for t in self.trees]
        for d in dirs:
            make_cgroup(self.host, d)
        empty_cgroups(self.host, dirs)
        for tree, d in zip(self.trees, dirs, strict=True):
            if "cpuset" in tree.controllers:
                # Both files, before any process is attached (else ENOSPC).
                put(self.host, d / "cpuset.mems", read_value(tree.base / "cpuset.mems"))
                cpus = (
                    format_cpus(limits.cpus)
                    if limits.cpus
                    else read_value(tree.base / "cpuset.cpus")
                )
                put(self.host, d / "cpuset.cpus", cpus)
            if "memory" in tree.controllers:
                _set_v1_memory(self.host, d, limits.memory_max)
                # A respawn reuses the cgroup: its peak starts again with the new process
                # (any write resets the watermark, cgroup-v1/memory.rst; v2's memory.peak
                # cannot be reset for every reader).
                write_if_present(self.host, d / "memory.max_usage_in_bytes", "0")
            if "cpu" in tree.controllers:
                put(self.host, d / "cpu.cfs_period_us", str(limits.cpu_period_us))
                put(self.host, d / "cpu.cfs_quota_us", str(limits.cpu_quota_us or -1))
                # A cgroup is one scheduling entity: its threads' nice level no
                # longer ranks it against the node's leaf, its weight does.
                put(self.host, d / "cpu.shares", str(nice_weight(limits.nice)))
        self.high[name] = limits.memory_high
        return tuple(d / "cgroup.procs" for d in dirs)

    def dirs(self, name: str | None) -> tuple[Path, ...]:
        return tuple(t.base / name if name else t.base for t in self.trees)

    def read_memory(self, name: str | None) -> MemoryReading:
        tree = self._tree("memory")
        assert tree is not None  # select_controllers always keeps memory
        d = tree.base / name if name else tree.base
        current = int(read_value(d / "memory.usage_in_bytes"))
        memsw = read_int(d / "memory.memsw.usage_in_bytes")
        # A worker's: the cgroups above d whose limits cover it, the tree and its parents
        # up to the mount point (the budget walks the same path for its limits). Only
        # the OOM verdict reads them, so the pressure poll's node reading skips the walk.
        above = list(v1_memory_ancestry(self.layout.v1["memory"], d))[1:] if name else None
        return MemoryReading(
            current=current,
            peak=read_int(d / "memory.max_usage_in_bytes"),
            limit=parse_limit(read_optional(d / "memory.limit_in_bytes")),
            high=self.high.get(name) if name else None,
            oom_kills=parse_keyed(read_optional(d / "memory.oom_control")).get("oom_kill", 0),
            limit_hits=_failcnt(d),
            high_events=None,
            swap=None if memsw is None else max(0, memsw - current),
            # total_* counts the whole subtree, as usage_in_bytes does with hierarchy.
            inactive_file=parse_keyed(read_optional(d / "memory.stat")).get(
                "total_inactive_file", 0
            ),
            own_limit_ooms=None,  # v1 keeps no such count (6.18's failcnt missed it too)
            above_limit_hits=None if above is None else sum(_failcnt(a) for a in above),
        )

    def remove(self, name: str) -> None:
        destroy(self.host, [t.base / name for t in self.trees])
        self.high.pop(name, None)

    def close(self) -> None:
        if not self.owned:
            return
        try:
            close_trees(self.host, self.trees, self.remove, entered=self.entered)
        finally:
            self.owned = self.entered = False


def _failcnt(d: Path) -> int:
    """How often ``d``'s limits refused a charge: ``memory.failcnt`` plus
    ``memory.memsw.failcnt`` (with swap accounting the memsw counter is charged
    first, so it is the one that fails at the limit, memory.rst 2.4); an absent
    file counts 0."""
    return (read_int(d / "memory.failcnt") or 0) + (read_int(d / "memory.memsw.failcnt") or 0)


def _copy_cpuset(host: Host, src: Path, dst: Path) -> None:
    """Fill an empty v1 cpuset from ``src`` (a new one starts empty: ENOSPC on attach)."""
    for name in ("cpuset.mems", "cpuset.cpus"):
        if not read_value(dst / name):
            put(host, dst / name, read_value(src / name))


def _set_v1_memory(host: Host, d: Path, limit: int | None) -> None:
    """limit_in_bytes and, where swap accounting exists, memsw = limit (no swap).

    The kernel refuses memsw < limit at every step (EINVAL), so a raise writes
    memsw first and a cut writes the limit first (memory.rst 2.4; runc does the same).
    """
    value = "-1" if limit is None else str(limit)
    limit_file, memsw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
    write_if_present(host, d / "memory.swappiness", "0")  # no swapping in limit reclaim either
    if not memsw.exists():
        put(host, limit_file, value)
        return
    current = parse_limit(read_optional(limit_file))
    raising = limit is None or (current is not None and limit > current)
    for path in (memsw, limit_file) if raising else (limit_file, memsw):
        put(host, path, value)
