"""How the scheduler ranks a worker against the host: nice level, autogroup, CFS weight.

A nice level only ranks threads of one scheduling group. Each worker is a
session leader (one ``killpg`` takes all of it), and with
``CONFIG_SCHED_AUTOGROUP`` (``kernel.sched_autogroup_enabled = 1``, the default
on Debian, Ubuntu and most desktop-derived images) every session is its own
group that competes with the host's sessions at nice 0 whatever its threads'
nice level (sched(7), "The autogroup feature"), so a nice-10 worker still makes
the host's processes on its core miss deadlines (measured: docs/bench/figures.md
§node.sandbox.niceness). So the worker also sets its autogroup's nice level
(``/proc/self/autogroup``); inside a cgroup of its own with the cpu controller,
the sandbox gives the cgroup the nice level's weight instead (``nice_weight``:
autogroups only exist in the root task group).

A lower weight is not enough on a kernel with the EEVDF scheduler (Linux 6.6
and later): a thread just picked to run is protected from a woken one for its
whole slice (0.7-3 ms by default, "RUN_TO_PARITY"), and the kernel looks again
only at its next tick (4 ms at HZ=250). A host's control loop that wakes just
after a worker thread was pulled onto its core then waits up to 5 ms behind a
nice-10 thread (traced with sched_switch/sched_wakeup: docs/bench/figures.md
"Isolation: the scheduler slice"). So model workers ask for the shortest slice
the kernel allows (``set_slice``: ``sched_setattr``'s ``sched_runtime`` for a
fair-class task, Linux 6.12+, clamped by the kernel to 0.1-100 ms); an older
kernel accepts the call and ignores it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
from pathlib import Path
from typing import TypedDict

from broker.errors import ConfigError, SandboxError

#: CFS load weight of nice 0..19: the kernel's ``sched_prio_to_weight``
#: (kernel/sched/core.c; each level is ~1.25x the next, nice 0 = 1024). A v1
#: ``cpu.shares`` value is such a weight; v2's ``cpu.weight`` is it x 100 / 1024.
NICE_WEIGHTS = (
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
)  # fmt: skip

#: The calling process's autogroup: "/autogroup-<id> nice <n>" (sched(7)).
AUTOGROUP = Path("/proc/self/autogroup")


def check_nice(nice: int) -> None:
    """Raise ConfigError unless ``nice`` is 0..19: a worker runs at or below the host."""
    if not 0 <= nice <= 19:
        raise ConfigError(
            f"workers.nice must be 0..19 (workers run at or below the host's priority), got {nice}"
        )


def renice(nice: int) -> None:
    """Set the calling thread's nice level (inherited by threads created later).

    Only lowers priority: raising it needs CAP_SYS_NICE and is never what a
    worker should do, so a level below the current one is left alone.

    Raises:
        SandboxError: the kernel refused.
    """
    try:
        current = os.getpriority(os.PRIO_PROCESS, 0)
        if nice > current:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        raise SandboxError(f"cannot set nice {nice}: {exc.strerror}") from exc


def nice_weight(nice: int) -> int:
    """The CFS weight of a nice level (0..19): 1024 for 0, 110 for 10, 15 for 19.

    Raises:
        ConfigError: a level outside 0..19.
    """
    check_nice(nice)
    return NICE_WEIGHTS[nice]


def cpu_weight_v2(nice: int) -> int:
    """cgroup v2 ``cpu.weight`` (1..10000, default 100) of a nice level (0..19): its
    CFS weight x 100 / 1024, the kernel's own conversion (cgroup-v2.rst "cpu.weight",
    kernel/sched/core.c ``cpu_weight_write_u64``). Nice 10 gives 11.

    Raises:
        ConfigError: a level outside 0..19.
    """
    return max(1, round(nice_weight(nice) * 100 / 1024))


def set_autogroup_nice(nice: int, path: Path = AUTOGROUP) -> bool:
    """Give the calling process's autogroup the nice level ``nice``; True if set.

    Only a session leader may: its autogroup holds its own session and nothing
    else, where a shell's or the node's would be reniced whole. Without
    autogroups (no ``path``, or ``kernel.sched_autogroup_enabled = 0``: then
    every task of the root task group is ranked by its own nice level) it is
    not needed and does nothing. Only lowers priority, as ``renice`` does.

    Raises:
        SandboxError: the kernel refused the write.
    """
    if os.getsid(0) != os.getpid() or not autogroups_enabled():
        return False
    current = autogroup_nice(path)
    if current is None or current >= nice:
        return False
    try:
        path.write_text(f"{nice}\n")
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise SandboxError(f"cannot set the autogroup's nice to {nice}: {exc.strerror}") from exc
    return True


def autogroup_nice(path: Path = AUTOGROUP) -> int | None:
    """The nice level of the calling process's autogroup, or None without autogroups."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    try:
        return int(fields[fields.index("nice") + 1])
    except (ValueError, IndexError):
        return None


class Niceness(TypedDict):
    """How the scheduler ranks a process (``process_niceness``)."""

    nice: int | None
    autogroup_nice: int | None
    #: Its main thread's fair-class scheduler slice in µs (``thread_slice_us``).
    slice_us: int | None


#: Nothing known (no process).
NO_NICENESS: Niceness = {"nice": None, "autogroup_nice": None, "slice_us": None}


def process_niceness(pid: int, proc: Path = Path("/proc")) -> Niceness:
    """How the scheduler ranks process ``pid``: its main thread's ``nice``, its
    autogroup's (``autogroup_nice``; None without autogroups or when unreadable)
    and its slice (``slice_us``, ``thread_slice_us``)."""
    try:
        nice: int | None = os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        nice = None
    group = autogroup_nice(proc / str(pid) / "autogroup") if autogroups_enabled() else None
    return {"nice": nice, "autogroup_nice": group, "slice_us": thread_slice_us(pid)}


def autogroups_enabled(sysctl: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> bool:
    """Whether the kernel groups tasks by session (``kernel.sched_autogroup_enabled``)."""
    try:
        return sysctl.read_text().strip() == "1"
    except OSError:
        return False


# ------------------------------------------------------------------ the slice

#: The shortest fair-class slice the kernel grants (kernel/sched/syscalls.c clamps
#: ``sched_runtime`` to 0.1-100 ms for SCHED_OTHER and SCHED_BATCH).
MIN_SLICE_US = 100
MAX_SLICE_US = 100_000

#: ``sched_setattr`` / ``sched_getattr`` numbers (glibc has no wrappers): the kernel's
#: arch/x86/entry/syscalls/syscall_64.tbl and syscall_32.tbl, arch/arm/tools/syscall.tbl,
#: include/uapi/asm-generic/unistd.h (arm64, riscv64, loongarch64).
_SCHED_ATTR_CALLS: dict[str, tuple[int, int]] = {
    "x86_64": (314, 315),
    "aarch64": (274, 275),
    "arm64": (274, 275),
    "riscv64": (274, 275),
    "loongarch64": (274, 275),
    "armv7l": (380, 381),
    "armv6l": (380, 381),
    "i686": (351, 352),
}
#: Fair-class policies (sched(7)): SCHED_OTHER, SCHED_BATCH. Others are left alone.
_FAIR_POLICIES = (0, 3)


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (include/uapi/linux/sched/types.h), version 1: 56 bytes."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),  # ns; a fair task's slice since Linux 6.12
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (``status`` reads every worker's slice per call)."""
    return ctypes.CDLL(None, use_errno=True)


def _sched_attr_call(which: int, tid: int, attr: _SchedAttr) -> None:
    """``sched_getattr`` (which=1) or ``sched_setattr`` (which=0) of thread ``tid``
    (0 = the calling thread). Raises OSError, or NotImplementedError on a machine
    whose syscall numbers are not in ``_SCHED_ATTR_CALLS``."""
    numbers = _SCHED_ATTR_CALLS.get(platform.machine())
    if numbers is None:
        raise NotImplementedError(f"sched_setattr on {platform.machine()}")
    libc = _libc()
    args = (tid, ctypes.byref(attr), 0) if which == 0 else (tid, ctypes.byref(attr), 56, 0)
    if libc.syscall(numbers[which], *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def kernel_has_custom_slices(release: str | None = None) -> bool:
    """Whether the kernel (``release``, default ``os.uname().release``) honours a
    fair task's ``sched_runtime``: Linux 6.12 and later ("sched/eevdf: Use
    sched_attr::sched_runtime to set request/slice suggestion"). By version
    number, so a vendor's backport reads as False."""
    text = os.uname().release if release is None else release
    parts = text.split(".")
    try:
        major, minor = int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (ValueError, IndexError):
        return False
    return (major, minor) >= (6, 12)


def thread_slice_us(tid: int) -> int | None:
    """Thread ``tid``'s fair-class scheduler slice in µs: the one asked for
    (``set_slice``) or the kernel's default (1400 on a 2-core 6.18 host); None on a
    kernel before 6.12 (which reads 0), for another policy, or when unreadable."""
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr))
    try:
        _sched_attr_call(1, tid, attr)
    except (OSError, NotImplementedError):
        return None
    if attr.sched_policy not in _FAIR_POLICIES or not attr.sched_runtime:
        return None
    return int(attr.sched_runtime // 1000)


def check_slice(slice_us: int) -> None:
    """Raise ConfigError unless ``slice_us`` is 0 (the kernel's default) or within
    the kernel's range, ``MIN_SLICE_US``..``MAX_SLICE_US``."""
    if slice_us != 0 and not MIN_SLICE_US <= slice_us <= MAX_SLICE_US:
        raise ConfigError(
            f"workers.slice_us must be 0 (the kernel's default) or {MIN_SLICE_US}.."
            f"{MAX_SLICE_US} µs (the range the kernel grants), got {slice_us}"
        )


def set_slice(slice_us: int) -> int | None:
    """Ask for a ``slice_us`` µs scheduler slice for the calling thread (inherited by
    threads and processes it starts later); returns the slice now in effect, or None
    where the kernel has no custom slices (before Linux 6.12 the call succeeds and
    changes nothing) or on a machine without known syscall numbers. Keeps the thread's
    policy and nice level; a real-time or deadline thread is left alone.

    Raises:
        SandboxError: the kernel refused (EPERM under a seccomp filter, EINVAL).
    """
    attr = _SchedAttr(size=ctypes.sizeof(_SchedAttr))
    try:
        _sched_attr_call(1, 0, attr)
        if attr.sched_policy not in _FAIR_POLICIES:
            return None
        attr.size = ctypes.sizeof(_SchedAttr)
        attr.sched_flags = 0
        attr.sched_runtime = slice_us * 1000
        _sched_attr_call(0, 0, attr)
    except NotImplementedError:
        return None
    except OSError as exc:
        raise SandboxError(f"cannot set a {slice_us} µs scheduler slice: {exc.strerror}") from exc
    return thread_slice_us(0)
