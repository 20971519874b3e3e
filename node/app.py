"""Composition root: wires the broker, the worker pool, the rules and the logs.

This is the only place where ``broker`` and the process side meet: the broker
reports worker events through callbacks, the pool reports exits back, and
neither imports the other. Signals and ``edgenode stop`` take the same path:
SIGTERM -> drain -> answer the rest -> stop workers (still answering clients)
-> close the sockets -> remove cgroups and run files.

Two ways to run a ``Node``: ``run()`` is the CLI's (``edgenode start``): it owns
the process, so it installs SIGTERM/SIGINT/SIGCHLD handlers and a wakeup fd and
blocks until a signal. ``with Node(config) as node:`` (``start``/``stop``, also
``async with``) embeds the node in an app: the same serving code on a thread of
its own, stopped through a socketpair that wakes the loop, worker exits noticed
through pidfds; it installs no signal handler (README "Embedding a node in your app").
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import zmq

from broker.breaker import BreakerState, Transition
from broker.core import Broker
from broker.delivery import ReplyKind
from broker.errors import ConfigError, EdgeNodeError, SandboxError
from broker.kinds import PRESSURE_LEVELS
from broker.loop import BrokerLoop
from broker.outbox import Consumed, Effects
from broker.token_count import TokenCounter
from node.capacity.budget import tightest_limit
from node.capacity.plan import check_fits
from node.capacity.worker_limits import describe, memory_max_bytes
from node.config import BACKEND_SOCKET, FRONTEND_SOCKET, NodeConfig
from node.endpoints import check_free, connect_endpoint
from node.engine import BackgroundCounter, EngineSpec, make_token_counter
from node.migration.log import MigrationLog, migration_log_path
from node.model import RULES_SNAPSHOT, resolve_model, resolve_rules, snapshot_rules
from node.observe.listen import parse_listen
from node.observe.logs import about_request, event_extra
from node.pidfile import (
    PIDFILE_NAME,
    RunLock,
    inherited_lock_fd,
    make_run_dir,
    remove_empty_dir,
    remove_pidfile,
    write_pidfile,
)
from node.pool import WorkerPool
from node.pressure import CpuPressureMonitor, PressureMonitor, cpu_psi_file
from node.sandbox.cgroupfs import Host
from node.sandbox.cores import restore_affinities, thread_affinities
from node.sandbox.layout import Layout, read_layout
from node.security.keys import also_allow, curve_servers, local_key_file, local_keypair
from node.service.notify import Notifier
from node.service.reporter import ServiceReporter
from node.units import parse_size

if TYPE_CHECKING:  # prometheus_client loads only when metrics are on (_metrics)
    from node.observe.server import MetricsServer

log = logging.getLogger("edgenode.node")


def raise_open_files_limit() -> None:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit (the workers
    inherit it) and log both. Each client connection costs the broker a
    descriptor, and libzmq's ipc:// listener aborts the whole process when
    ``accept`` gets EMFILE; the soft limit is often 1024 while the hard one is far
    higher. A refusal (a hard limit above the kernel's nr_open) is logged and the
    node keeps the soft limit it has."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.info("open files limit: %d (soft = hard)", soft)
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning(
            "open files limit: soft %d, hard %d; cannot raise the soft one: %s", soft, hard, exc
        )
        return
    log.info("open files limit: soft %d raised to the hard limit %d", soft, hard)


#: Loop turn cap while workers stop (s): how soon an exit is noticed if no
#: SIGCHLD wakes the loop.
STOP_POLL_S = 0.05
#: How long SIGKILLed workers may take to be reaped before the blocking
#: ``WorkerPool.stop`` takes over (s); a SIGKILL normally ends them in ms.
KILL_REAP_S = 1.0
#: How long replies already queued for clients may still be delivered when the
#: frontend closes (ms); bounded, so a client that stopped reading cannot hold
#: up the stop.
CLOSE_LINGER_MS = 500
#: How long ``Node.start`` (so ``with Node(config)``) waits for every worker to be
#: READY (s): the default of ``edgenode start --wait-s``, room for a model load.
START_WAIT_S = 180.0
#: Loop turn cap of an embedded node on a kernel without pidfds (s): how soon a
#: worker's exit is noticed when nothing wakes the loop for it.
EXIT_POLL_S = 0.05


#: The environment variable through which a background ``edgenode start`` hands its
#: node the write end of a pipe: the node writes one line to it and closes it once
#: every worker is READY (or one failed for good), so the start wakes at once
#: instead of at its next ``status`` poll (s6's readiness notification, in effect).
READY_FD_ENV = "EDGENODE_READY_FD"


def inherited_ready_fd() -> int | None:
    """The pipe a background start handed to this process (``READY_FD_ENV``), or None
    (not set, or not an open pipe). The variable is removed, so the workers never
    see it; the descriptor is made non-inheritable."""
    value = os.environ.pop(READY_FD_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
    except OSError:
        return None
    os.set_inheritable(fd, False)
    return fd


#: The node serving in this process, if any (``_claim_process``): one per process.
_serving: Node | None = None
_serving_lock = threading.Lock()


def _claim_process(node: Node) -> None:
    """Make ``node`` this process's node, or refuse: a node moves its whole
    process into its own ``node`` leaf cgroup (and may pin its threads), so a
    second node in the same process would make its cgroups inside the first's,
    and the first's stop would kill the second's workers and remove its cgroups.

    Raises:
        ConfigError: another node of this process still serves (or is stopping).
    """
    global _serving
    with _serving_lock:
        other = _serving
        if other is not None and other is not node and other.run_dir == node.run_dir:
            raise ConfigError(
                f"one edgenode node per process: the node of {node.run_dir} already runs "
                f"in this process (pid {os.getpid()})"
            )
        if other is not None and other is not node:
            raise ConfigError(
                f"one edgenode node per process: the node of {other.run_dir} still runs in "
                f"this process (pid {os.getpid()}); stop it before starting the node of "
                f"{node.run_dir}, or run that one in a process of its own"
            )
        _serving = node


def _release_process(node: Node) -> None:
    """``node`` no longer serves (its loop ended and cleaned up): another may start."""
    global _serving
    with _serving_lock:
        if _serving is node:
            _serving = None


class NodeStartError(EdgeNodeError):
    """An embedded node did not come up: a worker failed for good (its exit says
    why), or not every worker was READY within the wait. The node is stopped
    (workers, cgroups, run files removed) before this is raised."""


class Node:
    """A running edgenode: broker loop in this process, workers as children.

    ``run()`` serves in the calling thread until SIGTERM/SIGINT (the CLI's node).
    ``start()``/``stop()``, or ``with Node(config) as node:`` / ``async with``,
    serve on a thread of its own, for an app that embeds the node:

    - ``start`` returns once every worker is READY (what ``edgenode start``
      waits for), bounded by ``start_wait_s``; ``frontend`` is then the endpoint
      to connect a ``broker.client.Client`` to.
    - ``stop`` drains as SIGTERM does, joins the thread and re-raises an error
      that ended the loop thread; a second call does nothing.
    - No signal handler, wakeup fd or SIGCHLD handler is installed: the app's
      stay as they were. ``edgenode stop`` on the run directory names the app
      and signals nothing (``node.pidfile.EmbeddedHolderError``): the app stops its node.
    - One node per process (``start`` and ``run`` refuse a second while one
      still runs): each moves the whole process into its own cgroup.
    - Cgroups: the node's sandbox moves the whole process (the app with it) into
      the node's ``node`` leaf, as for the CLI's node (cgroup v2 allows no process
      in a cgroup that enables controllers), and ``stop`` moves it back to the
      cgroup it came from and removes the node's tree. The default core
      reservation (``workers.cpus = "auto"``) confines the workers only; with
      ``node.cpus``, or cores listed in ``workers.cpus``, the app's threads run on
      the node's cores until ``stop`` gives them back the cores they had.

    Raises (from ``run``, ``start`` and so ``__enter__``):
        ConfigError: the model or rules cannot be resolved, the rules file is
            invalid (``fallback.rules.RulesError``: the bytes the rule worker will
            serve are checked, ``node.model.snapshot_rules``), the core plan is
            impossible, the run directory is unusable or held by another node
            (one node per run directory: ``node.pidfile.RunLock``), or an
            endpoint is in use (the message names its holder), or another node
            still runs in this process (one node per process). A start that
            fails removes the workers, cgroups, socket files and pidfile it made.
        SandboxError: ``sandbox = "required"`` and cgroups cannot be used.
        NodeStartError: (``start`` only) a worker failed for good, or not every
            worker was READY within ``start_wait_s``.
    """

    def __init__(self, config: NodeConfig, *, start_wait_s: float = START_WAIT_S) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self.pidfile = self.run_dir / PIDFILE_NAME
        #: Where a client on this host connects (a wildcard bind becomes loopback).
        self.frontend = connect_endpoint(config.frontend)
        #: Where workers connect.
        self.backend = connect_endpoint(config.backend)
        self.start_wait_s = start_wait_s
        self._stop_requested = False
        #: systemd's notify socket: ``run`` (the CLI's node, a service's main
        #: process) takes it from the environment; an embedded node never speaks
        #: for the app that embeds it.
        self.notifier = Notifier(None)
        #: True for ``run`` (the CLI's node owns the process and its signals).
        self._own_signals = False
        #: Written to by ``stop`` (and, under ``run``, by the signal wakeup fd) to
        #: wake the loop; made before the loop exists, so no stop is missed.
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        #: Set by the loop thread once every worker is READY, a worker failed for
        #: good (``_start_failure``), or the thread ended.
        self._started = threading.Event()
        #: Set as the loop thread's last act: its cleanup is done (``stop`` waits
        #: for this, not ``Thread.join``; see ``_wait_ended``).
        self._ended = threading.Event()
        self._start_failure: str | None = None
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        #: The embedded node's pidfd watch, while its loop serves (``ExitWatch``).
        self._exits: ExitWatch | None = None
        #: A background start's readiness pipe (``READY_FD_ENV``), until written.
        self._ready_fd: int | None = None

    # ------------------------------------------------------------------ embedded

    def start(self) -> Node:
        """Serve on a new thread; return once every worker is READY.

        Raises:
            RuntimeError: this node was started before (a ``Node`` starts once).
            ConfigError: another node still runs in this process (one node per
                process: each moves the process into its own cgroup).
            NodeStartError: a worker failed for good, or not all were READY in
                ``start_wait_s`` seconds; the node is stopped first.
            EdgeNodeError: what ``run`` raises (bad config, run directory in
                use, endpoint taken, sandbox required): the loop thread's error,
                raised here after everything it made is removed.
        """
        if self._thread is not None:
            raise RuntimeError("a Node starts once; make a new Node to start again")
        _claim_process(self)  # released by the loop thread when it ends
        self._wake = _wake_pair()
        self._thread = threading.Thread(target=self._thread_main, name="edgenode-node")
        try:
            self._thread.start()
        except BaseException:
            _release_process(self)
            self._ended.set()
            raise
        try:
            ready = self._started.wait(self.start_wait_s)
        except BaseException:  # a Ctrl-C while waiting: no node left running
            with contextlib.suppress(Exception):
                self.stop()
            raise
        if ready and self._start_failure is None and self._thread.is_alive():
            return self
        why = self._start_failure or (
            "the node stopped while starting"
            if ready
            else f"not every worker READY within {self.start_wait_s:g} s"
        )
        self.stop()  # raises the loop thread's own error, if it had one
        raise NodeStartError(f"edgenode did not start: {why} (logs in {self.run_dir / 'logs'})")

    def stop(self) -> None:
        """Stop as SIGTERM stops the CLI's node (drain, answer the rest, stop the
        workers, remove cgroups, sockets and pidfile) and join the loop thread.
        Blocks at most about ``workers.stop_grace_ms`` twice plus a second.
        Safe to call twice, or before ``start``; a Ctrl-C while it waits does not
        abandon the stop (it is raised once the thread has ended).

        Raises:
            BaseException: whatever ended the loop thread (once; a second ``stop``
                returns quietly).
        """
        error, interrupted = self._stop()
        if error is not None:
            raise error
        if interrupted is not None:
            raise interrupted

    def _stop(self) -> tuple[BaseException | None, KeyboardInterrupt | None]:
        """``stop``'s work: (the loop thread's error, taken once; a Ctrl-C that
        came while waiting), both None for a clean stop."""
        self._stop_requested = True
        wake = self._wake
        if wake is not None:
            with contextlib.suppress(OSError):  # closed: the loop is gone already
                wake[1].send(b"\0")
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return None, None
        interrupted = self._wait_ended(thread)
        with self._error_lock:
            error, self._error = self._error, None
        return error, interrupted

    def _wait_ended(self, thread: threading.Thread) -> KeyboardInterrupt | None:
        """Wait until the loop thread has cleaned up and ended, through every
        Ctrl-C; returns the last one, if any. Not ``Thread.join`` alone: on
        Python 3.11 a KeyboardInterrupt inside ``join`` releases the thread's
        state lock (bpo-45274's fix), after which ``is_alive()`` says False, and
        interpreter exit no longer waits for it, while the thread still runs."""
        interrupted: KeyboardInterrupt | None = None
        while not self._ended.is_set():
            try:
                self._ended.wait()
            except KeyboardInterrupt as exc:  # finish the stop first: no leftovers
                interrupted = exc
        while True:  # the thread's last statement is done: this join is at once
            try:
                thread.join()
                return interrupted
            except KeyboardInterrupt as exc:
                interrupted = exc

    @property
    def running(self) -> bool:
        """Whether the loop thread is serving (False before ``start`` and after it ended)."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        loop_error, interrupted = self._stop()
        if exc is None:
            if loop_error is not None:
                raise loop_error
            if interrupted is not None:
                raise interrupted
            return
        # The body's exception goes on (it says what the app was doing; a Ctrl-C
        # during the stop adds nothing to it); the loop thread's is logged, whole,
        # rather than lost.
        if loop_error is not None:
            log.error("edgenode loop thread failed", exc_info=loop_error)

    async def __aenter__(self) -> Node:
        """``start`` in an executor thread: the event loop is never blocked. A
        cancelled ``__aenter__`` lets the start finish, then stops the node."""
        starting = asyncio.ensure_future(asyncio.to_thread(self.start))
        try:
            return await asyncio.shield(starting)
        except asyncio.CancelledError:
            await asyncio.wait([starting])
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.stop)
            raise

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """``__exit__`` in an executor thread; a cancelled wait still finishes the stop."""
        stopping = asyncio.ensure_future(asyncio.to_thread(self.__exit__, exc_type, exc, tb))
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            await asyncio.wait([stopping])
            raise

    def _thread_main(self) -> None:
        """The loop thread: ``run``'s work without signals; its error is kept for ``stop``."""
        try:
            self._run(lock_fd=None)
        except BaseException as exc:
            with self._error_lock:
                self._error = exc
        finally:
            _release_process(self)
            self._started.set()
            self._ended.set()

    def _stop_if_abandoned(self) -> None:
        """An embedded node whose app's main thread ended without ``stop`` (the
        interpreter is exiting; it waits for this thread) stops as if asked: a
        forgotten ``stop`` must not leave the app hanging at exit, nor workers
        and cgroups behind. Seen within one loop turn (at most 1 s)."""
        if self._own_signals or self._stop_requested:
            return
        if not threading.main_thread().is_alive():
            log.warning("the app's main thread ended without stopping its node: stopping it")
            self._stop_requested = True

    def _note_start(self, pool: WorkerPool) -> None:
        """Tell ``start`` (or a background start's readiness pipe) once every worker
        is READY, or one failed for good."""
        if self._started.is_set():
            return
        failed = [p for p in pool.supervisor.status() if p["state"] == "failed"]
        if failed:
            self._start_failure = "; ".join(
                f"{p['worker_id']} failed: {p['last_exit']}" for p in failed
            )
            self._started.set()
        elif pool.supervisor.all_ready():
            self._started.set()
        if self._started.is_set():
            self._close_ready_fd(b"\n")

    def _close_ready_fd(self, line: bytes = b"") -> None:
        """Write ``line`` to the readiness pipe, if any, and close it (the start then
        asks ``status`` what happened; a start already gone is no error)."""
        fd, self._ready_fd = self._ready_fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if line:
                os.write(fd, line)
        os.close(fd)

    # ------------------------------------------------------------------ CLI

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit code (0 on a clean stop).
        The CLI's node: it installs SIGTERM/SIGINT/SIGCHLD handlers and a wakeup fd."""
        self._own_signals = True
        # Read (and unset) before any child exists: workers must not inherit
        # $NOTIFY_SOCKET and speak for the node.
        self.notifier = Notifier.from_environ()
        self._ready_fd = inherited_ready_fd()
        self._wake = _wake_pair()
        try:
            _claim_process(self)
            return self._run(inherited_lock_fd())
        finally:
            _release_process(self)
            self._close_ready_fd()  # a node that ends before it is ready: EOF

    def _run(self, lock_fd: int | None) -> int:
        """Check, lock, serve, clean up; ``lock_fd``: a lock handed over by a
        background start (``node.pidfile.inherited_lock_fd``)."""
        try:
            return self._run_checked(lock_fd)
        finally:
            if self._wake is not None:
                for sock in self._wake:
                    sock.close()

    def _run_checked(self, lock_fd: int | None) -> int:
        c = self.config
        raise_open_files_limit()
        model = str(resolve_model(c.model.path)) if c.workers.engine == "llama" else "test"
        rules = resolve_rules(c.fallback.rules) if c.fallback.rules else None
        self.plan = check_fits(c)  # refuse what cannot fit, before anything starts
        # ... and so do unusable key files; the node's local key is allowed at bind.
        self._curve = curve_servers(c)
        backend_curve = self._curve[1]
        # ... and so does a bad core plan; the workers get the plan's (resolved) slots.
        # The rule worker loads the rules this start validates, never the live file.
        snapshot = self.run_dir / RULES_SNAPSHOT
        served_rules = str(snapshot) if rules is not None else None
        pool = WorkerPool(
            c,
            model,
            served_rules,
            self.run_dir,
            self.plan,
            slots=self.plan.slots,
            backend_key=b"" if backend_curve is None else backend_curve.public_key,
            key_file=local_key_file(self.run_dir),
            embedded=not self._own_signals,
        )
        made = make_run_dir(self.run_dir)
        if self._own_signals:
            # From here a SIGTERM (``edgenode stop`` of a starting node) must take the
            # clean path: the default action would leave the pidfile, later the cgroups.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        # One node per run directory, for this node's whole life; a background
        # start took the lock before spawning this process and handed it over.
        with RunLock(self.run_dir, fd=lock_fd):
            front = self._curve[0]
            write_pidfile(
                self.pidfile,
                c.frontend,
                None if front is None else front.public_key,
                embedded=not self._own_signals,
            )
            try:
                if rules is not None:
                    snapshot_rules(rules, self.run_dir)
                return self._run_locked(pool, model)
            finally:
                remove_pidfile(self.pidfile)
                snapshot.unlink(missing_ok=True)
                if made:  # still locked: no other node is using it (a refused start's)
                    remove_empty_dir(self.run_dir)

    def _run_locked(self, pool: WorkerPool, model: str) -> int:
        """Check the endpoints, open the cgroups, serve. Whatever fails on the way,
        the workers, cgroups and socket files made so far are removed."""
        c = self.config
        for key, endpoint in (("node.frontend", c.frontend), ("node.backend", c.backend)):
            check_free(key, endpoint)  # nothing is made before this
        if self._stop_requested:  # stopped while starting: nothing to make, nothing to undo
            return 0
        # An embedded node's sandbox may pin the app's threads (reserved cores):
        # the cores each had come back at stop.
        affinities, own = thread_affinities(), os.sched_getaffinity(0)
        try:
            pool.open()  # cgroups before any zmq thread exists
            return self._serve(pool, model)
        finally:
            pool.stop(c.workers.stop_grace_ms / 1000)  # after a clean stop: a no-op
            if not self._own_signals and pool.plan.node:
                _restore_affinity(affinities, pool.plan.node, own)
            # Free or stale when checked, under this node's lock: they are this node's.
            for name in (FRONTEND_SOCKET, BACKEND_SOCKET):
                (self.run_dir / name).unlink(missing_ok=True)

    def _serve(self, pool: WorkerPool, model: str) -> int:
        c = self.config
        migration = self._migration_log(pool)
        layout = _layout()  # after pool.open(): the node is in its own cgroup now
        pressure = PressureMonitor(
            c.pressure,
            pool,
            self._default_budget(),
            limit=lambda: None if layout is None else tightest_limit(layout=layout),
        )
        cpu = _cpu_monitor(c, pool)
        # The model's engine: a rules-only node (workers.count = 0) has no tokens to count.
        model_engine = next((s.engine for s in pool.specs if s.engine.kind != "rules"), None)
        counter = _token_counter(model_engine) if model_engine is not None else None
        broker = Broker(
            c.broker,
            status_hook=lambda: self._status_extra(pool, model, pressure, cpu, counter),
            count_tokens=counter,
            routing=c.routing,
            breaker=c.breaker,
        )
        # systemd's READY/STATUS/WATCHDOG/STOPPING, from this loop's own turn.
        service = ServiceReporter(self.notifier, broker, pool.supervisor)

        def on_tick(now: float) -> None:
            service.turn(now)
            pool.supervisor.tick(now)
            try:
                level = pressure.poll(now)
            except Exception:  # a monitoring failure must never take the broker down
                log.exception("memory pressure reading failed")
                level = None
            if level is not None:
                log_pressure_change("memory", broker.pressure.level, level, pressure.snapshot())
                broker.set_pressure(level, now)
            try:
                cpu_level = cpu.poll(now)
            except Exception:  # as above: never take the broker down
                log.exception("CPU pressure reading failed")
                cpu_level = None
            if cpu_level is not None:
                broker.set_cpu_pressure(cpu_level, now)
            if metrics is not None:
                metrics.publish(now)
            if self._exits is not None:
                self._exits.sync(pool.supervisor.processes())
            self._note_start(pool)
            # The counter loads once every worker is ready (or one failed for good):
            # after their loads, not beside them, where a nice-0 thread here would
            # take the CPU from the nice-10 workers' loads on a busy host.
            if isinstance(counter, BackgroundCounter) and self._started.is_set():
                counter.start()  # once; later calls do nothing

        metrics = _metrics(c, broker, pool)
        # The core builds request traces and observations only for a reader of them
        # (``_on_effects``: DEBUG lines, the metrics): most nodes have neither.
        consumed = Consumed(
            traces=log.isEnabledFor(logging.DEBUG), observations=metrics is not None
        )
        broker.outbox.consume(consumed)
        try:
            return self._serve_with(broker, pool, migration, on_tick, metrics, service)
        finally:
            if metrics is not None:
                metrics.close()

    def _serve_with(
        self,
        broker: Broker,
        pool: WorkerPool,
        migration: MigrationLog,
        on_tick: Callable[[float], None],
        metrics: MetricsServer | None,
        service: ServiceReporter,
    ) -> int:
        """Bind the loop and serve until stopped; ``metrics`` (None: off) records
        the broker's effects; ``service`` tells systemd when the node stops."""
        c = self.config
        loop = self._bind(broker, pool, migration, on_tick, metrics)
        assert self._wake is not None  # made by run / start
        wake_r = self._wake[0]
        loop.add_fd(wake_r.fileno(), lambda: _drain_fd(wake_r))
        exits: ExitWatch | None = None
        if self._own_signals:
            self._install_signals()
            turn_s = 1.0  # SIGCHLD wakes the loop for an exit
        else:
            exits = self._exits = ExitWatch(loop)
            turn_s = 1.0 if exits.available else EXIT_POLL_S
        try:
            pool.start(lambda wid, cause: broker.worker_exited(wid, cause, time.monotonic()))
            if exits is not None:
                exits.sync(pool.supervisor.processes())
            log.info(
                "edgenode serving on %s (%d model workers x %d slots, mode %s, pid %d)",
                c.frontend,
                c.workers.count,
                self.plan.slots,
                c.routing.mode,
                os.getpid(),
            )
            turn_s = min(turn_s, self.notifier.max_wait_s or turn_s)  # watchdog pings on time
            while not self._stop_requested:
                loop.turn(max_wait_s=turn_s)
                self._stop_if_abandoned()
            broker.drain(time.monotonic())  # queued requests: 503 draining now
            service.stopping(time.monotonic())
            self._drain(loop, broker, pool)
            self._stop_workers(loop, pool)
        finally:
            self._close(loop, pool, migration, exits)
            self.notifier.close()
        return 0

    def _bind(
        self,
        broker: Broker,
        pool: WorkerPool,
        migration: MigrationLog,
        on_tick: Callable[[float], None],
        metrics: MetricsServer | None = None,
    ) -> BrokerLoop:
        """The broker loop on the configured endpoints; what the broker's outbox
        holds for the node goes to ``pool`` and ``migration`` (``_on_effects``).

        Raises:
            ConfigError: an endpoint cannot be bound (taken since ``check_free``,
                a host name that does not resolve); the message names it and,
                when in use, its holder.
        """
        c = self.config
        frontend_curve, backend_curve = self._curve
        if frontend_curve is not None or backend_curve is not None:
            # This host's own processes (workers, the CLI as this user) hold it.
            local = local_keypair(self.run_dir)
            frontend_curve = also_allow(frontend_curve, local)
            backend_curve = also_allow(backend_curve, local)
        try:
            return BrokerLoop(
                broker,
                c.frontend,
                c.backend,
                on_effects=lambda effects: _on_effects(pool, migration, effects, metrics),
                on_tick=on_tick,
                frontend_curve=frontend_curve,
                backend_curve=backend_curve,
            )
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                for key, endpoint in (("node.frontend", c.frontend), ("node.backend", c.backend)):
                    try:
                        check_free(key, endpoint)
                    except ConfigError as busy:
                        raise busy from exc
            raise ConfigError(
                f"cannot bind node.frontend {c.frontend} / node.backend {c.backend}: {exc}"
            ) from exc

    def _close(
        self,
        loop: BrokerLoop,
        pool: WorkerPool,
        migration: MigrationLog,
        exits: ExitWatch | None,
    ) -> None:
        """Close the sockets, stop what is left of the pool, remove the run files."""
        try:
            # Close the frontend first: nothing then waits unanswered on a bound
            # socket while cgroups are removed (or, after a failure, the pool
            # stops). The linger lets the last turn's replies still go out.
            loop.close(linger_ms=CLOSE_LINGER_MS)
        finally:
            pool.stop(self.config.workers.stop_grace_ms / 1000)  # at once after _stop_workers
        migration.close()
        if exits is not None:
            exits.close()
            self._exits = None
        if self._own_signals:
            signal.set_wakeup_fd(-1)
        log.info("edgenode stopped")

    def _migration_log(self, pool: WorkerPool) -> MigrationLog:
        """The shadow/dual/degrade log, with each model worker's memory peak."""
        f = self.config.fallback
        return MigrationLog(
            migration_log_path(self.run_dir),
            f.log_max_bytes,
            f.log_backups,
            f.low_confidence,
            memory_peak=lambda wid: _peak(pool, wid),
        )

    def _default_budget(self) -> int | None:
        """What the node's cgroup may hold when nothing sets a limit: the workers'
        limits, plus what the node itself holds (the shared weights it faulted in,
        its own and the rule worker's runtime)."""
        one = memory_max_bytes(self.config.workers, self.plan)
        if one is None:
            return None
        own = 2 * parse_size(self.config.capacity.runtime_overhead)
        return one * self.config.workers.count + self.plan.shared_weights + own

    def _install_signals(self) -> None:
        """The CLI's node only: route SIGTERM/SIGINT to a clean stop and wake the
        loop (through the wake socketpair) on any signal."""
        assert self._wake is not None
        signal.set_wakeup_fd(self._wake[1].fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # SIGCHLD only needs to wake the loop so an exited worker is reaped at once.
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def _drain(self, loop: BrokerLoop, broker: Broker, pool: WorkerPool) -> None:
        """Let the requests in flight finish within the grace, answer the rest (the
        broker is draining: nothing new is admitted, nothing is queued)."""
        log.info("draining %d request(s)", broker.pending_jobs())
        pool.supervisor.stopping = True
        deadline = time.monotonic() + self.config.workers.stop_grace_ms / 1000
        while broker.pending_jobs() and time.monotonic() < deadline:
            loop.turn(max_wait_s=0.05)
        broker.abort_all("node is shutting down", time.monotonic())
        loop.flush()

    def _stop_workers(self, loop: BrokerLoop, pool: WorkerPool) -> None:
        """Stop the workers while the loop keeps answering clients (pongs, status,
        ``503 draining``): SIGTERM now, SIGKILL after ``workers.stop_grace_ms``.

        The loop's tick reaps the exits (SIGCHLD wakes it). Blocking in
        ``Supervisor.stop`` instead left the bound frontend unread for as long as
        the slowest worker took to exit.
        """
        sup = pool.supervisor
        groups = sup.terminate_all()
        grace_end = time.monotonic() + self.config.workers.stop_grace_ms / 1000
        while sup.unreaped() and time.monotonic() < grace_end:
            loop.turn(max_wait_s=STOP_POLL_S)
        sup.kill_groups(groups)
        kill_end = time.monotonic() + KILL_REAP_S
        while sup.unreaped() and time.monotonic() < kill_end:
            loop.turn(max_wait_s=STOP_POLL_S)
        log.info("workers stopped (%d not reaped yet)", sup.unreaped())

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self._stop_requested = True

    def _status_extra(
        self,
        pool: WorkerPool,
        model: str,
        pressure: PressureMonitor,
        cpu: CpuPressureMonitor,
        counter: TokenCounter | None,
    ) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "model": model,
            "engine": self.config.workers.engine,
            "endpoints": {"frontend": self.config.frontend, "backend": self.config.backend},
            "security": {
                "frontend": "curve" if self._curve[0] is not None else "plaintext",
                "backend": "curve" if self._curve[1] is not None else "plaintext",
            },
            # Keys the operator allowed per CURVE side (the local key not counted):
            # 0 on the frontend means only this host's own processes get in.
            "allowed_keys": {
                side: len(server.allowed)
                for side, server in zip(("frontend", "backend"), self._curve, strict=True)
                if server is not None
            },
            "run_dir": str(self.run_dir),
            "processes": pool.status(),
            "all_ready": pool.supervisor.all_ready(),
            # The broker's prompt-token counter (its 413 check before dispatch): "none"
            # (no model engine), "loaded", or a model vocabulary's BackgroundCounter state.
            "token_counter": (
                "none"
                if counter is None
                else counter.state
                if isinstance(counter, BackgroundCounter)
                else "loaded"
            ),
            "sandbox": pool.sandbox.status(),
            "cores": pool.cores,
            "memory": pressure.snapshot(),
            "cpu": cpu.snapshot(),
            "capacity": {
                "workers": self.plan.workers,
                "slots": self.plan.slots,
                "sequences": self.plan.sequences,
                "per_worker": self.plan.per_worker,
                "grammar": self.plan.grammar,
                "memory_max": self.plan.memory_max,
                "memory_high": self.plan.memory_high,
                "total": self.plan.total,
                "budget": self.plan.budget,
                "budget_source": self.plan.budget_source,
                "worker_limits": describe(self.config.workers, self.plan),
            },
        }


class ExitWatch:
    """Wakes an embedded node's loop when a worker process exits, without SIGCHLD
    (whose handler belongs to the app): one pidfd per unreaped worker process
    (``os.pidfd_open``, Linux >= 5.3), registered with the loop. A pidfd turns
    readable when its process exits; the turn it wakes reaps the process
    (``Supervisor.tick``), and the next ``sync`` closes the pidfd. The process is
    this node's child and unreaped while its pidfd is opened, so the pid cannot
    name another process. Without pidfds (``available`` False) the node caps its
    loop turns at ``EXIT_POLL_S`` instead.
    """

    def __init__(self, loop: BrokerLoop) -> None:
        self.loop = loop
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self.available = hasattr(os, "pidfd_open")

    def sync(self, pids: set[int]) -> None:
        """Watch exactly ``pids`` (the supervisor's unreaped processes)."""
        for pid in [p for p in self._fds if p not in pids]:
            fd = self._fds.pop(pid)
            self.loop.remove_fd(fd)
            os.close(fd)
        if not self.available:
            return
        for pid in pids - self._fds.keys():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # already reaped: tick has seen it
            except OSError as exc:  # ENOSYS: a kernel before 5.3
                log.warning("no pidfds (%s): worker exits are polled every %g s", exc, EXIT_POLL_S)
                self.available = False
                return
            self._fds[pid] = fd
            self.loop.add_fd(fd, _exited)

    def close(self) -> None:
        """Close every pidfd."""
        self.sync(set())


def _exited() -> None:
    """A pidfd turned readable: nothing to read; the turn's tick reaps the process."""


def _restore_affinity(saved: dict[int, set[int]], pinned: tuple[int, ...], own: set[int]) -> None:
    """Give each thread of the app that embeds the node back the cores it had
    (``restore_affinities``: one the app moved meanwhile keeps its own; one started
    since gets those of the thread that started the node)."""
    try:
        restore_affinities(saved, pinned, own)
    except SandboxError as exc:
        log.warning("cannot give the app's threads back their cores: %s", exc.message)


def _wake_pair() -> tuple[socket.socket, socket.socket]:
    """The loop's wake socketpair (reader, writer), both non-blocking."""
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    return wake_r, wake_w


def _layout() -> Layout | None:
    """This process's cgroups and the host's mounts, read once (None without /proc)."""
    try:
        return read_layout(Host())
    except OSError:
        return None


def _cpu_monitor(config: NodeConfig, pool: WorkerPool) -> CpuPressureMonitor:
    """CPU PSI of the node's cgroup on v2, else of the host (``node.pressure``)."""
    v2 = Path(pool.sandbox.base) if pool.sandbox.driver.kind == "v2" else None
    path, why = cpu_psi_file(v2, configured=config.pressure.cpu_psi)
    if path is None and config.pressure.cpu_warn_pct:
        log.warning("CPU pressure is not measured: %s", why)
    return CpuPressureMonitor(config.pressure, path, why)


def _metrics(config: NodeConfig, broker: Broker, pool: WorkerPool) -> MetricsServer | None:
    """The metrics endpoint if ``[metrics] listen`` is set, else None (nothing listens).

    Raises:
        ConfigError: the address cannot be bound.
    """
    listen = parse_listen("metrics.listen", config.metrics.listen)
    if listen is None:
        return None
    # Here, not at the top: prometheus_client costs ~0.1 s of every start, and
    # metrics are off by default (docs/bench/figures.md, "Start to ready").
    from node.observe.server import MetricsServer

    return MetricsServer(listen, broker, pool)


def _on_effects(
    pool: WorkerPool, migration: MigrationLog, effects: Effects, metrics: MetricsServer | None
) -> None:
    """Act on what the broker's outbox holds for the node: worker events for the
    supervisor, migration records for the log, the circuit breaker's transitions
    for the node's log, observations and transitions for the metrics. A remote
    host agent's worker (an id this pool does not own) is its agent's to
    supervise: its events change nothing here."""
    for event in effects.events:
        if event.worker_id not in pool.supervisor.handles:
            continue
        if event.kind == "ready":
            pool.supervisor.worker_ready(event.worker_id, event.pid)
        elif event.kind == "lost":
            assert event.cause is not None  # the broker gives every loss its cause
            pool.lose(event.worker_id, event.pid, event.cause)
    for record in effects.records:
        migration.write(record)
    for t in effects.transitions:
        log_breaker_transition(t)
    if metrics is not None:
        metrics.observe(effects)
    if log.isEnabledFor(logging.DEBUG):  # one line per step: formatted only when wanted
        log_paths(effects)


def log_breaker_transition(t: Transition) -> None:
    """Log a circuit breaker's change of state as a ``breaker_transition`` event:
    WARNING when it opens (from closed, or a failed half-open probe: the model is
    off and its work goes to the rules or fails), INFO when it half-opens or closes."""
    fields = {"from": t.old.value, "to": t.new.value, "reason": t.reason}
    log.log(
        logging.WARNING if t.new is BreakerState.OPEN else logging.INFO,
        "circuit breaker %s -> %s: %s",
        t.old.value,
        t.new.value,
        t.reason,
        extra=event_extra("breaker_transition", fields),
    )


def log_paths(effects: Effects) -> None:
    """Log the steps of requests' paths (``broker.records.RequestTrace``) and
    their final replies, each with its ``request_id`` (``node.observe.logs``)."""
    for t in effects.traces:
        on = f" on {t.worker}" if t.worker else ""
        detail = f" ({t.detail})" if t.detail else ""
        log.debug(
            "request %r %s%s%s",
            t.request_id,
            t.step,
            on,
            detail,
            extra=about_request(
                t.request_id,
                t.client or None,
                step=t.step,
                rid=t.rid,
                worker=t.worker or None,
                key=None if t.principal is None else t.principal.decode(),
            ),
        )
    for out in effects.clients:
        body = out.body
        if out.kind is not ReplyKind.FINAL or "pong" in body or "node" in body:
            continue  # a partial, or a ping's or status's answer: not a request's path
        status = body.get("status")
        code, reason = body.get("code"), body.get("reason")
        said = status if code is None else f"{status} {code} {reason or ''}".rstrip()
        log.debug(
            "request %r replied %s",
            body.get("id"),
            said,
            extra=about_request(body.get("id"), out.client, **replied_fields(body)),
        )


#: The longest ``message`` a ``replied`` line carries, in characters: an error's
#: message is the node's own words (PROTOCOL §5), a line or two, never the prompt;
#: the bound keeps a worker's long llama.cpp error from swelling the log.
REPLIED_MESSAGE_MAX_CHARS = 200


def replied_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a request's ``replied`` line, from its FINAL reply's ``body``:
    ``step``, ``status``; ``degraded`` and ``degrade_reason`` when the rules
    answered for the model; ``code``, ``reason`` and ``message`` (at most
    ``REPLIED_MESSAGE_MAX_CHARS``) of an error. Never the output or the prompt."""
    fields: dict[str, Any] = {"step": "replied", "status": body.get("status")}
    if body.get("degraded"):
        fields["degraded"] = True
        fields["degrade_reason"] = body.get("degrade_reason")
    if body.get("status") == "error":
        fields["code"], fields["reason"] = body.get("code"), body.get("reason")
        message = body.get("message")
        if isinstance(message, str):
            cut = message[:REPLIED_MESSAGE_MAX_CHARS]
            fields["message"] = cut if cut == message else cut + "…"
    return fields


def log_pressure_change(resource: str, old: str, new: str, reading: dict[str, Any]) -> None:
    """Log a change of the memory pressure level as a ``pressure_change`` event:
    WARNING when it rises (``high`` and ``critical`` shed work), INFO when it falls."""
    fields = {"resource": resource, "from": old, "to": new, "used_pct": reading.get("used_pct")}
    rising = _rank(new) > _rank(old)
    log.log(
        logging.WARNING if rising else logging.INFO,
        "memory pressure %s -> %s (%s%% of the budget)",
        old,
        new,
        reading.get("used_pct"),
        extra=event_extra("pressure_change", fields),
    )


def _rank(level: str) -> int:
    """A memory level's place in ``PRESSURE_LEVELS`` (ok < high < critical); -1 if unknown."""
    levels: tuple[str, ...] = PRESSURE_LEVELS
    return levels.index(level) if level in levels else -1


def _token_counter(engine: EngineSpec) -> TokenCounter:
    """The broker's prompt-token counter. The model's vocabulary loads in the
    background (``node.engine.BackgroundCounter``), started once the workers are
    ready (``_serve``'s ``on_tick``): loaded first, it took 1-4 s of the node's
    start before the workers were even spawned (docs/bench/figures.md, "Start to ready")."""
    if engine.kind != "llama":
        return make_token_counter(engine)  # the test engine's: instant
    return BackgroundCounter(lambda: make_token_counter(engine))


def _peak(pool: WorkerPool, worker_id: str) -> int | None:
    reading = pool.memory(worker_id)
    return None if reading is None else (reading.peak or reading.current)


def _drain_fd(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while sock.recv(4096):
            pass


def log_path(run_dir: Path) -> Path:
    """Where a background node writes its own log."""
    return run_dir / "logs" / "node.log"
