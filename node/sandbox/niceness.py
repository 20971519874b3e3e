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
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

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


def process_niceness(pid: int, proc: Path = Path("/proc")) -> dict[str, int | None]:
    """How the scheduler ranks process ``pid``: its main thread's ``nice`` and its
    autogroup's (``autogroup_nice``; None without autogroups or when unreadable)."""
    try:
        nice: int | None = os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        nice = None
    group = autogroup_nice(proc / str(pid) / "autogroup") if autogroups_enabled() else None
    return {"nice": nice, "autogroup_nice": group}


def autogroups_enabled(sysctl: Path = Path("/proc/sys/kernel/sched_autogroup_enabled")) -> bool:
    """Whether the kernel groups tasks by session (``kernel.sched_autogroup_enabled``)."""
    try:
        return sysctl.read_text().strip() == "1"
    except OSError:
        return False
