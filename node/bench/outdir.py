"""The bench's ``--out`` directory: checked and claimed before anything runs, and
released after the report is written.

A claim is an exclusive ``flock`` on ``<out>/.bench.lock`` (its pid inside): creating that
file is the test-write, and a second bench with the same ``--out`` finds it locked. The lock
goes with the process, so one left by a killed bench does not block the next.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

#: The files of a finished report (``node.bench.report.write``); any of them in ``--out``
#: means it already holds a report.
REPORT_FILES = ("report.md", "report.json")
LOCK_NAME = ".bench.lock"


class OutDirError(ValueError):
    """``--out`` cannot take this run's report (the message says why, in one line)."""


class OutClaim:
    """This process's hold on an ``--out`` directory; ``release`` when the report is written."""

    def __init__(self, out: Path, fd: int) -> None:
        self.out = out
        self._fd: int | None = fd

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.out / LOCK_NAME).unlink()
        os.close(self._fd)
        self._fd = None


def claim(out: Path, force: bool) -> OutClaim:
    """Make ``out`` (parents too), test-write it and lock it for this run.

    Raises:
        OutDirError: ``out`` cannot be made or written (under a file, in /proc or /sys, a
            read-only directory: the OS's reason is given); another bench is writing into it;
            it already holds a report and ``force`` is false.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise OutDirError(f"{out}: cannot write the report there ({_reason(exc)})") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise OutDirError(
            f"{out}: another edgenode bench (pid {holder}) is writing its report there"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as exc:
        os.close(fd)
        raise OutDirError(f"{out}: cannot write the report there ({_reason(exc)})") from exc
    held = OutClaim(out, fd)
    existing = [name for name in REPORT_FILES if (out / name).exists()]
    if existing and not force:
        held.release()
        raise OutDirError(
            f"{out} already holds a report ({', '.join(existing)}): "
            "choose another --out, or --force to replace it"
        )
    return held


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
