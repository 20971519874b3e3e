"""One node per run directory: an exclusive lock held for the node's whole life.

The running node holds ``flock(LOCK_EX)`` on the run directory itself (no lock
file to go stale or be deleted under it). The kernel drops the lock when the
last descriptor of the locked open file is closed, however its processes end,
so a crash never leaves a "running" mark.

A background ``edgenode start`` takes the lock itself, before it spawns the
node, and hands the locked descriptor to the node (``pass_fds`` and
``EDGENODE_LOCK_FD``); the node adopts it (``RunLock(fd=...)``) instead of
locking again (a second flock from a new descriptor would conflict with it).
So from the moment a start has checked its config there is a holder that
``edgenode stop`` can stop: the start itself, which then stops the node it
launched, or the node.

``lock_holder`` names the holder read-only (probing by taking the lock for a
moment would make a node starting at that instant fail). ``/proc/locks``
(proc(5)) records the pid that *took* the lock, which after a handover is the
start command, gone once the node runs; so the holder is whichever process has
a descriptor of the directory whose ``/proc/<pid>/fdinfo`` lists the lock
(proc(5), "lock:" lines, Linux 3.8), the recorded pid first.

``edgenode stop`` signals only a holder that is an edgenode start
(``is_node_command``; an app that embeds a node is named, never signalled:
``EmbeddedHolderError``), through a pidfd opened and then checked against the lock
again, so neither a pidfile that names a stranger, nor an unrelated process
holding a flock on the directory, nor a pid reused meanwhile leads to a signal.

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
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psutil

from broker.errors import ConfigError
from node.interpreter import module_of_command

#: ``/proc/locks`` (proc(5)): one lock per line, e.g.
#: ``1: FLOCK  ADVISORY  WRITE 30382 fe:00:2155783 0 EOF``; waiters are ``1: -> FLOCK ...``.
PROC_LOCKS = Path("/proc/locks")

PIDFILE_NAME = "edgenode.pid"

#: Environment variable naming the descriptor of the run directory, already
#: locked, that a background ``edgenode start`` hands to the node it spawns.
LOCK_FD_ENV = "EDGENODE_LOCK_FD"

#: How long a refused start waits for a background start that holds the lock to
#: launch its node, so the refusal names the node (``serving_holder``), seconds:
#: the start checks the config (the model's metadata, the rules) first.
HANDOVER_WAIT_S = 30.0

#: How often ``signal_holder`` follows the lock to a new holder (the start
#: command exiting after its node is up hands the lock over once).
HOLDER_CHANGES = 3


class ForeignHolderError(ConfigError):
    """The run directory is locked by a process that is not an edgenode start
    (e.g. ``flock -x DIR sleep 60``): nothing is signalled, no node starts.

    Attributes:
        pid: the holder's pid.
        cmdline: its command line ("?" if unreadable).
    """

    def __init__(self, run_dir: Path, pid: int, cmdline: str) -> None:
        super().__init__(
            f"run directory {run_dir} is locked by another process, not an edgenode node "
            f"(pid {pid}: {cmdline})"
        )
        self.pid = pid
        self.cmdline = cmdline


class EmbeddedHolderError(ForeignHolderError):
    """The run directory's lock holder is an app that embeds a node
    (``with Node(config)``; its pidfile says ``"embedded": true`` and names it):
    a node serves there, but ``edgenode stop`` does not signal the app (its signals
    are its own); the app stops its node (``Node.stop()``, or the end of its
    ``with`` block).

    Attributes:
        pid, cmdline: as ``ForeignHolderError``'s.
    """

    def __init__(self, run_dir: Path, pid: int, cmdline: str) -> None:
        ConfigError.__init__(
            self,
            f"the edgenode node of {run_dir} is embedded in an app (pid {pid}: {cmdline}); "
            "the app stops it (Node.stop(), or the end of its with block)",
        )
        self.pid = pid
        self.cmdline = cmdline


def not_a_start(run_dir: Path, holder: psutil.Process) -> ForeignHolderError:
    """The error for a lock ``holder`` that is not an edgenode start: an app that
    embeds the node (``embeds_node``) or a process that is no node at all."""
    kind = EmbeddedHolderError if embeds_node(run_dir, holder) else ForeignHolderError
    return kind(run_dir, holder.pid, describe(holder))


def embeds_node(run_dir: Path, proc: psutil.Process) -> bool:
    """Whether ``run_dir``'s pidfile names ``proc`` (pid and start time) as an
    embedded node (``write_pidfile(embedded=True)``). Only the lock holder writes
    the pidfile, so the caller checks that ``proc`` holds the lock."""
    try:
        recorded = json.loads((run_dir / PIDFILE_NAME).read_text())
        return (
            recorded.get("embedded") is True
            and recorded.get("pid") == proc.pid
            # psutil's start time, recomputed: equal up to rounding (s).
            and abs(float(recorded.get("create_time")) - proc.create_time()) < 0.5
        )
    except (OSError, ValueError, TypeError, AttributeError, psutil.Error):
        return False


def make_run_dir(run_dir: Path) -> bool:
    """Make ``run_dir`` (and its parents) if missing, mode 0700; whether this call made it.

    Raises:
        OSError: it cannot be made or is no directory (``FileExistsError`` for a file).
    """
    try:
        run_dir.mkdir(parents=True)
        made = True
    except FileExistsError:
        if not run_dir.is_dir():
            raise
        made = False
    os.chmod(run_dir, 0o700)
    return made


def remove_empty_dir(path: Path) -> None:
    """Remove ``path`` if it is an empty directory; anything else stays, silently."""
    with contextlib.suppress(OSError):
        path.rmdir()


class RunLock:
    """The exclusive lock on a run directory; ``with RunLock(run_dir):`` holds it.

    ``fd``: a descriptor of ``run_dir`` that already holds the lock (handed over
    by a background start, see ``inherited_lock_fd``); it is adopted, not
    locked anew. The descriptor is made close-on-exec, so workers never inherit
    (and never keep) the lock.

    Raises (on enter):
        ConfigError: another process holds the lock (the message names it), or
            ``fd`` is not a descriptor of ``run_dir``.
    """

    def __init__(self, run_dir: Path, fd: int | None = None) -> None:
        self.run_dir = run_dir
        self._given = fd
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        if self._given is not None:
            fd = self._given
            if not _same_file(fd, self.run_dir):
                raise ConfigError(f"{LOCK_FD_ENV}={fd} is not an open descriptor of {self.run_dir}")
            os.set_inheritable(fd, False)
        else:
            fd = os.open(self.run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # On a handed-over descriptor this is a no-op (the same open file
            # already holds it); it fails only if the handover lost the lock.
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
            # Closing releases the flock once no other descriptor of the same open
            # file remains (a start that launched this node may still hold one).
            os.close(self._fd)
            self._fd = None

    @property
    def fd(self) -> int:
        """The locked descriptor (to hand to a child with ``pass_fds``).

        Raises:
            RuntimeError: the lock is not held.
        """
        if self._fd is None:
            raise RuntimeError("RunLock not held")
        return self._fd


def inherited_lock_fd() -> int | None:
    """The locked run-directory descriptor a background start handed to this
    process (``LOCK_FD_ENV``), or None. The variable is removed, so this
    process's own children never see it.

    Raises:
        ConfigError: the variable is not a descriptor number.
    """
    value = os.environ.pop(LOCK_FD_ENV, None)
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(f"{LOCK_FD_ENV}={value!r} is not a descriptor number")
    return int(value)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def is_node_command(cmdline: list[str]) -> bool:
    """Whether ``cmdline`` is an edgenode start: ``python -m node.cli ... start``
    (also as ``node.interpreter.module_command`` writes it)
    or the ``edgenode`` entry point (run directly or by an interpreter) with
    ``start``. A background start (which holds the lock while it launches its
    node) counts: stopping it stops that node."""
    if not cmdline:
        return False
    prog = Path(cmdline[0]).name
    module = module_of_command(cmdline)
    if prog == "edgenode":
        rest = cmdline[1:]
    elif module is not None and module[0] == "node.cli":
        rest = module[1]
    elif prog.startswith("python") and len(cmdline) > 1 and Path(cmdline[1]).name == "edgenode":
        rest = cmdline[2:]
    else:
        return False
    return "start" in rest


def is_node(proc: psutil.Process) -> bool:
    """``is_node_command`` of ``proc``'s command line (False if unreadable)."""
    try:
        return is_node_command(proc.cmdline())
    except psutil.Error:
        return False


def describe(proc: psutil.Process) -> str:
    """``proc``'s command line for a message ("?" if unreadable)."""
    try:
        return " ".join(proc.cmdline()) or "?"
    except psutil.Error:
        return "?"


def in_use_message(run_dir: Path, wait_s: float = HANDOVER_WAIT_S) -> str:
    """Why a node cannot start on ``run_dir``: "edgenode already running (pid N,
    DIR)" naming the node (``serving_holder``, which may wait up to ``wait_s``
    seconds for a background start to launch it), or, for a holder that is not
    an edgenode start, which process it is."""
    holder = serving_holder(run_dir, wait_s)
    if holder is not None and embeds_node(run_dir, holder):
        return (
            f"edgenode already running, embedded in an app (pid {holder.pid}: "
            f"{describe(holder)}, {run_dir}): one node per run directory"
        )
    if holder is not None and not is_node(holder):
        return ForeignHolderError(run_dir, holder.pid, describe(holder)).message
    if holder is None:  # it let go between our attempt and the look: a stop raced us
        return (
            f"{run_dir} was locked by a node that has exited since (stopped meanwhile?): "
            "one node per run directory; start again"
        )
    if is_launcher(holder):
        who = f"pid {holder.pid}, a start still launching its node"
    else:
        who = f"pid {holder.pid}"
    return f"edgenode already running ({who}, {run_dir}): one node per run directory"


def is_launcher(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a background start (``is_node``, without ``--foreground``):
    it holds the lock only until the node it launches takes it over."""
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return False
    return is_node_command(cmdline) and "--foreground" not in cmdline


def serving_holder(run_dir: Path, wait_s: float = HANDOVER_WAIT_S) -> psutil.Process | None:
    """The process to name as ``run_dir``'s node: the lock holder, except that for
    a background start (``is_launcher``) it is the node that start launched, as
    soon as that child holds the lock. Waits at most ``wait_s`` seconds for the
    start to launch it (its config check comes first), then names the start
    itself. None: nobody holds the lock.
    """
    deadline = time.monotonic() + wait_s
    while True:
        holder = lock_holder(run_dir)
        if holder is None or not is_launcher(holder):
            return holder
        node = _launched_node(holder, run_dir)
        if node is not None:
            return node
        if time.monotonic() >= deadline:
            return holder
        time.sleep(0.05)


def _launched_node(launcher: psutil.Process, run_dir: Path) -> psutil.Process | None:
    """The child of ``launcher`` that holds ``run_dir``'s lock (handed over), or None."""
    try:
        st = os.stat(run_dir)
        children = launcher.children()
    except (OSError, psutil.Error):
        return None
    return next((child for child in children if _holds(child.pid, st)), None)


def lock_holder(run_dir: Path) -> psutil.Process | None:
    """The process holding the run directory's lock, or None.

    Read from ``/proc/locks`` without touching the lock. The pid recorded there
    is the one that took the lock; it counts if it still has a descriptor of
    the directory that carries the lock (its ``fdinfo``). Otherwise (a start
    handed the lock to its node and exited) every process's descriptors are
    searched for one that carries it. ``/proc/locks`` prints the superblock's
    device, which differs from ``stat``'s on e.g. btrfs subvolumes, so the
    inode alone only nominates.
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
        holds = _holds(int(pid), st)
        if holds is None and where[0] == dev:
            # Another user's process: its descriptors cannot be read, the
            # device and inode must do.
            with contextlib.suppress(psutil.Error):
                return psutil.Process(int(pid))
        if holds:
            with contextlib.suppress(psutil.Error):
                return psutil.Process(int(pid))
        found = _search_holder(st, skip=int(pid))
        if found is not None:
            return found
    return None


def _holds(pid: int, st: os.stat_result) -> bool | None:
    """Whether ``pid`` has a descriptor of the file ``st`` that carries a flock
    (None: its descriptors cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return None
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            fst = os.stat(f"/proc/{pid}/fd/{fd}")
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                continue
            if _carries_flock(Path(f"/proc/{pid}/fdinfo/{fd}").read_text()):
                return True
    return False


def _search_holder(st: os.stat_result, skip: int) -> psutil.Process | None:
    """The lowest pid other than ``skip`` that ``_holds`` the lock on ``st``."""
    pids = sorted(int(name) for name in os.listdir("/proc") if name.isdigit())
    for pid in pids:
        if pid != skip and _holds(pid, st):
            with contextlib.suppress(psutil.Error):
                return psutil.Process(pid)
    return None


def starts_in_progress() -> list[psutil.Process]:
    """Edgenode starts (``is_node_command``, other than this process) that hold
    no flock yet: between their exec and taking their run directory's lock
    (about a second of imports and config). Their run directory cannot be told
    from outside (it may come from a config file or the environment), so the
    caller waits for all of them (``wait_for_starts``)."""
    return [
        proc
        for proc in psutil.process_iter(["cmdline"])
        if proc.pid != os.getpid()
        and is_node_command(proc.info["cmdline"] or [])
        and not _holds_a_flock(proc.pid)
    ]


def wait_for_starts(timeout_s: float) -> None:
    """Wait until every start in progress (``starts_in_progress``) holds a lock
    or has exited, at most ``timeout_s`` seconds. Then a start that was already
    running when ``edgenode stop`` began shows in ``lock_holder``."""
    deadline = time.monotonic() + timeout_s
    pending = starts_in_progress()
    while pending and time.monotonic() < deadline:
        time.sleep(0.05)
        pending = [p for p in pending if _running(p) and not _holds_a_flock(p.pid)]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _holds_a_flock(pid: int) -> bool:
    """Whether any descriptor of ``pid`` carries an exclusive flock (False if
    its descriptors cannot be read)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if _carries_flock(Path(f"/proc/{pid}/fdinfo/{fd}").read_text()):
                return True
    return False


def _carries_flock(fdinfo: str) -> bool:
    return any(
        line.startswith("lock:") and " FLOCK " in line and " WRITE " in line
        for line in fdinfo.splitlines()
    )


def signal_holder(run_dir: Path, signum: signal.Signals) -> psutil.Process | None:
    """Send ``signum`` to the edgenode process holding the run directory's lock;
    returns it, or None if no process holds the lock (then nothing is signalled).

    The signal goes through a pidfd (pidfd_open(2), Linux 5.3) opened on the
    holder and then checked against the lock again: if the pid changed hands in
    between, nothing is sent to it. If the lock itself moved on (a start handing
    it to its node and exiting), the new holder is taken, up to
    ``HOLDER_CHANGES`` times. Without pidfds, psutil checks the process's start
    time right before signalling.

    Raises:
        ForeignHolderError: the holder is not an edgenode start (``is_node``);
            it is not signalled. ``EmbeddedHolderError`` when it is an app that
            embeds the node (its pidfile says so).
        PermissionError, psutil.AccessDenied: the holder is another user's process.
    """
    for _ in range(HOLDER_CHANGES + 1):
        holder = lock_holder(run_dir)
        if holder is None:
            return None
        if not is_node(holder):
            raise not_a_start(run_dir, holder)
        try:
            pidfd = os.pidfd_open(holder.pid)
        except ProcessLookupError:
            continue
        except OSError:  # no pidfd_open on this kernel
            with contextlib.suppress(psutil.NoSuchProcess):
                holder.send_signal(signum)
                return holder
            continue
        try:
            again = lock_holder(run_dir)
            if again is None or again.pid != holder.pid:
                continue
            signal.pidfd_send_signal(pidfd, signum)
            return holder
        except ProcessLookupError:
            continue
        finally:
            os.close(pidfd)
    return None


def write_pidfile(
    path: Path,
    frontend: str = "",
    server_public_key: bytes | None = None,
    *,
    embedded: bool = False,
) -> None:
    """Record this process (pid and start time) in ``path``, atomically, with the
    node's frontend endpoint as configured (``node.frontend``) and its CURVE server
    public key (Z85, 40 bytes; None: plaintext), so ``edgenode status --run-dir
    DIR`` finds the node without its config (``read_node_record``); ``embedded``:
    the node is embedded in an app (``Node.start``), which ``edgenode stop`` then
    names instead of signalling (``EmbeddedHolderError``)."""
    me = psutil.Process()
    tmp = path.with_name(path.name + ".tmp")
    record = {
        "pid": me.pid,
        "create_time": me.create_time(),
        "embedded": embedded,
        "frontend": frontend,
        "server_public_key": None if server_public_key is None else server_public_key.decode(),
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


@dataclass(frozen=True)
class NodeRecord:
    """What a node recorded in its pidfile (``write_pidfile``): its ``pid``, its
    ``frontend`` endpoint as configured, its CURVE ``server_public_key`` (Z85; None:
    plaintext)."""

    pid: int
    frontend: str
    server_public_key: bytes | None


def read_node_record(run_dir: Path) -> NodeRecord | None:
    """The record of the node of ``run_dir`` if its pidfile names a live process
    (same pid and start time) and has a frontend; None otherwise (no pidfile, a
    stale or older one, unreadable)."""
    try:
        data = json.loads((run_dir / PIDFILE_NAME).read_text())
        pid, created, frontend = int(data["pid"]), float(data["create_time"]), data["frontend"]
        key = data.get("server_public_key")
        if not isinstance(frontend, str) or not frontend or not isinstance(key, (str, type(None))):
            return None
        # psutil rounds create_time; a reused pid has another start time.
        if abs(psutil.Process(pid).create_time() - created) > 0.01:
            return None
    except (OSError, ValueError, KeyError, TypeError, psutil.Error):
        return None
    return NodeRecord(pid, frontend, None if key is None else key.encode())


def remove_pidfile(path: Path) -> None:
    """Remove ``path`` if it names this process (never another node's file)."""
    try:
        pid = int(json.loads(path.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if pid == os.getpid():
        path.unlink(missing_ok=True)
