"""One node per run directory: an exclusive lock held for the node's whole life.

The running node holds ``flock(LOCK_EX)`` on the run directory itself (no lock
file to go stale or be deleted under it). The kernel drops the lock when the
node's process ends, however it ends, so a crash never leaves a "running" mark.
``lock_holder`` names the process holding it from ``/proc/locks`` (proc(5)),
read-only: probing by taking the lock for a moment would make a node starting
at that instant fail. ``edgenode stop`` signals only that process, through a
pidfd opened and then checked against the lock again, so neither a pidfile that
names a stranger nor a pid reused meanwhile leads to a signal.

The pidfile (``<run_dir>/edgenode.pid``: pid and start time) stays for humans
and service managers; nothing here trusts it to choose whom to signal.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
from pathlib import Path
from types import TracebackType

import psutil

from broker.errors import ConfigError

#: ``/proc/locks`` (proc(5)): one lock per line, e.g.
#: ``1: FLOCK  ADVISORY  WRITE 30382 fe:00:2155783 0 EOF``; waiters are ``1: -> FLOCK ...``.
PROC_LOCKS = Path("/proc/locks")

PIDFILE_NAME = "edgenode.pid"


class RunLock:
    """The exclusive lock on a run directory; ``with RunLock(run_dir):`` holds it.

    The descriptor is close-on-exec, so workers never inherit (and never keep)
    the lock.

    Raises (on enter):
        ConfigError: another process holds the lock; the message names its pid.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno != errno.EWOULDBLOCK:
                raise ConfigError(f"cannot lock run directory {self.run_dir}: {exc}") from exc
            raise ConfigError(in_use_message(self.run_dir)) from exc
        self._fd = fd
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None


def in_use_message(run_dir: Path) -> str:
    """Why a node cannot start on ``run_dir``: "already running (pid N, ...)"."""
    holder = lock_holder(run_dir)
    who = f"pid {holder.pid}" if holder is not None else "a process that just exited"
    return f"edgenode already running ({who}, {run_dir}): one node per run directory"


def lock_holder(run_dir: Path) -> psutil.Process | None:
    """The process holding the run directory's lock, or None.

    Read from ``/proc/locks`` without touching the lock. The holder is confirmed
    by an open descriptor of the directory in ``/proc/<pid>/fd`` where readable
    (``/proc/locks`` prints the superblock's device, which differs from
    ``stat``'s on e.g. btrfs subvolumes, so the inode alone only nominates).
    """
    try:
        st = os.stat(run_dir)
        text = PROC_LOCKS.read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue  # waiters ("->"), POSIX/OFD locks, shared locks
        pid, where = fields[4], fields[5].rsplit(":", 1)
        if len(where) != 2 or where[1] != str(st.st_ino) or not pid.isdigit():
            continue
        proc = _confirmed(int(pid), st, same_dev=where[0] == dev)
        if proc is not None:
            return proc
    return None


def _confirmed(pid: int, st: os.stat_result, same_dev: bool) -> psutil.Process | None:
    """``pid`` if it has the directory open (or, when its descriptors cannot be
    read, if ``/proc/locks`` showed the same device too)."""
    try:
        proc = psutil.Process(pid)
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return proc if same_dev else None
    except (OSError, psutil.Error):
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            fst = os.stat(f"/proc/{pid}/fd/{fd}")
            if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
                return proc
    return None


def signal_holder(run_dir: Path, signum: signal.Signals) -> psutil.Process | None:
    """Send ``signum`` to the process holding the run directory's lock; returns it,
    or None if no process holds the lock (then nothing is signalled).

    The signal goes through a pidfd (pidfd_open(2), Linux 5.3) opened on the
    holder and then checked against the lock again: if the pid changed hands in
    between, nothing is sent. Without pidfds, psutil checks the process's start
    time right before signalling.

    Raises:
        PermissionError, psutil.AccessDenied: the holder is another user's process.
    """
    holder = lock_holder(run_dir)
    if holder is None:
        return None
    try:
        pidfd = os.pidfd_open(holder.pid)
    except ProcessLookupError:
        return None
    except OSError:  # no pidfd_open on this kernel
        with contextlib.suppress(psutil.NoSuchProcess):
            holder.send_signal(signum)
            return holder
        return None
    try:
        again = lock_holder(run_dir)
        if again is None or again.pid != holder.pid:
            return None
        signal.pidfd_send_signal(pidfd, signum)
        return holder
    except ProcessLookupError:
        return None
    finally:
        os.close(pidfd)


def write_pidfile(path: Path) -> None:
    """Record this process (pid and start time) in ``path``, atomically."""
    me = psutil.Process()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"pid": me.pid, "create_time": me.create_time()}))
    os.replace(tmp, path)


def remove_pidfile(path: Path) -> None:
    """Remove ``path`` if it names this process (never another node's file)."""
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if pid == os.getpid():
        path.unlink(missing_ok=True)
