"""The worker supervisor: spawn, watch, restart with backoff, stop.

Each worker is a fresh interpreter (``python -P -m node.worker``, see
``node.interpreter``) in its own session/process group, never a fork of a
process that already holds zmq or llama.cpp state. The supervisor is driven by
the node's loop: ``tick(now)`` reaps exits and starts due restarts; the broker's
events say when a worker is ready or must be killed (dead, stalled, hung).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import IO, Literal, TypedDict

from broker.exits import ExitCause, Verdict
from node.config import WorkersSection
from node.engine import EngineName
from node.interpreter import module_command
from node.observe.logs import LogFormat, event_extra
from node.worker import DETERMINISTIC_EXITS, EXIT_MESSAGE_MAX_BYTES, WorkerSpec, exit_meaning

log = logging.getLogger("edgenode.supervisor")

#: Clock ticks per second of ``/proc/<pid>/stat``'s CPU times, and bytes per page of its rss.
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


#: A worker process's state, as the supervisor keeps it and ``edgenode status`` shows it
#: ("processes"): ``starting`` (spawned, not READY yet), ``ready``, ``dead``/``stalled``/
#: ``hung`` (the broker's kill verdict, until the killed process is reaped; ``lost`` for
#: any other verdict), ``restarting`` (waiting out its backoff), ``failed`` (not
#: restarted: a deterministic failure) and ``stopped``.
ProcessState = Literal[
    "starting", "ready", "dead", "stalled", "hung", "lost", "restarting", "failed", "stopped"
]


#: A starting worker is killed when it has made no load progress for
#: ``workers.ready_timeout_ms``, or, progress or not, once it has been starting for
#: this many times that timeout (the hard cap: 600 s at the default 60 s). A load
#: starved of CPU (a nice-10 worker on a busy host got 5-7 % of a core) still
#: finishes; a hung one (stopped, deadlocked, asleep) is still killed.
READY_CAP_FACTOR = 10


#: The least a load must do to count as progress since its last progress (the
#: mark): CPU time at this share of one core over the time since the mark (1 %:
#: a nice-10 worker starved to 5-7 % of a core passes; a worker that has loaded
#: and only wakes for heartbeats, ~0.02 %, does not), or this much more resident
#: memory (bytes: model pages faulted in during an I/O-bound load).
LOAD_MIN_CPU_SHARE = 0.01
LOAD_MIN_RSS_BYTES = 1 << 20


@dataclass(frozen=True)
class LoadProgress:
    """What a loading worker's process has done so far (``/proc/<pid>/stat``).

    ``cpu_ticks``: user + system CPU time of all its threads, in clock ticks
    (``CLOCK_TICKS`` a second); ``rss_pages``: its resident set in pages of
    ``PAGE_BYTES`` (file-backed model pages it has faulted in count).
    """

    cpu_ticks: int
    rss_pages: int

    def progressed(self, mark: LoadProgress, elapsed_s: float) -> bool:
        """Whether this reading shows progress over ``mark``, taken ``elapsed_s``
        before: CPU time at ``LOAD_MIN_CPU_SHARE`` of a core (at least one tick),
        or ``LOAD_MIN_RSS_BYTES`` more resident memory."""
        cpu_needed = max(1.0, LOAD_MIN_CPU_SHARE * elapsed_s * CLOCK_TICKS)
        rss_needed = LOAD_MIN_RSS_BYTES / PAGE_BYTES
        return (
            self.cpu_ticks - mark.cpu_ticks >= cpu_needed
            or self.rss_pages - mark.rss_pages >= rss_needed
        )


def load_progress(pid: int) -> LoadProgress | None:
    """``pid``'s CPU time and resident set from ``/proc/<pid>/stat`` (proc(5): fields
    14 utime, 15 stime, 24 rss), or None if it is gone or unreadable. A stopped
    process (state ``T``, e.g. SIGSTOP) reads as it is, and so shows no progress."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        return LoadProgress(cpu_ticks=int(fields[11]) + int(fields[12]), rss_pages=int(fields[21]))
    except (IndexError, ValueError):
        return None


class LoadingStatus(TypedDict):
    """A starting worker's load so far, in ``ProcessStatus.loading``."""

    #: CPU time its process has used (s).
    cpu_s: float
    #: Its resident set (bytes).
    rss_bytes: int
    #: Since its load last made progress (ms, ``LoadProgress.progressed``); it is
    #: killed past workers.ready_timeout_ms.
    idle_ms: int
    #: Since it was spawned (ms).
    loading_ms: int
    #: The hard cap on its load (ms since its spawn, ``READY_CAP_FACTOR`` x
    #: workers.ready_timeout_ms): it is killed there, progress or not.
    cap_ms: int


class ProcessStatus(TypedDict):
    """One worker's row of ``Supervisor.status`` (``node.pool`` adds its sandbox's).
    ``loading``: a ``starting`` worker's progress, else None."""

    worker_id: str
    pid: int | None
    state: ProcessState
    restarts: int
    last_exit: str
    loading: LoadingStatus | None


def killed_state(verdict: Verdict | None) -> ProcessState:
    """The state of a worker killed on ``verdict`` until it is reaped: the kill
    verdicts (``broker.exits.KILL_VERDICTS``) by name, any other ``lost``."""
    match verdict:
        case "dead" | "stalled" | "hung":
            return verdict
        case _:
            return "lost"


@dataclass
class WorkerHandle:
    """One logical worker slot and its current process, if any (``state``: ``ProcessState``)."""

    spec: WorkerSpec
    proc: subprocess.Popen[bytes] | None = None
    state: ProcessState = "stopped"
    started_at: float = 0.0
    restarts: int = 0
    failures_in_row: int = 0
    #: When the current process first registered (monotonic s; None: not yet).
    ready_at: float | None = None
    restart_at: float | None = None
    last_exit: str = ""
    #: Why the node killed the current process (broker verdict, READY timeout);
    #: its verdict goes with the exit once reaped, cleared at the next spawn.
    kill_cause: ExitCause | None = None
    #: The current process's load at its last progress (None: not read yet), and
    #: when that was (monotonic s): the READY timeout counts from there.
    progress: LoadProgress | None = None
    progress_at: float = 0.0
    log_file: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        """The live process id, or None."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


class Supervisor:
    """Keeps ``len(specs)`` worker processes running.

    Args:
        specs: one spec per worker.
        log_dir: each worker's stderr goes to ``<log_dir>/<worker_id>.log``.
        ready_timeout_s: a starting worker whose load made no progress (CPU time,
            resident set: ``load_progress``) for this long is killed and
            restarted; so is one still not READY after ``READY_CAP_FACTOR`` times it.
        backoff_s / backoff_max_s: restart delay, doubled per consecutive failure.
        on_exit: told ``(worker_id, cause)`` when a process exits, so the broker
            fails over its requests without waiting for missed heartbeats.
        prepare: called before every spawn (restarts included) with the worker's
            spec; returns the spec to spawn with (e.g. with a fresh cgroup).
        explain: ``(worker_id, cause) -> cause``: a fuller cause than the exit
            alone (e.g. the cgroup saw an OOM kill).
        clock: monotonic seconds.
        log_level, log_format: the workers' (``node.log_level``, ``logging.format``).
        log_max_bytes: a worker's log over this many bytes is rotated when the
            worker (re)spawns (``open_worker_log``; 0 = never).
    """

    def __init__(
        self,
        specs: list[WorkerSpec],
        log_dir: Path,
        ready_timeout_s: float,
        backoff_s: float,
        backoff_max_s: float,
        on_exit: Callable[[str, ExitCause], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        log_level: str = "info",
        log_format: LogFormat = "text",
        prepare: Callable[[WorkerSpec], WorkerSpec] | None = None,
        explain: Callable[[str, ExitCause], ExitCause] | None = None,
        log_max_bytes: int = WorkersSection.log_max_bytes,
    ) -> None:
        self.handles = {s.worker_id: WorkerHandle(s) for s in specs}
        self.log_dir = log_dir
        self.ready_timeout_s = ready_timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.on_exit = on_exit
        self.clock = clock
        self.log_level = log_level
        self.log_format = log_format
        self.prepare = prepare
        self.explain = explain
        self.log_max_bytes = log_max_bytes
        self.stopping = False

    def start(self) -> None:
        """Spawn every worker."""
        for handle in self.handles.values():
            self._spawn(handle)

    def _spawn(self, handle: WorkerHandle) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if handle.log_file is not None:
            # The previous process is reaped: nobody writes to the old file any more.
            handle.log_file.close()
        handle.log_file = open_worker_log(
            self.log_dir / f"{handle.spec.worker_id}.log", self.log_max_bytes
        )
        spec = self.prepare(handle.spec) if self.prepare is not None else handle.spec
        exit_message = self._exit_message_path(handle)
        exit_message.unlink(missing_ok=True)  # a previous process's reason is not this one's
        cmd = module_command(
            "node.worker",
            "--spec",
            spec.to_json(),
            "--log-level",
            self.log_level,
            "--log-format",
            self.log_format,
            "--exit-message-file",
            str(exit_message),
        )
        handle.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=handle.log_file,
            stderr=handle.log_file,
            start_new_session=True,  # own process group: one killpg takes all of it
            close_fds=True,
        )
        handle.state = "starting"
        handle.kill_cause = None
        handle.started_at = self.clock()
        handle.ready_at = None
        handle.progress = None
        handle.progress_at = handle.started_at
        handle.restart_at = None
        log.info("spawned %s pid %d", handle.spec.worker_id, handle.proc.pid)

    # ------------------------------------------------------------------ events

    def worker_ready(self, worker_id: str, pid: int | None) -> None:
        """The broker (or, for a host agent, its note) registered this worker: it is
        serving. Once it has stayed up ``backoff_max_s`` since its first registration
        (a good run, ``_good_run``), its next restart starts from the first delay
        again. Not at once: a worker killed right after READY each time (every
        heartbeat missed at 1 x 1 ms, a crash at its first decode) was restarted
        every 0.5 s for minutes."""
        handle = self.handles.get(worker_id)
        if handle is None or handle.pid is None or (pid is not None and pid != handle.pid):
            return
        handle.state = "ready"
        if handle.ready_at is None:
            handle.ready_at = self.clock()

    def _good_run(self, handle: WorkerHandle, now: float) -> None:
        """If ``handle``'s process has been registered ``backoff_max_s`` by ``now``,
        its failures in a row are forgotten (the next restart waits the first delay)."""
        if (
            handle.failures_in_row
            and handle.ready_at is not None
            and now - handle.ready_at >= self.backoff_max_s
        ):
            log.info(
                "%s up for %.0f s since it registered: next restart without delay",
                handle.spec.worker_id,
                now - handle.ready_at,
            )
            handle.failures_in_row = 0

    def worker_lost(self, worker_id: str, pid: int | None, cause: ExitCause) -> None:
        """The broker gave up on this worker (``cause``: its verdict, dead, stalled or
        hung): kill it; tick restarts."""
        handle = self.handles.get(worker_id)
        if handle is None or handle.pid is None or (pid is not None and pid != handle.pid):
            return
        handle.last_exit = cause.describe()
        log.warning(
            "killing %s pid %d: %s",
            worker_id,
            handle.pid,
            handle.last_exit,
            extra=verdict_event(worker_id, handle.pid, cause),
        )
        handle.kill_cause = cause
        handle.state = killed_state(cause.verdict)
        _killpg(handle.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> None:
        """Reap exited workers, enforce the READY timeout, start due restarts."""
        for handle in self.handles.values():
            self._good_run(handle, now)
            proc = handle.proc
            if proc is not None and proc.poll() is not None:
                self._reaped(handle, proc.returncode, now)
            elif handle.state == "starting" and proc is not None:
                self._check_load(handle, proc.pid, now)
            if (
                handle.state == "restarting"
                and handle.restart_at is not None
                and now >= handle.restart_at
                and not self.stopping
            ):
                handle.restarts += 1
                self._spawn(handle)

    @property
    def ready_cap_s(self) -> float:
        """The hard cap on a worker's load (s): ``READY_CAP_FACTOR`` x the READY timeout."""
        return READY_CAP_FACTOR * self.ready_timeout_s

    def _check_load(self, handle: WorkerHandle, pid: int, now: float) -> None:
        """Note a starting worker's load progress; kill it if it made none for the
        READY timeout, or if it reached the hard cap (``READY_CAP_FACTOR``)."""
        reading = load_progress(pid)
        if reading is not None and (
            handle.progress is None or reading.progressed(handle.progress, now - handle.progress_at)
        ):
            handle.progress = reading
            handle.progress_at = now
        if now - handle.progress_at > self.ready_timeout_s:
            # "not READY within 60s: ...": the timeout first, as before progress counted.
            detail = (
                f"{self.ready_timeout_s:g}s: its load made no progress (CPU time, memory)"
                f" for {self.ready_timeout_s:g}s, {now - handle.started_at:.0f}s after its spawn"
            )
        elif now - handle.started_at > self.ready_cap_s:
            detail = (
                f"{self.ready_cap_s:g}s ({READY_CAP_FACTOR} x workers.ready_timeout_ms,"
                " the cap on a load that progresses)"
            )
        else:
            return
        if handle.kill_cause is None:  # killed again each tick until reaped: logged once
            cause = ExitCause("not_ready", detail=detail)
            handle.kill_cause = cause
            handle.last_exit = cause.describe()
            log.warning(
                "killing %s pid %d: %s",
                handle.spec.worker_id,
                pid,
                handle.last_exit,
                extra=verdict_event(handle.spec.worker_id, pid, cause),
            )
        _killpg(pid, signal.SIGKILL)

    def _loading(self, handle: WorkerHandle, now: float) -> LoadingStatus | None:
        """A starting worker's ``LoadingStatus``, else None."""
        pid = handle.pid
        if handle.state != "starting" or pid is None:
            return None
        seen = load_progress(pid) or handle.progress or LoadProgress(0, 0)
        return LoadingStatus(
            cpu_s=round(seen.cpu_ticks / CLOCK_TICKS, 2),
            rss_bytes=seen.rss_pages * PAGE_BYTES,
            idle_ms=round((now - handle.progress_at) * 1000),
            loading_ms=round((now - handle.started_at) * 1000),
            cap_ms=round(self.ready_cap_s * 1000),
        )

    def _exit_message_path(self, handle: WorkerHandle) -> Path:
        return self.log_dir / f"{handle.spec.worker_id}.exit"

    def _exit_message(self, handle: WorkerHandle) -> str:
        """The one line the worker left on a deterministic exit, or ""."""
        try:
            with open(self._exit_message_path(handle), "rb") as fh:
                raw = fh.read(EXIT_MESSAGE_MAX_BYTES)
        except OSError:
            return ""
        lines = raw.decode(errors="replace").splitlines()
        return lines[0].strip() if lines else ""

    def _reaped(self, handle: WorkerHandle, code: int, now: float) -> None:
        pid = handle.proc.pid if handle.proc is not None else None
        handle.proc = None
        self._good_run(handle, now)  # a run that ended between two ticks
        handle.ready_at = None  # its run is over: none to count while it waits
        message = self._exit_message(handle) if code in DETERMINISTIC_EXITS else ""
        cause = exit_cause(code, handle.spec.engine.kind, message)
        if self.explain is not None:
            cause = self.explain(handle.spec.worker_id, cause)
        kill = handle.kill_cause
        if kill is not None and cause.signal is not None:  # killed for it, not on its own
            cause = replace(cause, verdict=kill.verdict, detail=kill.detail, at_limit=kill.at_limit)
        handle.last_exit = cause.describe()
        fields = {
            "worker": handle.spec.worker_id,
            "worker_pid": pid,
            "signal": cause.signal,
            "code": cause.code,
            "verdict": cause.verdict,
            "oom_killed": cause.oom_killed,
            "reason": handle.last_exit,
        }
        log.log(
            exit_level(cause, self.stopping),
            "%s exited: %s",
            handle.spec.worker_id,
            handle.last_exit,
            extra=event_extra("worker_exit", fields),
        )
        if self.on_exit is not None:
            self.on_exit(handle.spec.worker_id, cause)
        if self.stopping:
            handle.state = "stopped"
        elif cause.deterministic:
            handle.state = "failed"  # a new process would fail the same way
        else:
            handle.failures_in_row += 1
            delay = min(self.backoff_max_s, self.backoff_s * 2 ** (handle.failures_in_row - 1))
            handle.state = "restarting"
            handle.restart_at = now + delay

    # ------------------------------------------------------------------ stop

    def stop(self, grace_s: float) -> None:
        """SIGTERM every worker, wait up to ``grace_s``, then SIGKILL their groups
        (the blocking form of ``terminate_all`` + ``kill_groups``)."""
        self.terminate_all()
        deadline = time.monotonic() + grace_s
        for handle in self.handles.values():
            if handle.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    handle.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for handle in self.handles.values():
            if handle.proc is not None:
                _killpg(handle.proc.pid, signal.SIGKILL)  # past its grace, or stragglers
                handle.proc.wait()
            handle.proc = None
            handle.state = "stopped" if handle.state != "failed" else "failed"
            if handle.log_file is not None:
                handle.log_file.close()
                handle.log_file = None

    def status(self) -> list[ProcessStatus]:
        """Per worker: id, pid, state, restarts, last exit reason, load progress."""
        now = self.clock()
        return [
            ProcessStatus(
                worker_id=h.spec.worker_id,
                pid=h.pid,
                state=h.state,
                restarts=h.restarts,
                last_exit=h.last_exit,
                loading=self._loading(h, now),
            )
            for h in self.handles.values()
        ]

    def all_ready(self) -> bool:
        """Whether every worker is ready (what ``edgenode start`` waits for)."""
        return all(h.state == "ready" for h in self.handles.values())

    # ------------------------------------------------------------------ non-blocking stop

    def terminate_all(self) -> list[int]:
        """SIGTERM every live worker's process group and return at once.

        The non-blocking counterpart of ``stop``: the node keeps its loop turning
        (answering clients) while ``tick`` reaps the exits; ``unreaped`` says when
        all are gone, ``kill_groups`` ends what the grace did not. Nothing is
        restarted any more. Returns the process group ids signalled.
        """
        self.stopping = True
        groups = [h.pid for h in self.handles.values() if h.pid is not None]
        for pgid in groups:
            _killpg(pgid, signal.SIGTERM)
        return groups

    def processes(self) -> set[int]:
        """Pids of the worker processes not reaped yet (running, or exited and
        waiting for ``tick``): the node watches them for exits."""
        return {h.proc.pid for h in self.handles.values() if h.proc is not None}

    def unreaped(self) -> int:
        """How many worker processes ``tick`` has not reaped yet (running or exited)."""
        return sum(h.proc is not None for h in self.handles.values())

    def kill_groups(self, groups: list[int]) -> None:
        """SIGKILL these process groups (from ``terminate_all``): a worker past
        its grace, and any straggler left in the group of one that exited."""
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)


def exit_level(cause: ExitCause, stopping: bool) -> int:
    """The level of a ``worker_exit`` line: INFO for a clean exit during a stop the
    node asked for (exit 0, or the SIGTERM it sent), ERROR for a deterministic
    exit (``cause.deterministic``: the model or config cannot load, so the worker
    stays ``failed`` until someone fixes it), WARNING for any other exit (a crash,
    a kill, an exit nobody asked for: it is restarted)."""
    if cause.deterministic:
        return logging.ERROR
    clean = cause.code == 0 or (cause.signal == "SIGTERM" and not cause.oom_killed)
    if stopping and cause.verdict is None and clean:
        return logging.INFO
    return logging.WARNING


def verdict_event(worker_id: str, pid: int, cause: ExitCause) -> dict[str, object]:
    """``extra=`` of the line saying the node kills a worker on ``cause``'s verdict."""
    fields = {
        "worker": worker_id,
        "worker_pid": pid,
        "verdict": cause.verdict,
        "at_limit": bool(cause.at_limit),  # the words are in reason
        "reason": cause.describe(),
    }
    return event_extra("worker_verdict", fields)


#: Rotated worker logs kept: ``<worker_id>.log.1`` (newest) and ``.log.2``.
WORKER_LOG_BACKUPS = 2


def open_worker_log(path: Path, max_bytes: int) -> IO[bytes]:
    """Open a worker's log for appending, rotating it first if it is over ``max_bytes``.

    Called at every spawn, when the previous process is gone: a running child
    writes through its own file descriptor, which follows a renamed file, so
    rotating under it would not give it a fresh log.
    Rotation is the standard library's: ``path`` becomes ``path.1``, ``path.1``
    becomes ``path.2``, and the oldest beyond ``WORKER_LOG_BACKUPS`` is deleted.

    Args:
        path: the log file; created if missing.
        max_bytes: size in bytes above which it is rotated; 0 = never.

    Raises:
        OSError: the log cannot be renamed or opened.
    """
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    if 0 < max_bytes < size:
        rotator = RotatingFileHandler(
            path, maxBytes=max_bytes, backupCount=WORKER_LOG_BACKUPS, encoding="utf-8", delay=True
        )
        try:
            rotator.doRollover()  # with delay=True it renames only, opens nothing
        finally:
            rotator.close()
        log.info("rotated %s (%d bytes)", path, size)
    return open(path, "ab")  # the caller closes it (at the next spawn or at stop)


def exit_cause(code: int, kind: EngineName = "llama", message: str = "") -> ExitCause:
    """The cause of a ``Popen.returncode`` (negative = killed by a signal).

    Args:
        code: the return code.
        kind: the worker's engine: a rule worker's exit 66 means "rules failed to
            load", a model worker's "model failed to load".
        message: the worker's own one-line reason (``--exit-message-file``), kept
            for a deterministic exit.
    """
    if code < 0:
        try:
            return ExitCause(signal=signal.Signals(-code).name)
        except ValueError:
            return ExitCause(signal=f"signal {-code}")
    meaning = exit_meaning(code, kind) or ""
    return ExitCause(
        code=code, deterministic=code in DETERMINISTIC_EXITS, meaning=meaning, message=message
    )


def _killpg(pid: int | None, sig: int) -> None:
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
