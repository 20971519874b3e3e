"""A pidfile that is checked for identity before anyone signals the pid.

A pid alone can be reused by a stranger after a crash; the file also stores
the process's start time (``psutil.Process.create_time``), and a pid whose
start time differs is treated as not ours.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil


def write_pidfile(path: Path) -> None:
    """Record this process (pid and start time) in ``path``, atomically."""
    me = psutil.Process()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))
    os.replace(tmp, path)


def read_live_pid(path: Path) -> int | None:
    """The pid in ``path`` if that very process is still running, else None."""
    try:
        data = json.loads(path.read_text())
        pid, created = int(data["pid"]), float(data["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.01 or proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return pid


def remove_pidfile(path: Path) -> None:
    """Remove ``path`` if it names this process (never another node's file)."""
    if read_live_pid(path) == os.getpid():
        path.unlink(missing_ok=True)
