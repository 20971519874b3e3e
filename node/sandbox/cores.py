"""Which cores each worker runs on, how many threads it uses, and at what priority.

The node plans once, at start, before anything is spawned (so a bad reservation
stops the start with nothing half-started):

* **Reserved cores** (``workers.cpus``) are for the workers; the other cores of
  the node's allowed set (``os.sched_getaffinity(0)``) stay with the host's own
  processes. ``"auto"`` (the default) leaves the first allowed core to the host
  and reserves the rest, on a host the node may run on with two cores or more
  (``reserved_cores``): on a two-core board a host's control loop kept its idle
  missed-deadline share in more runs with the model on the other core than on
  its own (4 of 8 against 3 of 8, docs/bench/figures.md, "Isolation: the default
  reserves a core"), and its core is never the model's. An empty list means "no
  reservation": the workers may use every allowed core, and only nice level and
  CPU quota keep them behind the host.
* **The node's own cores** (``node.cpus``) are where the broker and the rule
  worker run. By default they follow the reservation: the whole node stays on
  the reserved cores, at nice 0 ahead of the workers (nice 10), so the host's
  cores see nothing of it. A broker on the host's cores relays every token
  there (tens of wake-ups a second), which makes the host's own latency-bound
  processes miss deadlines (measured: docs/bench/figures.md §node.sandbox.cores).
  Except in a node embedded in an app (``node.app.Node`` started by the app)
  under ``"auto"``: the broker's threads are the app's, which the node does not
  move unless ``node.cpus`` or a ``workers.cpus`` list says so.
* **Placement**: with at least as many cores as workers, each worker gets its
  own disjoint slice of the pool (sizes differ by at most one core); with fewer,
  every worker shares the whole pool (``cpus = [1]`` and two workers: both on
  core 1).
* **Threads**: llama.cpp's default thread count ignores affinity and quotas and
  oversubscribes the cores (huge slowdowns), so ``n_threads`` = the cores a
  worker may really use = min(its cores, whole cores of its quota (at least 1),
  the configured ``workers.threads``).
* **Priority**: workers run at ``nice`` 0..19 (lower than the host's processes),
  and so do their autogroups and cpu cgroups: see node.sandbox.niceness.

The worker applies its placement to itself, first thing in ``main()`` and before
any thread exists (zmq's I/O thread, llama.cpp's pool): on Linux affinity and
nice are per thread, and only threads created afterwards inherit them.
CPU lists use the kernel's list format, ``0-3,6`` (Documentation/admin-guide/
cgroup-v1/cpusets.rst, "cpus" and "mems" files).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from broker.errors import ConfigError, SandboxError
from node.sandbox.niceness import check_nice, renice, set_autogroup_nice, set_slice
from node.units import parse_cores

if TYPE_CHECKING:
    from node.config import CoreSetting, WorkersSection

log = logging.getLogger("edgenode.affinity")


@dataclass(frozen=True)
class Placement:
    """Where one worker runs.

    Attributes:
        index: the worker's position (0-based) in the pool.
        cpus: the cores it is pinned to (sorted).
        threads: llama.cpp ``n_threads``: the cores it may really use.
        nice: its scheduling priority (0..19; higher is lower priority).
    """

    index: int
    cpus: tuple[int, ...]
    threads: int
    nice: int


@dataclass(frozen=True)
class CpuPlan:
    """The node's core plan.

    Attributes:
        allowed: cores this process may run on at start (``os.sched_getaffinity(0)``).
        reserved: cores given to workers (all of ``allowed`` when none are reserved).
        host: allowed cores not reserved: the host's.
        workers: one placement per worker, by index.
        node: the broker's and the rule worker's cores; () = not pinned.
    """

    allowed: tuple[int, ...]
    reserved: tuple[int, ...]
    host: tuple[int, ...]
    workers: tuple[Placement, ...]
    node: tuple[int, ...] = ()

    @property
    def restricts(self) -> bool:
        """Whether any worker is confined to fewer cores than the node may use."""
        return any(len(p.cpus) < len(self.allowed) for p in self.workers)

    @property
    def reserves(self) -> bool:
        """Whether cores are reserved: some allowed cores stay with the host alone."""
        return len(self.host) < len(self.allowed)

    def describe(self, setting: CoreSetting) -> dict[str, Any]:
        """``status``'s ``cores`` map (docs/PROTOCOL.md §12.4): ``setting`` (``workers.cpus``:
        "auto" or the list), ``reserved`` (bool: the workers are kept to reserved cores),
        ``workers`` (the cores they may use), ``node`` (the broker's and the rule
        worker's; [] = not pinned, so any), ``host`` (the allowed cores neither may use:
        the host's alone)."""
        used = set(self.reserved) | set(self.node or self.allowed)
        return {
            "setting": setting if isinstance(setting, str) else list(setting),
            "reserved": self.reserves,
            "workers": list(self.reserved),
            "node": list(self.node),
            "host": [c for c in self.allowed if c not in used],
        }


def cores_line(cores: Mapping[str, Any]) -> str:
    """One line for a ``CpuPlan.describe`` map (status and the node's start log):
    ``cores: workers on 1; the node on 1; the host keeps 0 alone (workers.cpus =
    "auto")``; without a reservation ``cores: workers on 0-1, shared with the host
    below it by nice; the node on any; no core is the host's alone (workers.cpus = [])``."""
    setting = cores.get("setting")
    said = f'"{setting}"' if isinstance(setting, str) else str(setting)
    workers = format_cpus(cores.get("workers") or [])
    shared = "" if cores.get("reserved") else ", shared with the host below it by nice"
    node = format_cpus(cores.get("node") or []) or "any"
    host = format_cpus(cores.get("host") or [])
    keeps = f"the host keeps {host} alone" if host else "no core is the host's alone"
    return (
        f"cores: workers on {workers}{shared}; the node on {node}; {keeps} (workers.cpus = {said})"
    )


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on (``os.sched_getaffinity(0)``), sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def reserved_cores(setting: CoreSetting, allowed: Sequence[int]) -> tuple[int, ...]:
    """The cores ``workers.cpus`` reserves on a host whose allowed cores are ``allowed``.

    ``"auto"``: every allowed core but the lowest-numbered, which the host keeps
    (Linux's first core is where boot-time services and, by convention, the
    host's own processes start); with one allowed core, none (the node shares
    it, behind the host by nice). A list is returned as given (``plan_cpus``
    checks it).
    """
    if not isinstance(setting, str):
        return tuple(setting)
    cores = sorted(allowed)
    return tuple(cores[1:]) if len(cores) >= 2 else ()


def plan_workers(
    w: WorkersSection,
    node_cpus: Sequence[int] = (),
    *,
    count: int | None = None,
    allowed: Iterable[int] | None = None,
    embedded: bool = False,
) -> CpuPlan:
    """The core plan for ``[workers]`` and ``node.cpus`` on this host (``edgenode
    start`` checks it first); ``count`` workers, default ``workers.count``;
    ``allowed`` cores, default ``allowed_cores()``; ``embedded``: the node runs in
    an app's process, whose threads ``"auto"`` does not pin (module docstring).

    Raises:
        ConfigError: an impossible reservation (cores outside the allowed set, all of them).
    """
    allowed_set = tuple(sorted(set(allowed_cores() if allowed is None else allowed)))
    return plan_cpus(
        w.count if count is None else count,
        reserved_cores(w.cpus, allowed_set),
        allowed=allowed_set,
        cpu_quota_cores=parse_cores(w.cpu_quota),
        max_threads=w.threads,
        nice=w.nice,
        node=node_cpus,
        node_follows=not (embedded and isinstance(w.cpus, str)),
    )


def worker_threads(w: WorkersSection, count: int | None = None) -> int:
    """The threads each model worker really runs: its ``Placement.threads`` (llama.cpp
    ``n_threads``, status's THR) in the plan for ``count`` workers (default
    ``workers.count``, at least one), the fewest where slices differ by a core.
    ``workers.slots = "auto"`` is sized on it (node.capacity.plan).

    Raises:
        ConfigError: an impossible reservation (``plan_cpus``).
    """
    placed = plan_workers(w, count=max(1, w.count if count is None else count)).workers
    return min(p.threads for p in placed)


def plan_cpus(
    count: int,
    reserved: Sequence[int] = (),
    *,
    allowed: Iterable[int] | None = None,
    cpu_quota_cores: float | None = None,
    max_threads: int | None = None,
    nice: int = 10,
    node: Sequence[int] = (),
    node_follows: bool = True,
) -> CpuPlan:
    """Validate the reservation and place ``count`` workers and the node.

    Args:
        count: number of workers.
        reserved: ``workers.cpus``; empty = share every allowed core.
        allowed: the cores this process may use; default ``allowed_cores()``.
        cpu_quota_cores: each worker's CPU quota in cores (None = no quota).
        max_threads: ``workers.threads``, an upper bound on ``n_threads`` (None = none).
        nice: the workers' nice level.
        node: ``node.cpus``; empty = the reserved cores if any (and ``node_follows``),
            else not pinned.

    Raises:
        ConfigError: a core listed twice or outside the allowed set, a
            reservation of every allowed core, or a nice level outside 0..19.
    """
    allowed_set = sorted(set(allowed_cores() if allowed is None else allowed))
    check_nice(nice)
    pool = _check_reserved(reserved, allowed_set)
    chunks = split_cores(pool, count)
    workers = tuple(
        Placement(
            index=i,
            cpus=cpus,
            threads=usable_threads(len(cpus), cpu_quota_cores, max_threads),
            nice=nice,
        )
        for i, cpus in enumerate(chunks)
    )
    host = tuple(c for c in allowed_set if c not in pool) if reserved else tuple(allowed_set)
    follows = pool if reserved and node_follows else ()
    node_cpus = _check_cores("node.cpus", node, allowed_set) if node else follows
    return CpuPlan(tuple(allowed_set), pool, host, workers, node_cpus)


def _check_cores(key: str, cores: Sequence[int], allowed: list[int]) -> tuple[int, ...]:
    """``cores`` sorted, each listed once and within ``allowed``; else ConfigError."""
    seen: set[int] = set()
    for core in cores:
        if core in seen:
            raise ConfigError(f"{key} lists core {core} twice")
        seen.add(core)
    outside = sorted(seen - set(allowed))
    if outside:
        raise ConfigError(
            f"{key} names core(s) {format_cpus(outside)}, but this process may only "
            f"run on {format_cpus(allowed)} (os.sched_getaffinity); choose cores from that set"
        )
    return tuple(sorted(seen))


def _check_reserved(reserved: Sequence[int], allowed: list[int]) -> tuple[int, ...]:
    if not reserved:
        return tuple(allowed)
    seen = set(_check_cores("workers.cpus", reserved, allowed))
    if seen == set(allowed):
        raise ConfigError(
            f"workers.cpus reserves every core this process may use ({format_cpus(allowed)}), "
            "leaving none for the host; reserve fewer, or set workers.cpus = [] to share all cores "
            "at a lower priority"
        )
    return tuple(sorted(seen))


def split_cores(pool: Sequence[int], count: int) -> list[tuple[int, ...]]:
    """``count`` core sets from ``pool``: disjoint slices if it has enough cores, else all share.

    Slices are contiguous (neighbouring cores often share a cache) and differ in
    size by at most one core; the first workers get the larger ones.
    """
    cores = tuple(sorted(pool))
    if count <= 0:
        return []
    if len(cores) < count:
        return [cores] * count
    size, extra = divmod(len(cores), count)
    chunks: list[tuple[int, ...]] = []
    start = 0
    for i in range(count):
        end = start + size + (1 if i < extra else 0)
        chunks.append(cores[start:end])
        start = end
    return chunks


def usable_threads(
    n_cpus: int, cpu_quota_cores: float | None = None, max_threads: int | None = None
) -> int:
    """Threads a worker can really run at once: min(cores, whole cores of quota, cap), >= 1.

    A quota of 1.5 cores per period runs 1 thread flat out (a second one would
    only make both stall at the end of each period), so it rounds down, but
    never below one thread.
    """
    threads = max(1, n_cpus)
    if cpu_quota_cores is not None:
        threads = min(threads, max(1, int(cpu_quota_cores)))
    if max_threads is not None and max_threads > 0:
        threads = min(threads, max_threads)
    return threads


# ---------------------------------------------------------------- in the worker


def pin(cpus: Collection[int]) -> None:
    """Pin the calling thread (and every thread it creates later) to ``cpus``.

    Raises:
        SandboxError: the kernel refused (a core offline or outside the cpuset).
    """
    if not cpus:
        return
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise SandboxError(f"cannot pin to cores {format_cpus(cpus)}: {exc.strerror}") from exc


def pin_all_threads(cpus: Collection[int], task_dir: Path = Path("/proc/self/task")) -> None:
    """Pin every thread this process already has (and so those they create later).

    ``pin`` moves only the calling thread; a library may have started threads at
    import (numpy's OpenBLAS pool) that would stay on the old cores
    (test_cores.py::test_pin_all_threads_moves_threads_started_earlier).

    Raises:
        SandboxError: the kernel refused (a core offline or outside the cpuset).
    """
    if not cpus:
        return
    pin(cpus)
    for tid in sorted(int(t) for t in os.listdir(task_dir)):
        try:
            os.sched_setaffinity(tid, set(cpus))
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
        except OSError as exc:
            raise SandboxError(
                f"cannot pin thread {tid} to cores {format_cpus(cpus)}: {exc.strerror}"
            ) from exc


def thread_affinities(task_dir: Path = Path("/proc/self/task")) -> dict[int, set[int]]:
    """Each thread's cores, by thread id: what ``restore_affinities`` gives back."""
    saved: dict[int, set[int]] = {}
    for tid in (int(t) for t in os.listdir(task_dir)):
        try:
            saved[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:
            continue  # a thread that ended meanwhile
    return saved


def restore_affinities(
    saved: dict[int, set[int]],
    pinned: Collection[int],
    default: set[int],
    task_dir: Path = Path("/proc/self/task"),
) -> None:
    """Undo ``pin_all_threads(pinned)`` for an app that embeds the node: each thread
    still on exactly ``pinned`` gets back its own cores from ``saved`` (a thread
    started since: ``default``); a thread the app moved meanwhile keeps its cores.

    Raises:
        SandboxError: the kernel refused (a core offline or outside the cpuset).
    """
    for tid in sorted(int(t) for t in os.listdir(task_dir)):
        try:
            if os.sched_getaffinity(tid) == set(pinned):
                os.sched_setaffinity(tid, saved.get(tid, default))
        except ProcessLookupError:
            continue
        except OSError as exc:
            raise SandboxError(f"cannot give thread {tid} its cores back: {exc.strerror}") from exc


def apply_placement(cpus: Collection[int], nice: int, slice_us: int = 0) -> None:
    """Pin, renice, renice the autogroup and ask for a ``slice_us`` µs scheduler slice
    (0 = the kernel's; ``node.sandbox.niceness.set_slice``): what a worker does to
    itself before it starts any thread (so its threads inherit all of it).

    A slice the kernel refuses is logged and skipped: it only shortens how long a
    worker thread may delay a woken host thread, and the worker is still fenced.

    Raises:
        SandboxError: the kernel refused the pinning or a nice level.
    """
    pin(cpus)
    renice(nice)
    grouped = set_autogroup_nice(nice)
    got = None
    if slice_us:
        try:
            got = set_slice(slice_us)
        except SandboxError as exc:
            log.warning("%s; the kernel's default slice applies", exc.message)
        else:
            if got is None:
                log.info(
                    "this kernel keeps its default scheduler slice (custom slices need "
                    "Linux 6.12+): a host thread may wait up to a tick behind a worker thread"
                )
    log.debug(
        "pinned to %s at nice %d%s, slice %s",
        format_cpus(cpus),
        nice,
        " (autogroup too)" if grouped else "",
        "default" if got is None else f"{got} µs",
    )


# ---------------------------------------------------------------- cpu lists


def format_cpus(cpus: Iterable[int]) -> str:
    """The kernel's list format: ``format_cpus([0, 1, 2, 3, 6]) == "0-3,6"``."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpus(text: str) -> tuple[int, ...]:
    """Parse the kernel's list format (``"0-3,6"``; empty = none).

    Raises:
        ValueError: not a cpu list.
    """
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if first > last:
            raise ValueError(f"not a cpu list: {text!r}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))
