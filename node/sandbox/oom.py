"""Which process the kernel's OOM killer takes first: a model worker, not the host's.

When memory runs out above a worker's own cgroup (the machine, a parent slice or
container, the node's own limit), the kernel kills the task with the highest
*badness*: its memory (resident, swap and page tables) in thousandths of the
memory it may use, plus ``/proc/<pid>/oom_score_adj`` (-1000..1000; kernel
``Documentation/filesystems/proc.rst`` §3.1, ``mm/oom_kill.c`` ``oom_badness``).
A model worker is the one process here that is restarted at no cost to the host,
so it raises its own value (``workers.oom_score_adj``, 500: a worker then goes
before any process using less than half of that memory); the node's broker and
rule worker keep theirs. Raising it needs no privilege; lowering it below the
value the process inherited needs CAP_SYS_RESOURCE.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SELF = Path("/proc/self/oom_score_adj")


def raise_oom_score_adj(value: int, path: Path = SELF) -> bool:
    """Raise this process's ``oom_score_adj`` to ``value`` (inherited by its threads
    and children); never lower it: a node started with a higher value (say 700)
    would otherwise leave its workers below its broker, which root may do. False,
    logged, when it was not raised: already at or above ``value``, or the kernel
    refused (a /proc without the file); the worker runs on at the inherited value."""
    try:
        inherited = int(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read oom_score_adj: %s; the inherited value applies", exc)
        return False
    if inherited >= value:
        log.debug("oom_score_adj %d inherited, not lowered to %d", inherited, value)
        return False
    try:
        path.write_text(f"{value}\n")
    except OSError as exc:
        log.warning("cannot set oom_score_adj %d: %s; the inherited value applies", value, exc)
        return False
    return True


def oom_score_adj(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Process ``pid``'s ``oom_score_adj``, None if it cannot be read (no process)."""
    with contextlib.suppress(OSError, ValueError):
        return int((proc / str(pid) / "oom_score_adj").read_text())
    return None
