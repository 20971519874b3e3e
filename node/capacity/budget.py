"""The memory budget: what ``edgenode capacity`` plans against and the pressure
monitor measures against, and sizes as an operator writes them.

The budget never exceeds the tightest memory limit the kernel enforces on the
node's cgroup path (``node_limit``), so ``capacity``, ``status``, admission and
the pressure levels all see one figure, and ``critical`` comes before the OOM
killer. The limits read on that path:

* cgroup v1 (and hybrid hosts, where memory is a v1 controller): every
  ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` from the
  node's cgroup up to the mount's root, as long as the parent accounts its
  children (``memory.use_hierarchy`` = 1; with 0 a parent's limit does not
  cover them, cgroup-v1/memory.rst 6), plus the kernel's own
  ``hierarchical_memory_limit`` and ``hierarchical_memsw_limit`` from
  ``memory.stat``, which also cover ancestors the mount does not show (a
  container's subtree);
* cgroup v2: every ``memory.max`` and ``memory.high`` from the node's cgroup up
  to the mount's root (cgroup-v2.rst "Memory Interface Files": above an
  ancestor's ``memory.high`` the subtree is throttled and reclaimed, above its
  ``memory.max`` it is OOM-killed). Ancestors above a cgroup namespace's root
  are not visible there.

"max" and v1's unlimited (9223372036854771712) are no limit
(``node.sandbox.cgroupfs.parse_limit``), nor is an unreadable file.

The node's cgroup path is the running node's (the process in its pidfile), so
``capacity`` run from any shell sees what the node sees; without a running
node, ``workers.cgroup_root`` when set (the node's tree goes there), else this
process's own cgroup (where a node started from here puts its tree).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from broker.errors import ConfigError, SandboxError
from node.pidfile import lock_holder
from node.sandbox.cgroupfs import Host, parse_keyed, parse_limit, read_optional
from node.sandbox.layout import Layout, Mount, ancestry, read_layout, v1_memory_ancestry
from node.units import format_size, parse_size

if TYPE_CHECKING:
    from node.config import NodeConfig

#: The node's pidfile in its run directory (written by ``node.app.Node``).
_V1_FILES = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
_V1_STAT_KEYS = ("hierarchical_memory_limit", "hierarchical_memsw_limit")
_V2_FILES = ("memory.max", "memory.high")


@dataclass(frozen=True)
class CgroupLimit:
    """A memory limit in bytes and where it is set (the file, with the
    ``memory.stat`` key when the kernel's hierarchical figure is the tightest)."""

    bytes: int
    source: str

    def describe(self) -> str:
        """``cgroup limit <file>``: how ``capacity`` and ``status`` name the budget's source."""
        return f"cgroup limit {self.source}"


def config_size(value: str | int, key: str) -> int:
    """Bytes of a size as an operator writes it (``node.units``: "8G", "1.5G", "256M").

    Raises:
        ConfigError: not a size; the message names ``key``.
    """
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def tightest_limit(
    host: Host | None = None,
    *,
    pid: int | None = None,
    root: str = "",
    layout: Layout | None = None,
) -> CgroupLimit | None:
    """The tightest memory limit (bytes) on a cgroup path and its ancestors, or None.

    Args:
        host: where the kernel's files are (a fake tree in tests).
        pid: whose cgroup (/proc/<pid>/cgroup); None = this process's.
        root: a cgroup path (as /proc/*/cgroup writes it) to start from instead,
            e.g. ``workers.cgroup_root``.
        layout: the mounts and cgroups already read (``read_layout``), to save
            reading /proc on every poll.

    Which files count, per cgroup version: the module docstring.
    """
    host = host or Host()
    if layout is None:
        try:
            layout = read_layout(host, pid)
        except OSError:  # no /proc files (or the process is gone): nothing to read
            return None
    if "memory" in layout.v1 and "memory" in layout.own_v1:
        mount = layout.v1["memory"]
        return _tightest(_v1_limits(mount, mount.dir_of(root or layout.own_v1["memory"])))
    if layout.v2 is not None and layout.own_v2 is not None:
        mount = layout.v2
        return _tightest(_v2_limits(mount, mount.dir_of(root or layout.own_v2)))
    return None


def node_limit(config: NodeConfig, host: Host | None = None) -> CgroupLimit | None:
    """The tightest memory limit on the node's cgroup path: the running node's
    cgroup (the holder of ``config.run_dir``'s lock, ``node.pidfile.lock_holder``),
    else ``workers.cgroup_root``, else this process's own cgroup."""
    holder = lock_holder(config.run_dir)
    pid = None if holder is None else holder.pid
    if pid is not None and pid != os.getpid():
        limit = tightest_limit(host, pid=pid)
        if limit is not None or _alive(pid):
            return limit
        # The node exited meanwhile: where a node started from here would go.
    sandboxed = config.workers.sandbox != "off"
    return tightest_limit(host, root=config.workers.cgroup_root if sandboxed else "")


def detect_budget(config: NodeConfig, host: Host | None = None) -> tuple[int, str]:
    """(bytes, source): ``node_limit`` when it is below the host's RAM, else total RAM."""
    total, limit = psutil.virtual_memory().total, node_limit(config, host)
    return (
        (limit.bytes, limit.describe()) if limit and limit.bytes < total else (total, "total RAM")
    )


def configured_budget(config: NodeConfig, host: Host | None = None) -> tuple[int, str]:
    """(bytes, source) of ``capacity.memory_budget``, cut to ``node_limit`` when that
    is tighter (a plan above what the kernel enforces ends in the OOM killer); or
    ``detect_budget`` when it is "".

    Raises:
        ConfigError: ``capacity.memory_budget`` is not a size.
    """
    key, text = "capacity.memory_budget", config.capacity.memory_budget
    if not text:
        return detect_budget(config, host)
    size = config_size(text, key)
    return cut_to_limit(size, key, node_limit(config, host))


def cut_to_limit(size: int, source: str, limit: CgroupLimit | None) -> tuple[int, str]:
    """(bytes, source) of a configured budget ``size`` named ``source``, or of ``limit``
    when that is tighter; the source then says both."""
    if limit is None or limit.bytes >= size:
        return size, source
    return limit.bytes, f"{source} {format_size(size)} cut to the {limit.describe()}"


# ---------------------------------------------------------------- the path


def _v1_limits(mount: Mount, start: Path) -> Iterator[tuple[int | None, str]]:
    """The limit files on the path, then the kernel's own figure (last, so that on
    a tie the file that sets the limit is the one named)."""
    stat: Path | None = None
    for directory in v1_memory_ancestry(mount, start):
        stat = stat or directory / "memory.stat"  # the deepest existing cgroup's
        for name in _V1_FILES:
            yield _read_limit(directory / name), str(directory / name)
    if stat is not None:  # the min over the whole hierarchy, hidden ancestors included
        keyed = _keyed(stat)
        for key in _V1_STAT_KEYS:
            yield _limit(str(keyed[key]) if key in keyed else None), f"{stat} {key}"


def _v2_limits(mount: Mount, start: Path) -> Iterator[tuple[int | None, str]]:
    for directory in ancestry(mount, start):
        for name in _V2_FILES:
            yield _read_limit(directory / name), str(directory / name)


def _tightest(found: Iterator[tuple[int | None, str]]) -> CgroupLimit | None:
    limits = [CgroupLimit(value, source) for value, source in found if value is not None]
    return min(limits, key=lambda limit: limit.bytes) if limits else None


def _read(path: Path) -> str | None:
    try:
        return read_optional(path)
    except SandboxError:  # unreadable: as if absent
        return None


def _keyed(path: Path) -> dict[str, int]:
    return parse_keyed(_read(path))


def _limit(text: str | None) -> int | None:
    try:
        return parse_limit(text)
    except ValueError:  # junk in a file: no limit we can honour
        return None


def _read_limit(path: Path) -> int | None:
    return _limit(_read(path))


def _alive(pid: int) -> bool:
    return psutil.pid_exists(pid)
