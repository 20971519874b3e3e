"""Low-level cgroupfs access shared by the cgroup drivers: the host's files and syscalls,
interface-file reads and writes with the errno explained, and killing, reaping
and moving processes between cgroups.

Every failure becomes a ``SandboxError`` whose message says which file and,
for the usual errnos, what normally causes it (``_HINTS``). Nothing here keeps
state: the ``Host`` says where the kernel's files are and which syscalls to use
(fakes in tests).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from broker.errors import SandboxError

log = logging.getLogger("edgenode.sandbox")

#: What v1 reads back for "no limit" with 4 KiB pages: LONG_MAX rounded down to a
#: page (cgroup-v1/memory.rst). Other page sizes round differently, so every
#: value from 2**62 up counts as unlimited.
V1_UNLIMITED = 9223372036854771712
_UNLIMITED_FLOOR = 1 << 62
#: The node's own leaf in its cgroup; a live process in it marks the tree as owned.
NODE_LEAF = "node"
#: How long removal waits for killed processes to leave a cgroup (s).
KILL_WAIT_S = 2.0


def _os_write(path: Path, value: str) -> None:
    """Write one value to an interface file (O_TRUNC so a fake tree holds just it)."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Host:
    """Where the kernel's files are and the syscalls that change things (fakes in tests).

    ``root`` is prepended to the mount points found in mountinfo, so a test can
    keep a whole fake /sys/fs/cgroup under ``tmp_path``; ``write`` writes one
    value to an interface file (a fake kernel gives ``cgroup.procs`` and
    ``cgroup.subtree_control`` their semantics there).
    """

    root: Path = Path("/")
    proc: Path = Path("/proc")
    pid: int = field(default_factory=os.getpid)
    mkdir: Callable[[Path], None] = os.mkdir
    rmdir: Callable[[Path], None] = os.rmdir
    kill: Callable[[int, int], None] = os.kill
    write: Callable[[Path, str], None] = _os_write


# ---------------------------------------------------------------- reading


def read_optional(path: Path) -> str | None:
    """An interface file's stripped text; None if the kernel lacks the file."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SandboxError(f"cannot read {path}: {exc.strerror}") from exc


def read_value(path: Path) -> str:
    """An interface file's stripped text; a missing file is an error."""
    text = read_optional(path)
    if text is None:
        raise SandboxError(f"cannot read {path}: {os.strerror(errno.ENOENT)}")
    return text


def read_int(path: Path) -> int | None:
    """A counter file's value; None if absent (older kernels, no swap accounting)."""
    text = read_optional(path)
    return int(text) if text else None


def parse_limit(text: str | None) -> int | None:
    """A limit file's value in bytes; None for v2 "max" and v1's huge "unlimited"."""
    if text is None or text == "max":
        return None
    value = int(text)
    return None if value >= _UNLIMITED_FLOOR or value < 0 else value


def parse_keyed(text: str | None) -> dict[str, int]:
    """Flat keyed files: ``memory.events``, ``memory.oom_control`` ("key value" lines)."""
    pairs = (line.split() for line in (text or "").splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].lstrip("-").isdigit()}


def pids_in(directory: Path) -> set[int]:
    """The pids in one cgroup (not below it)."""
    text = read_optional(directory / "cgroup.procs")
    return {int(p) for p in text.split()} if text else set()


def _tree(directory: Path) -> list[Path]:
    """``directory`` and every cgroup below it, leaves first (the order rmdir needs)."""
    if not directory.is_dir():
        return []
    out: list[Path] = []
    for sub in sorted(p for p in directory.iterdir() if p.is_dir()):
        out.extend(_tree(sub))
    out.append(directory)
    return out


def children(directory: Path, *, skip: str = "") -> list[Path]:
    """The cgroups directly below ``directory``, sorted, without the one named ``skip``."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name != skip)


# ---------------------------------------------------------------- changing


_DELEGATE = "run as root, or delegate a subtree (scripts/setup-cgroup.sh, workers.cgroup_root)"
_HINTS = {
    errno.EACCES: _DELEGATE,
    errno.EPERM: _DELEGATE,
    errno.EBUSY: "a limit below current usage, or processes where controllers must be enabled",
    errno.ENOSPC: "a v1 cpuset without cpus/mems",
    errno.ENOENT: "is the controller enabled for this cgroup?",
}


def _why(exc: OSError) -> str:
    """strerror plus what usually causes it here."""
    text = exc.strerror or str(exc)
    hint = _HINTS.get(exc.errno or 0)
    return f"{text} ({hint})" if hint else text


def put(host: Host, path: Path, value: str) -> None:
    """``host.write`` with the errno explained."""
    try:
        host.write(path, value)
    except OSError as exc:
        raise SandboxError(f"cannot write {value!r} to {path}: {_why(exc)}") from exc


def write_if_present(host: Host, path: Path, value: str) -> bool:
    """Write a file the kernel may lack (swap accounting, newer kernels); False if absent."""
    if not path.exists():
        return False
    put(host, path, value)
    return True


def _change(call: Callable[[Path], None], path: Path, done: type[OSError], what: str) -> None:
    """mkdir/rmdir one cgroup; ``done`` (the errno saying it already is so) is fine."""
    try:
        call(path)
    except done:
        pass
    except OSError as exc:
        raise SandboxError(f"cannot {what} cgroup {path}: {_why(exc)}") from exc


def make_cgroup(host: Host, path: Path) -> None:
    """mkdir one cgroup; an existing one is reused."""
    _change(host.mkdir, path, FileExistsError, "create")


def remove_tree(host: Host, directory: Path) -> None:
    """rmdir ``directory`` and its sub-cgroups, leaves first (they must be empty)."""
    for sub in _tree(directory):
        _change(host.rmdir, sub, FileNotFoundError, "remove")


def empty_cgroups(host: Host, dirs: Sequence[Path]) -> set[int]:
    """SIGKILL everything in ``dirs`` and below, wait until they are empty; returns the pids.

    v2 ``cgroup.kill`` (kernel >= 5.14) kills the subtree at once, even while it
    forks; elsewhere each pid gets SIGKILL, repeated until none is left.
    """
    deadline = time.monotonic() + KILL_WAIT_S
    killed: set[int] = set()
    while True:
        # Never the node itself: if it is still here, the rmdir that follows says so.
        pids = {pid for d in dirs for sub in _tree(d) for pid in pids_in(sub)} - {host.pid}
        if not pids:
            return killed
        if time.monotonic() > deadline:
            raise SandboxError(f"{dirs[0]} still holds pids {sorted(pids)} after SIGKILL")
        if not any(write_if_present(host, d / "cgroup.kill", "1") for d in dirs):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    host.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.01)


def destroy(host: Host, dirs: Sequence[Path]) -> set[int]:
    """Kill what is in ``dirs`` (one cgroup's directory per hierarchy), then remove them;
    returns the pids killed."""
    killed = empty_cgroups(host, dirs)
    for d in dirs:
        remove_tree(host, d)
    return killed


def attempt(errors: list[str], step: Callable[[], object]) -> None:
    """Run one clean-up step; record its failure and go on with the next."""
    try:
        step()
    except SandboxError as exc:
        errors.append(exc.message)


def raise_if(errors: list[str]) -> None:
    """Raise the failures ``attempt`` recorded, all in one message."""
    if errors:
        raise SandboxError("; ".join(errors))


# ---------------------------------------------------------------- the node's processes


def _alive(host: Host, pid: int) -> bool:
    return (host.proc / str(pid)).exists()


def _cmdline(host: Host, pid: int) -> str:
    with contextlib.suppress(OSError):
        return (host.proc / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    return "?"


def reap_stale(host: Host, bases: Sequence[Path]) -> list[str]:
    """Clear what an earlier run under the same name left in ``bases`` (one per hierarchy).

    Safe because of the ownership mark: a live process in a ``node`` leaf means
    that run is still going, and nothing is killed; otherwise whatever remains
    in its worker cgroups is an orphan of a dead node (workers die with their
    node through PR_SET_PDEATHSIG, so normally nothing is left to kill).
    """
    owners = sorted(
        pid
        for base in bases
        for pid in pids_in(base / NODE_LEAF)
        if pid != host.pid and _alive(host, pid)
    )
    if owners:
        raise SandboxError(
            f"{bases[0]} belongs to a running process (pid {owners[0]}: "
            f"{_cmdline(host, owners[0])}); is another edgenode using the same cgroup? "
            "Stop it, or give this node its own run directory or workers.cgroup_root"
        )
    reaped: list[str] = []
    for base in bases:
        for child in children(base, skip=NODE_LEAF):
            killed = destroy(host, [child])
            reaped.append(f"{child} (killed {sorted(killed)})" if killed else str(child))
    for line in reaped:
        log.warning("reaped stale cgroup %s", line)
    return reaped


def move_node(host: Host, dirs: Sequence[Path]) -> None:
    """Move the node process into ``dirs`` (one per hierarchy)."""
    for d in dirs:
        put(host, d / "cgroup.procs", str(host.pid))


def go_home(host: Host, original: Path, parent: Path) -> None:
    """Move the node out of its leaf: back where it came from or, when a
    non-root user may not write there (a delegated ``cgroup_root``), into the
    delegated parent, which it may write."""
    try:
        move_node(host, [original])
    except SandboxError:
        if parent == original:
            raise
        move_node(host, [parent])


def join(host: Host, procs_files: Sequence[str], pid: int) -> None:
    """Write ``pid`` to each ``cgroup.procs`` and check that it is listed there."""
    for path in map(Path, procs_files):
        put(host, path, str(pid))
        if pid not in pids_in(path.parent):
            raise SandboxError(f"wrote pid {pid} to {path} but it is not listed there")
