"""The cgroup v2 driver: one unified tree, controllers enabled top-down.

The node moves into its ``node`` leaf before enabling controllers because of
the "no internal processes" rule (cgroup-v2.rst 2-4-4). Which files each
worker gets and why: "Per worker" in node/sandbox/cgroups.py.
"""

from __future__ import annotations

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
    pids_in,
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
from node.sandbox.layout import Layout
from node.sandbox.niceness import cpu_weight_v2


class V2Driver:
    """The unified hierarchy: one tree, controllers enabled top-down.

    Its ``original``, ``parent``, ``base`` and ``leaf`` make it the one
    ``NodeTree`` that ``close_trees`` tears down.
    """

    kind = "v2"

    def __init__(self, host: Host, layout: Layout, opts: SandboxOptions, strict: bool) -> None:
        assert layout.v2 is not None
        self.host, self.opts, self.strict = host, opts, strict
        own = layout.own_v2 or "/"
        self.original = layout.v2.dir_of(own)
        self.parent = layout.v2.dir_of(opts.cgroup_root or own)
        self.is_root = self.parent == layout.v2.point  # the root may hold processes
        self.base = self.parent / opts.name
        self.leaf = self.base / NODE_LEAF
        self.controllers: set[str] = set()
        self.added: list[str] = []  # enabled in the parent by us: disabled again on close
        self.owned = False  # set once no live node owns base: only then may close() clean up
        self.entered = False
        self.reaped: list[str] = []

    def open(self) -> None:
        if not self.parent.is_dir():
            raise SandboxError(f"cgroup {self.parent} does not exist (workers.cgroup_root?)")
        available = set(read_value(self.parent / "cgroup.controllers").split())
        self.controllers = select_controllers(available, self.opts, self.strict, str(self.parent))
        if self.base.is_dir():
            self.reaped = reap_stale(self.host, [self.base])
        self.owned = True
        make_cgroup(self.host, self.base)
        make_cgroup(self.host, self.leaf)
        move_node(self.host, [self.leaf])  # leave the parent: it becomes an inner node
        self.entered = True
        others = pids_in(self.parent) - {self.host.pid}
        if others and not self.is_root:
            raise SandboxError(
                f"{self.parent} still holds other processes {sorted(others)}, so it cannot "
                "enable controllers (no internal processes); run the node as the only process "
                "of a delegated cgroup (systemd Delegate=yes) or set workers.cgroup_root"
            )
        self.added = self._enable(self.parent)
        self._enable(self.base)
        if "cpu" in self.controllers:
            # The tree is one entity among its siblings: the workers' nice level,
            # not nice 0, is what it should weigh (cpu.weight, cgroup-v2.rst).
            put(self.host, self.base / "cpu.weight", str(cpu_weight_v2(self.opts.nice)))

    def _enable(self, directory: Path) -> list[str]:
        current = set(read_value(directory / "cgroup.subtree_control").split())
        todo = sorted(self.controllers - current)
        if todo:
            put(self.host, directory / "cgroup.subtree_control", " ".join(f"+{c}" for c in todo))
        return todo

    def create(self, name: str, limits: Limits) -> tuple[Path, ...]:
        d = self.base / name
        make_cgroup(self.host, d)
        empty_cgroups(self.host, [d])  # a reused cgroup may hold a dead incarnation's leftovers
        if "memory" in self.controllers:
            put(self.host, d / "memory.max", _v2_value(limits.memory_max))
            put(self.host, d / "memory.high", _v2_value(limits.memory_high))
            write_if_present(self.host, d / "memory.swap.max", "0")
            write_if_present(self.host, d / "memory.zswap.max", "0")
            write_if_present(self.host, d / "memory.oom.group", "1")
        if "cpu" in self.controllers:
            quota = _v2_value(limits.cpu_quota_us)
            put(self.host, d / "cpu.max", f"{quota} {limits.cpu_period_us}")
            # One scheduling entity: its weight, not its threads' nice, ranks it.
            put(self.host, d / "cpu.weight", str(cpu_weight_v2(limits.nice)))
        if "cpuset" in self.controllers and limits.cpus:
            put(self.host, d / "cpuset.cpus", format_cpus(limits.cpus))
        return (d / "cgroup.procs",)

    def dirs(self, name: str | None) -> tuple[Path, ...]:
        return (self.base / name if name else self.base,)

    def read_memory(self, name: str | None) -> MemoryReading:
        d = self.dirs(name)[0]
        events = parse_keyed(read_optional(d / "memory.events"))
        # Its own limit's OOMs only: memory.events counts the subtree's since 5.2,
        # which added memory.events.local (before, memory.events was local).
        local = read_optional(d / "memory.events.local")
        return MemoryReading(
            current=int(read_value(d / "memory.current")),
            peak=read_int(d / "memory.peak"),
            limit=parse_limit(read_optional(d / "memory.max")),
            high=parse_limit(read_optional(d / "memory.high")),
            oom_kills=events.get("oom_kill", 0),
            limit_hits=events.get("max"),
            high_events=events.get("high"),
            swap=read_int(d / "memory.swap.current"),
            inactive_file=parse_keyed(read_optional(d / "memory.stat")).get("inactive_file", 0),
            own_limit_ooms=(events if local is None else parse_keyed(local)).get("oom"),
            above_limit_hits=None,  # own_limit_ooms tells a limit above apart on v2
        )

    def remove(self, name: str) -> None:
        destroy(self.host, [self.base / name])

    def close(self) -> None:
        if not self.owned:
            return
        # Hand the controllers back, children first (top-down rule), so the
        # parent may hold a process again.
        release = (
            lambda: _disable(self.host, self.base, self.controllers),
            lambda: _disable(self.host, self.parent, set(self.added)),
        )
        try:
            close_trees(self.host, [self], self.remove, entered=self.entered, release=release)
        finally:
            self.owned = self.entered = False


def _disable(host: Host, directory: Path, controllers: set[str]) -> None:
    """Turn off those of ``controllers`` that ``directory`` enables for its children."""
    path = directory / "cgroup.subtree_control"
    enabled = set((read_optional(path) or "").split()) & controllers
    if enabled:
        put(host, path, " ".join(f"-{c}" for c in sorted(enabled)))


def _v2_value(value: int | None) -> str:
    """A limit as v2 writes it: the number, or "max" for none."""
    return "max" if value is None else str(value)
