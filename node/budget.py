"""The memory budget the capacity model plans against, and sizes as an operator writes them.

The budget is ``capacity.memory_budget`` when set, else the node's cgroup memory
limit (the smallest on its cgroup's path, read with the sandbox's mountinfo
parser), else the host's RAM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import psutil

from broker.errors import ConfigError, SandboxError
from node.cgroup_layout import read_layout
from node.cgroupfs import Host, parse_limit, read_optional
from node.units import parse_size

if TYPE_CHECKING:
    from node.config import NodeConfig


def config_size(value: str | int, key: str) -> int:
    """Bytes of a size as an operator writes it (``node.units``: "8G", "1.5G", "256M").

    Raises:
        ConfigError: not a size; the message names ``key``.
    """
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def cgroup_memory_limit(host: Host | None = None) -> int | None:
    """The smallest memory limit (bytes) on this process's cgroup or an ancestor
    visible under the mount, or None: v1 ``memory.limit_in_bytes`` where memory
    is a v1 controller (v1, hybrid), else v2 ``memory.max``. "max" and v1's
    unlimited (9223372036854771712) are no limit (``node.cgroupfs.parse_limit``),
    nor is an unreadable file. Mounts and the own cgroup come from the sandbox's
    parser (``node.cgroup_layout``: co-mounted controllers, container subtrees).
    """
    host = host or Host()
    try:
        layout = read_layout(host)
    except OSError:  # no /proc/self files: nothing to read
        return None
    if "memory" in layout.v1 and "memory" in layout.own_v1:
        mount, own, name = layout.v1["memory"], layout.own_v1["memory"], "memory.limit_in_bytes"
    elif layout.v2 is not None and layout.own_v2 is not None:
        mount, own, name = layout.v2, layout.own_v2, "memory.max"
    else:
        return None
    cgroup = mount.dir_of(own)
    limits: list[int] = []
    for directory in [cgroup, *cgroup.parents]:
        if not directory.is_relative_to(mount.point):
            break  # above the mount: not visible here
        try:
            limit = parse_limit(read_optional(directory / name))
        except (SandboxError, ValueError):
            limit = None
        limits += [] if limit is None else [limit]
    return min(limits) if limits else None


def detect_budget() -> tuple[int, str]:
    """(bytes, source): the node's cgroup memory limit when set, else total RAM."""
    total, limit = psutil.virtual_memory().total, cgroup_memory_limit()
    return (limit, "cgroup memory limit") if limit and limit < total else (total, "total RAM")


def configured_budget(config: NodeConfig) -> tuple[int, str]:
    """(bytes, source) of ``capacity.memory_budget``, or detected when it is "".

    Raises:
        ConfigError: ``capacity.memory_budget`` is not a size.
    """
    key, text = "capacity.memory_budget", config.capacity.memory_budget
    return (config_size(text, key), key) if text else detect_budget()
