"""What a cgroup driver is (``CgroupDriver``: how the sandbox drives cgroup v2, v1 or
none), the values that cross it (``Limits``, ``SandboxOptions``, ``MemoryReading``), and
what the v1 and v2 drivers share: choosing controllers and tearing the node's tree down.
``NoCgroups`` is the driver without cgroups (``off``, or ``auto`` on a host that cannot
have them).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Protocol, get_args

from broker.errors import SandboxError
from node.sandbox.cgroupfs import (
    NODE_LEAF,
    Host,
    attempt,
    children,
    empty_cgroups,
    go_home,
    raise_if,
    remove_tree,
)
from node.units import DEFAULT_PERIOD_US

#: ``workers.sandbox``: ``auto`` runs without cgroups (a warning) when they cannot
#: be made, ``required`` fails the start, ``off`` makes none.
SandboxMode = Literal["auto", "required", "off"]
SANDBOX_MODES: tuple[SandboxMode, ...] = get_args(SandboxMode)

log = logging.getLogger("edgenode.sandbox")


@dataclass(frozen=True)
class Limits:
    """One worker's limits. Bytes, µs, core numbers; None = no limit.

    ``cpus`` empty = the parent's cores. ``nice`` (0..19) becomes the cgroup's
    CPU weight where the cpu controller is in use (``node.sandbox.cores.nice_weight``).
    """

    memory_max: int | None = None
    memory_high: int | None = None
    cpu_quota_us: int | None = None
    cpu_period_us: int = DEFAULT_PERIOD_US
    cpus: tuple[int, ...] = ()
    nice: int = 0


@dataclass(frozen=True)
class SandboxOptions:
    """How to build the sandbox.

    Attributes:
        mode: ``auto`` (degrade with a warning), ``required`` (fail), ``off``.
        cgroup_root: delegated parent as a cgroup path; "" = the node's own cgroup.
        name: the node's cgroup directory name (unique per node on a host).
        need: controllers the config asks for; missing one fails ``required``
            and is skipped with a warning under ``auto`` (memory always fails).
        want: controllers used when present, skipped quietly otherwise.
        nice: the workers' nice level; with the cpu controller the node's whole
            tree gets its weight (its own leaf keeps nice 0's inside it).
    """

    mode: SandboxMode = "auto"
    cgroup_root: str = ""
    name: str = "edgenode"
    need: frozenset[str] = frozenset({"memory"})
    want: frozenset[str] = frozenset()
    nice: int = 0


#: Share of memory.max above which a worker's working set counts as at its limit.
#: Our own threshold, not a kernel one: the kernel reclaims at the limit itself;
#: 0.9 leaves room for the runtime's few MiB of jitter between readings.
NEAR_LIMIT = 0.9


@dataclass(frozen=True)
class MemoryReading:
    """A cgroup's memory, in bytes (counts are event counts).

    ``peak`` is None where the kernel lacks v2 ``memory.peak`` (< 5.19);
    ``limit``/``high`` None = none; ``limit_hits`` is v2 ``memory.events`` max
    or v1 ``memory.failcnt`` + ``memory.memsw.failcnt`` (a hint only: with memsw =
    limit, kernel 6.18 counted neither for an OOM kill; ``oom_kills`` is the
    evidence); ``high_events`` exists on v2 only; ``swap`` is None without swap
    accounting. ``inactive_file`` (``memory.stat``: v2 inactive_file, v1
    total_inactive_file) is page cache the kernel reclaims first; usage minus it
    is the working set (the kubelet's eviction signal).

    Whose limit an OOM kill came from (``killed_by_own_limit``):

    * ``own_limit_ooms`` (v2; None on v1 and where the key is missing): the
      ``oom`` count of v2 ``memory.events.local`` (``memory.events`` before 5.2,
      when it was local anyway): the times this cgroup's usage reached its own
      ``memory.max`` and an allocation was about to fail (cgroup-v2.rst). Events
      propagate up to ancestors, never down, so a limit above it leaves it alone.
    * ``above_limit_hits`` (v1 worker readings; None on v2 and for the whole node):
      ``memory.failcnt`` +
      ``memory.memsw.failcnt`` summed over the cgroup's ancestors whose limits
      cover it (``node.sandbox.layout.v1_memory_ancestry``: the node's tree, its
      parents up to the mount point): how often a limit above it refused a charge.
      Kernel 6.18 raised the tree's failcnt (0 to 92) when the tree's limit
      OOM-killed a worker, and no failcnt at all when the worker's own limit did.
    """

    current: int
    peak: int | None
    limit: int | None
    high: int | None
    oom_kills: int
    limit_hits: int | None
    high_events: int | None
    swap: int | None
    inactive_file: int = 0
    own_limit_ooms: int | None = None
    above_limit_hits: int | None = None

    @property
    def working_set(self) -> int:
        """Usage minus reclaimable page cache, in bytes (the kubelet's eviction signal)."""
        return max(0, self.current - self.inactive_file)

    @property
    def near_limit(self) -> bool:
        """Working set at or above ``NEAR_LIMIT`` of ``limit``: the kernel is reclaiming
        the process's own pages. Without swap (the node turns it off) a worker there
        can stall in direct reclaim long enough to miss its heartbeats before the OOM
        killer ends it (tests/system/test_isolation.py::
        test_a_worker_lost_at_its_memory_limit_says_so)."""
        return self.limit is not None and self.working_set >= NEAR_LIMIT * self.limit

    @property
    def over_high(self) -> bool:
        """Usage at or above the watermark: shed load now (v1's stand-in for memory.high)."""
        return self.high is not None and self.current >= self.high

    def as_dict(self) -> dict[str, int | bool | None]:
        """For ``status``."""
        return {**dataclasses.asdict(self), "over_high": self.over_high}


def killed_by_own_limit(at_spawn: MemoryReading | None, at_death: MemoryReading) -> bool:
    """Whether an OOM kill of a worker came from its own cgroup's limit (its request
    is then the poison one) rather than one above it (the node's tree, a parent
    slice or container, the machine: nothing is blamed).

    Args:
        at_spawn: the worker's cgroup read when this process was spawned (the
            counters are the cgroup's, which a respawn reuses), or None if it could
            not be read then.
        at_death: the same cgroup read after the kill.

    The evidence, first that applies:

    1. cgroup v2: its own ``oom`` count (``own_limit_ooms``) rose since the spawn:
       own; it did not: above.
    2. cgroup v1: an ancestor's failcnt (``above_limit_hits``) rose since the
       spawn: above. (It also counts charges that reclaim then satisfied, so a tree
       that ran at its limit during this process's life counts against it: the
       request gets its one retry rather than the blame.)
    3. The peak: at or above ``NEAR_LIMIT`` of its own limit: own; below it, or no
       limit of its own: above (a machine-wide OOM kill, or an ancestor v1 cannot
       see). No peak kept (v2 before 5.19, which step 1 decides anyway unless
       ``at_spawn`` is None): own, as nothing tells them apart. v1's peak is reset
       at each spawn; v2's ``memory.peak`` is the cgroup's highest of all its
       processes.
    """
    if at_spawn is not None:
        ooms = _since(at_spawn.own_limit_ooms, at_death.own_limit_ooms)
        if ooms is not None:
            return ooms > 0
        if (_since(at_spawn.above_limit_hits, at_death.above_limit_hits) or 0) > 0:
            return False
    if at_death.limit is None:
        return False
    return at_death.peak is None or at_death.peak >= NEAR_LIMIT * at_death.limit


def _since(before: int | None, after: int | None) -> int | None:
    """How much a counter rose between two readings; None if either lacks it."""
    return None if before is None or after is None else after - before


class CgroupDriver(Protocol):
    """One cgroup implementation. ``name`` is a worker's directory name."""

    kind: str
    reaped: list[str]

    def open(self) -> None: ...

    def create(self, name: str, limits: Limits) -> tuple[Path, ...]: ...

    def dirs(self, name: str | None) -> tuple[Path, ...]: ...

    def read_memory(self, name: str | None) -> MemoryReading: ...

    def remove(self, name: str) -> None: ...

    def close(self) -> None: ...


class NoCgroups:
    """No cgroups (``off``, or ``auto`` on a host that cannot have them)."""

    kind = "none"

    def __init__(self) -> None:
        self.reaped: list[str] = []

    def open(self) -> None:
        return None

    def create(self, name: str, limits: Limits) -> tuple[Path, ...]:
        return ()

    def dirs(self, name: str | None) -> tuple[Path, ...]:
        return ()

    def read_memory(self, name: str | None) -> MemoryReading:
        raise SandboxError("no sandbox: no cgroup to read")

    def remove(self, name: str) -> None:
        return None

    def close(self) -> None:
        return None


def select_controllers(
    available: set[str], opts: SandboxOptions, strict: bool, where: str
) -> set[str]:
    """The controllers to use; raise for a missing one that must be there."""
    missing_need = sorted(opts.need - available)
    if "memory" in missing_need or (strict and missing_need):
        raise SandboxError(
            f"cgroup controller(s) {', '.join(missing_need)} not available at {where} "
            "(not mounted, or not enabled in the parent's cgroup.subtree_control)"
        )
    for controller in missing_need:
        log.warning("cgroup controller %s is not available at %s: skipped", controller, where)
    return (set(opts.need) | set(opts.want)) & available


class NodeTree(Protocol):
    """The node's directories in one hierarchy: the cgroup it came from
    (``original``), the one its tree is made in (``parent``), its tree (``base``)
    and its own leaf in the tree."""

    original: Path
    parent: Path
    base: Path

    @property
    def leaf(self) -> Path: ...


def close_trees(
    host: Host,
    trees: Sequence[NodeTree],
    remove: Callable[[str], None],
    *,
    entered: bool,
    release: Sequence[Callable[[], object]] = (),
) -> None:
    """Tear down the node's trees, trying every step even after one failed.

    Order: the worker cgroups (``remove`` by name), then ``release`` (v2 hands
    its controllers back there), then the node goes home if it ``entered`` its
    leaves, then the leaves are emptied and the trees removed.

    Raises:
        SandboxError: naming every step that failed.
    """
    errors: list[str] = []
    names = {c.name for t in trees for c in children(t.base, skip=NODE_LEAF)}
    for name in sorted(names):
        attempt(errors, partial(remove, name))
    for step in release:
        attempt(errors, step)
    if entered:
        for tree in trees:
            attempt(errors, partial(go_home, host, tree.original, tree.parent))
    attempt(errors, lambda: empty_cgroups(host, [t.leaf for t in trees]))
    for tree in trees:
        attempt(errors, partial(remove_tree, host, tree.base))
    raise_if(errors)
