"""Per-worker cgroups on cgroup v2, v1 (legacy and hybrid hosts), or none.

Layout. The node's cgroup goes under its OWN cgroup (from /proc/self/cgroup) or
under ``workers.cgroup_root`` (a delegated subtree), never into the root cgroup
itself and never beside what systemd manages::

    <own or cgroup_root>/<name>/node        the node process itself
    <own or cgroup_root>/<name>/worker-<id> one per worker

The node moves itself into the ``node`` leaf because of cgroup v2's "no
internal processes" rule: a cgroup may enable controllers for its children
(``cgroup.subtree_control``) only while it holds no process (cgroup-v2.rst
2-4-4). On v1 the same layout is replicated in each controller's hierarchy
(memory, cpu, cpuset: what systemd's CGROUP_DELEGATION.md advises), and the
``node`` leaf doubles as the ownership mark: a live process in it means another
node owns the tree, so stale reaping refuses instead of killing.

Per worker: hard limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); high
watermark (v2 ``memory.high``; v1 has none, so the reading carries the
configured watermark and the node compares usage against it); swap off where
the kernel has the file (v2 ``memory.swap.max`` = 0; v1
``memory.memsw.limit_in_bytes`` = limit, cgroup-v1/memory.rst 2.4, written in
the order that keeps memsw >= limit as the kernel demands, and
``memory.swappiness`` = 0); v2 ``memory.oom.group`` = 1 (the worker dies
whole); CPU quota in µs per period (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` and
``cpu.cfs_period_us``) and, with it, the weight of ``workers.nice`` (v2
``cpu.weight``, v1 ``cpu.shares``: in a cgroup of its own a worker is ranked by
its cgroup's weight, not its threads' nice level; the node's tree gets the same
weight among the host's tasks, its own leaf keeps nice 0's inside); cores (``cpuset.cpus``; on
v1 also ``cpuset.mems``, copied from the parent: a new v1 cpuset starts empty
and attaching to it fails with ENOSPC, cgroup-v1/cpusets.rst).

Join before load. Pages are charged to the cgroup that first touches them and
the charge does not move with the process (cgroup-v2.rst 5-5-3; v1 memory.rst
2.3), so a worker must be in its cgroup before it maps the model. The WORKER
joins itself: ``join_cgroup(paths)`` is the first thing its ``main()`` does,
before the model is loaded and before any thread exists; the supervisor passes
the ``cgroup.procs`` paths in the worker's spec. Rejected alternatives: a
``preexec_fn`` (runs between fork and exec in a process that has zmq threads:
not safe, and Python warns about it), and the supervisor writing the pid after
``Popen`` (the child races ahead unless it waits for a confirmation, one more
handshake to get wrong). The interpreter start-up (a few MB of shared libraries,
mostly already cached by the node) stays charged to the node's leaf; the model
is charged to the worker. ``Sandbox.holds`` lets the supervisor verify the join
at READY.

Use. In the node, before it starts threads: ``plan_cpus`` (node.sandbox.cores), then
``Sandbox(options_for(cfg.workers, plan, cgroup_name(run_dir))).open()``; before
each spawn ``create_worker(id, limits_for(cfg.workers, placement.cpus, capacity))``
(``capacity``: the plan ``node.capacity.plan.check_fits`` returned; ``create_worker``
also resets a reused cgroup); ``memory(id)`` / ``memory()`` for status and
admission; ``close()`` after the workers are reaped. In the worker, first thing:
``join_cgroup(paths)``, then ``node.sandbox.cores.apply_placement(cpus, nice)``, then
load the model.

Modules: node/sandbox/layout.py (what the host mounts), node/sandbox/cgroupfs.py (file
access, killing, reaping), node/sandbox/driver.py (the cgroup driver protocol and the
values crossing it), node/sandbox/v2.py and node/sandbox/v1.py (the drivers);
this module's ``Sandbox`` is what the node and the worker use.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from broker.errors import SandboxError
from node.capacity.worker_limits import PlannedLimits, memory_high_bytes, memory_max_bytes
from node.config import WorkersSection
from node.sandbox.cgroupfs import NODE_LEAF, Host, join, pids_in
from node.sandbox.cores import CpuPlan
from node.sandbox.driver import (
    SANDBOX_MODES,
    CgroupDriver,
    Limits,
    MemoryReading,
    NoCgroups,
    SandboxOptions,
)
from node.sandbox.layout import Layout, read_layout
from node.sandbox.v1 import V1Driver
from node.sandbox.v2 import V2Driver
from node.units import parse_cores, quota_us

log = logging.getLogger("edgenode.sandbox")

WORKER_PREFIX = "worker-"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")


def limits_for(
    workers: WorkersSection, cpus: Sequence[int] = (), plan: PlannedLimits | None = None
) -> Limits:
    """A worker's limits from the config, its planned cores (``Placement.cpus``) and the
    capacity plan (``node.capacity.plan.check_fits``), which ``memory_max = "auto"`` reads.

    Raises:
        ConfigError: ``memory_max = "auto"`` and no plan.
    """
    return Limits(
        memory_max=memory_max_bytes(workers, plan),
        memory_high=memory_high_bytes(workers, plan),
        cpu_quota_us=quota_us(parse_cores(workers.cpu_quota)),
        cpus=tuple(cpus),
        nice=workers.nice,
    )


def options_for(
    workers: WorkersSection, plan: CpuPlan | None = None, name: str = "edgenode"
) -> SandboxOptions:
    """Options from the config: cpu when a quota is set, cpuset when cores are listed in
    ``workers.cpus`` (or merely wanted when the plan confines workers otherwise: the
    "auto" reservation, unreserved cores split between workers; affinity pins them anyway)."""
    need = {"memory"}
    if parse_cores(workers.cpu_quota) is not None:
        need.add("cpu")
    listed = not isinstance(workers.cpus, str) and bool(workers.cpus)
    if listed:
        need.add("cpuset")
    want = {"cpuset"} if plan is not None and plan.restricts and not listed else set()
    return SandboxOptions(
        workers.sandbox, workers.cgroup_root, name, frozenset(need), frozenset(want), workers.nice
    )


# ---------------------------------------------------------------- the sandbox


class Sandbox:
    """The node's cgroups: ``open`` at start, one ``create_worker`` per spawn,
    ``remove_worker``/``close`` at stop. Not thread-safe: call from the node's loop.

    Raises (``required`` mode only; ``auto`` logs a warning and runs without):
        SandboxError: cgroups cannot be created or configured; the message says why.
    """

    def __init__(self, options: SandboxOptions, host: Host | None = None) -> None:
        if options.mode not in SANDBOX_MODES:
            raise SandboxError(f"workers.sandbox must be one of {', '.join(SANDBOX_MODES)}")
        self.options = options
        self.host = host or Host()
        self.layout = "none"
        self.reason = "not opened"
        self.driver: CgroupDriver = NoCgroups()
        self._workers: dict[str, tuple[Path, ...]] = {}

    @property
    def active(self) -> bool:
        """Whether workers get cgroups."""
        return self.driver.kind != "none"

    @property
    def required(self) -> bool:
        return self.options.mode == "required"

    def open(self) -> None:
        """Detect the host, reap a crashed run's leftovers, create the node's cgroup, enter it.

        Call it before the node starts threads (zmq's context): on kernels
        before 6.2 joining a cpuset resets the affinity of every thread to the
        cpuset's cores, and only the calling thread's is restored here.
        """
        if self.options.mode == "off":
            self.reason = 'workers.sandbox = "off"'
            return
        driver: CgroupDriver = NoCgroups()
        try:
            layout = read_layout(self.host)
            self.layout = layout.kind
            driver = self._choose(layout)
            with _keep_affinity():
                driver.open()
        except (SandboxError, OSError) as exc:
            with contextlib.suppress(SandboxError, OSError), _keep_affinity():
                driver.close()  # undoes only what this open did
            self._fail(exc)
            return
        self.driver, self.reason = driver, ""
        log.info("sandbox: cgroup %s (%s on a %s host)", self.base, driver.kind, self.layout)

    def _choose(self, layout: Layout) -> CgroupDriver:
        strict = self.required
        if "memory" in layout.v1:
            return V1Driver(self.host, layout, self.options, strict)
        if layout.v2 is not None:
            return V2Driver(self.host, layout, self.options, strict)
        raise SandboxError("no cgroup filesystem with a memory controller is mounted")

    def _fail(self, exc: Exception) -> None:
        why = exc.message if isinstance(exc, SandboxError) else str(exc)
        if self.required:
            raise SandboxError(f'workers.sandbox = "required", but {why}') from exc
        self.reason = why
        log.warning('workers run WITHOUT cgroup limits (workers.sandbox = "auto"): %s', why)

    @property
    def base(self) -> str:
        """The node's cgroup directory (the memory hierarchy's on v1), or ""."""
        dirs = self.driver.dirs(None)
        return str(dirs[0]) if dirs else ""

    def create_worker(self, worker_id: str, limits: Limits) -> tuple[str, ...]:
        """Create (or reset, killing leftovers) a worker's cgroup and apply ``limits``.

        Returns the ``cgroup.procs`` paths for ``join_cgroup`` in the worker
        (empty without a sandbox). Call before each spawn of that worker.
        """
        name = _cgroup_name(worker_id)
        try:
            paths = self.driver.create(name, limits)
        except SandboxError as exc:
            if self.required:
                raise
            log.warning("worker %s runs WITHOUT a cgroup: %s", worker_id, exc)
            return ()
        self._workers[worker_id] = paths
        return tuple(str(p) for p in paths)

    def attach(self, worker_id: str, pid: int) -> None:
        """Move ``pid`` into the worker's cgroup from outside (the worker normally joins itself)."""
        join(self.host, [str(p) for p in self._workers.get(worker_id, ())], pid)

    def holds(self, worker_id: str, pid: int) -> bool:
        """Whether ``pid`` is in every hierarchy of the worker's cgroup (False without one)."""
        paths = self._workers.get(worker_id, ())
        return bool(paths) and all(pid in pids_in(p.parent) for p in paths)

    def cgroup_of(self, worker_id: str) -> str | None:
        """The worker's cgroup directory (memory hierarchy on v1), for ``status``."""
        paths = self._workers.get(worker_id)
        return str(paths[0].parent) if paths else None

    def memory(self, worker_id: str | None = None) -> MemoryReading | None:
        """A worker's memory (None = the whole node: node leaf plus workers), or None
        without a cgroup."""
        if not self.active or (worker_id is not None and worker_id not in self._workers):
            return None
        name = _cgroup_name(worker_id) if worker_id is not None else None
        return self.driver.read_memory(name)

    def remove_worker(self, worker_id: str) -> None:
        """Kill whatever is left in the worker's cgroup and remove it."""
        if self._workers.pop(worker_id, None) is not None:
            self.driver.remove(_cgroup_name(worker_id))

    def close(self) -> None:
        """Remove every worker cgroup, move the node back where it came from, remove the rest.

        Raises:
            SandboxError: something could not be removed (the rest is still tried first).
        """
        self._workers.clear()
        driver, self.driver = self.driver, NoCgroups()
        self.reason = "closed"
        with _keep_affinity():
            driver.close()

    def status(self) -> dict[str, object]:
        """For ``status``: mode, host layout, driver (``backend``), node cgroup, why not active."""
        return {
            "mode": self.options.mode,
            "layout": self.layout,
            "backend": self.driver.kind,
            "cgroup": self.base or None,
            "reason": self.reason or None,
            "reaped": list(self.driver.reaped),
        }

    def __enter__(self) -> Sandbox:
        self.open()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _keep_affinity() -> Iterator[None]:
    """Restore the calling thread's cores after moving between cpusets (kernels
    before 6.2 reset them to the cpuset's; newer ones keep what was asked)."""
    saved = os.sched_getaffinity(0)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, saved)


def cgroup_name(run_dir: Path) -> str:
    """The node's cgroup name for a run directory: ``edgenode-<8 hex>``.

    Stable across restarts of one node (so the stale reaping of a restart finds
    what a crashed run left) and distinct between nodes that share a parent
    cgroup (every node's v1 cpuset tree starts at the same own cgroup, often "/").
    """
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return f"edgenode-{digest}"


def _cgroup_name(worker_id: str) -> str:
    if not _NAME.match(worker_id) or worker_id == NODE_LEAF:
        raise SandboxError(f"worker id {worker_id!r} cannot name a cgroup")
    return WORKER_PREFIX + worker_id


def join_cgroup(procs_files: Sequence[str], pid: int | None = None) -> None:
    """Move this process (or ``pid``) into its cgroup: write it to each ``cgroup.procs``.

    The worker calls this first thing in ``main()``, before loading the model
    and before pinning (joining a cpuset resets the affinity to the cpuset's
    cores). ``procs_files`` comes from ``Sandbox.create_worker``; empty = no-op.

    Raises:
        SandboxError: a write failed or did not take.
    """
    join(Host(), procs_files, os.getpid() if pid is None else pid)
