"""The ``edgenode`` command line: start, stop, status, ask (and rules, report, capacity,
bench in modules of their own).

The global options apply to every command, before or after it
(``node.cli.context``): ``-c/--config`` (or ``EDGENODE_CONFIG``), ``--run-dir``
(or ``EDGENODE_RUN_DIR``) and ``--json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click
import psutil

from broker.client import Client
from broker.errors import EdgeNodeError
from broker.protocol import error_reply
from node.app import READY_FD_ENV, Node, log_path
from node.capacity.plan import check_fits
from node.cli.capacity import capacity
from node.cli.context import add_global_options, node_config, unusable_dir_error, wants_json
from node.cli.keys import keys
from node.cli.report import report
from node.cli.rules import load_or_exit, rules
from node.cli.status_view import render_status
from node.cli.watch import watch as watch_status
from node.cli.worker import worker
from node.config import NodeConfig
from node.endpoints import connect_endpoint
from node.interpreter import module_command
from node.model import resolve_model, resolve_rules
from node.observe.logs import BROKER_ROLE
from node.observe.logs import configure as configure_logs
from node.pidfile import (
    LOCK_FD_ENV,
    ForeignHolderError,
    NodeRecord,
    RunLock,
    in_use_message,
    is_launcher,
    lock_holder,
    make_run_dir,
    read_node_record,
    remove_empty_dir,
    signal_holder,
    wait_for_starts,
)
from node.pool import WorkerStatus
from node.sandbox.cores import plan_workers
from node.security.keys import client_keys, local_key_file, local_keypair
from node.service.health import judge
from node.units import format_size

#: ``edgenode status`` exit code when no node runs (LSB init-script convention).
EXIT_NOT_RUNNING = 3
#: ``status --ready``: how long it waits for the node's answer (ms); an exec
#: probe's timeout should allow this plus the interpreter's start (~0.5 s).
READY_WAIT_MS = 1000
#: Added to a stopping node's own grace (2 x workers.stop_grace_ms) before a failed
#: start kills it (s): closing sockets and removing cgroups takes well under this.
STOP_MARGIN_S = 10.0
#: How long ``stop`` waits, when no node holds the lock, for starts already
#: running to take theirs (s): a start takes it after its imports and config,
#: about a second on a small board.
START_LOCK_WAIT_S = 10.0


#: Commands whose module is imported only when they run or are listed (``--help``),
#: by name -> module (which defines a command of that name): ``bench`` brings in every
#: benchmark scenario, 0.15-0.2 s of CPU that every other command paid, ``edgenode
#: start`` twice (docs/bench/figures.md, "Start to ready").
LAZY_COMMANDS = {"bench": "node.cli.bench"}


class _Commands(click.Group):
    """The ``edgenode`` group: an unusable run or cache directory is a one-line
    error naming it (exit 1), wherever in a command it turns up; every command
    added gets the global options (``node.cli.context.add_global_options``);
    ``LAZY_COMMANDS`` are added when first asked for."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        add_global_options(cmd)
        super().add_command(cmd, name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY_COMMANDS and cmd_name not in self.commands:
            module = importlib.import_module(LAZY_COMMANDS[cmd_name])
            self.add_command(getattr(module, cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OSError as exc:
            error = unusable_dir_error(exc, ctx.obj)
            if error is None:
                raise
            raise error from exc


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context) -> None:
    """edgenode: a small GGUF model served over ZeroMQ, fenced off from the host's workload."""
    ctx.ensure_object(dict)


add_global_options(cli, group=True)


@cli.command()
@click.option("--foreground", is_flag=True, help="Run in this process; Ctrl-C stops it.")
@click.option(
    "--wait-s",
    default=180.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Background start: how long to wait for every worker to be READY.",
)
@click.pass_context
def start(ctx: click.Context, foreground: bool, wait_s: float) -> None:
    """Start the node (background by default, with a pidfile and logs in the run dir).

    One node per run directory: the node holds a lock on it for its whole life.
    A background start takes that lock before it launches the node and hands it
    over, so a ``stop`` issued meanwhile stops the start and its node. It succeeds
    only when the node it launched answers with every worker ready; otherwise
    (including SIGINT, SIGTERM or SIGHUP to the start) it stops that node and
    exits 1 with the reason.
    """
    config = node_config(ctx)
    # A node launched by a background start holds the lock already (handed over).
    if LOCK_FD_ENV not in os.environ and lock_holder(config.run_dir) is not None:
        raise click.ClickException(in_use_message(config.run_dir))
    if foreground:
        _check_startable(config)
        configure_logs(config.node.log_level, config.logging.format, BROKER_ROLE)
        try:
            sys.exit(Node(config).run())
        except EdgeNodeError as exc:
            raise click.ClickException(exc.message) from exc
    _start_background(config, wait_s)


def _check_startable(config: NodeConfig) -> None:
    """Fail here, clearly, before anything starts.

    Raises:
        click.ClickException: no model, a config that cannot fit, an impossible
            core reservation, or a bad rules file (every error, as ``rules check``
            says them).
    """
    try:
        if config.workers.engine == "llama":
            resolve_model(config.model.path)
        check_fits(config)
        plan_workers(config.workers, config.node.cpus)
        if config.fallback.rules:
            load_or_exit(str(resolve_rules(config.fallback.rules)))
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc


class StartInterrupted(Exception):
    """A background start got SIGINT, SIGTERM or SIGHUP: it gives up, and so
    does the node it launched."""

    def __init__(self, signum: signal.Signals) -> None:
        super().__init__(signum.name)
        self.signum = signum


class _Interrupts:
    """SIGINT, SIGTERM and SIGHUP raise ``StartInterrupted`` while a background
    start waits (``edgenode stop``, ``timeout``, a closed terminal all mean "give
    up", as Ctrl-C does). While the node is being spawned a signal is only kept
    and raised right after: raised inside ``Popen`` it would lose the child."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.pending: signal.Signals | None = None
        self.armed = True

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.pending = signal.Signals(signum)
        if self.armed:
            raise StartInterrupted(self.pending)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep signals pending inside the block; raise the kept one at its end."""
        self.armed = False
        try:
            yield
        finally:
            self.armed = True
            if self.pending is not None:
                raise StartInterrupted(self.pending)

    def disarm(self) -> None:
        """From here signals are only recorded (the start has succeeded, or is
        already stopping its node and must not be cut short)."""
        self.armed = False


def _start_background(config: NodeConfig, wait_s: float) -> None:
    logfile = log_path(config.run_dir)
    interrupts = _Interrupts()
    proc: subprocess.Popen[bytes] | None = None
    try:
        interrupts.install()
        made = make_run_dir(config.run_dir)
        # The lock first: from here a `stop` finds this start and stops it.
        with _locked(config.run_dir) as lock:
            try:
                _check_startable(config)  # a refused start makes no logs, no node
                logfile.parent.mkdir(parents=True, exist_ok=True)
                # The node says "ready" down this pipe (node.app.READY_FD_ENV): no poll delay.
                ready_r, ready_w = os.pipe()
                try:
                    with open(logfile, "ab") as out, interrupts.held():
                        proc = subprocess.Popen(
                            module_command("node.cli", "start", "--foreground"),
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=out,
                            start_new_session=True,
                            pass_fds=(lock.fd, ready_w),  # the node adopts the held lock
                            env={
                                **os.environ,
                                LOCK_FD_ENV: str(lock.fd),
                                READY_FD_ENV: str(ready_w),
                            },
                        )
                    os.close(ready_w)
                    ready_w = -1
                    click.echo(f"starting edgenode (pid {proc.pid}, log {logfile}) ...")
                    ready = _wait_started(proc, config, wait_s, logfile, ready_r)
                finally:
                    os.close(ready_r)
                    if ready_w >= 0:
                        os.close(ready_w)
            except (click.ClickException, StartInterrupted):
                if made and proc is None:  # ... and no run directory: still locked, no node's
                    remove_empty_dir(config.run_dir)
                raise
            interrupts.disarm()
    except click.ClickException as exc:
        # A start that fails leaves nothing running: its node stops (workers,
        # cgroups, sockets and pidfile go with it).
        interrupts.disarm()
        if proc is None:
            raise
        raise click.ClickException(f"{exc.message}\n{_stop_started(proc, config)}") from exc
    except StartInterrupted as exc:  # the start is given up, so is its node
        interrupts.disarm()
        stopped = (
            " before it launched a node" if proc is None else f"\n{_stop_started(proc, config)}"
        )
        raise click.ClickException(f"start interrupted ({exc.signum.name}){stopped}") from None
    click.echo(f"edgenode running: {ready} on {config.frontend} (pid {proc.pid})")


@dataclasses.dataclass(frozen=True)
class _Ready:
    """The workers a started node's ``status`` lists: its own model workers, its
    own rule workers (the fallback: no model), and remote agents' workers."""

    model: int
    rules: int
    remote: int

    @classmethod
    def of(cls, workers: list[dict[str, Any]]) -> _Ready:
        """Count ``status``'s ``workers`` entries (``kind`` llm or rules, ``remote``)."""
        own = [w for w in workers if not w.get("remote")]
        rules = sum(1 for w in own if w.get("kind") == "rules")
        return cls(len(own) - rules, rules, len(workers) - len(own))

    def __str__(self) -> str:
        said = f"{self.model} model worker(s) ready"
        if self.rules:
            said += f", the rule worker{'s' if self.rules > 1 else ''} too"
        if self.remote:
            said += f" (and {self.remote} remote)"
        return said


#: How often a background start asks its node's ``status`` while it starts (s); the
#: node's readiness pipe wakes it sooner (``_wait_ready_fd``).
POLL_S = 0.2


def _wait_ready_fd(fd: int | None, timeout_s: float) -> int | None:
    """Sleep ``timeout_s``, or less if the readiness pipe ``fd`` has news (a line:
    ready or failed; EOF: the node is gone). Returns ``fd``, or None once the pipe
    has said its one thing (later waits are plain sleeps: the caller closes it)."""
    if fd is None:
        time.sleep(timeout_s)
        return None
    readable, _, _ = select.select([fd], [], [], timeout_s)
    if not readable:
        return fd
    os.read(fd, 64)
    return None


@contextlib.contextmanager
def _locked(run_dir: Path) -> Iterator[RunLock]:
    """``RunLock(run_dir)``, its refusal as a click error.

    Raises:
        click.ClickException: another node (or another process) holds the lock.
    """
    try:
        lock = RunLock(run_dir).__enter__()
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def _wait_started(
    proc: subprocess.Popen[bytes],
    config: NodeConfig,
    wait_s: float,
    logfile: Path,
    ready_fd: int | None = None,
) -> _Ready:
    """Wait until the node ``proc`` itself answers with every worker ready; returns
    who is ready (``_Ready``: its own model workers, its rule worker, and remote
    agents' workers registered by then, a gateway's: no part of this start). An
    answer from any other process (a node that already held the endpoint) does
    not count: its ``pid`` is not ``proc``'s. Between ``status`` polls it waits on
    ``ready_fd`` (the node's readiness pipe, if any), which the node writes to, or
    closes, the moment it is ready, failed or gone. Past ``wait_s`` it waits on
    while the node reports every worker not ready as loading (``_StillLoading``).

    Raises:
        click.ClickException: the node exited (with its own error), a worker
            failed, or not ready within ``wait_s`` (or, loading, within the cap).
    """
    begun = time.monotonic()
    deadline = begun + wait_s
    answered_by: int | None = None
    loading: _StillLoading | None = None
    with Client(connect_endpoint(config.frontend), wait_ms=1000, **_keys(config)) as client:
        late = False  # one poll past wait_s decides whether the start waits on
        while True:
            now = time.monotonic()
            if (loading is not None and now >= loading.until) or (
                loading is None and late and now >= deadline
            ):
                break
            late = now >= deadline
            if proc.poll() is not None:
                raise click.ClickException(f"node exited during start: {_exit_reason(logfile)}")
            try:
                status = client.status()
            except EdgeNodeError:
                ready_fd = _wait_ready_fd(ready_fd, POLL_S)
                continue
            if status.get("pid") != proc.pid:
                answered_by = status.get("pid")
                ready_fd = _wait_ready_fd(ready_fd, POLL_S)
                continue
            processes: list[WorkerStatus] = status.get("processes", [])
            _raise_if_failed(processes, logfile)
            if status.get("all_ready"):
                return _Ready.of(status["workers"])
            if time.monotonic() >= deadline:
                loading = _wait_on_loading(status, loading, begun, wait_s, logfile)
            ready_fd = _wait_ready_fd(ready_fd, POLL_S)
    if loading is not None:
        raise click.ClickException(
            f"workers not ready after {loading.until - begun:.0f}s, the cap on a load that "
            f"progresses ({loading.cap_s:g}s from a worker's spawn, as the node reports it); "
            f"see {logfile}"
        )
    other = (
        f"; {config.frontend} is answered by pid {answered_by}, not by the node this start "
        f"launched (pid {proc.pid})"
        if answered_by is not None
        else ""
    )
    raise click.ClickException(f"workers not ready after {wait_s:g}s{other}; see {logfile}")


def _raise_if_failed(processes: list[WorkerStatus], logfile: Path) -> None:
    """Raises click.ClickException naming each ``failed`` worker and its last exit."""
    failed = [p for p in processes if p["state"] == "failed"]
    if failed:
        reasons = "; ".join(f"{p['worker_id']}: {p['last_exit']}" for p in failed)
        raise click.ClickException(f"worker failed to start ({reasons}); see {logfile.parent}")


@dataclasses.dataclass(frozen=True)
class _StillLoading:
    """Past ``start --wait-s``: the workers not ready yet, all loading, as the node
    reported them (``processes[].loading``), and how long the start waits on them.

    The node's supervisor judges a load (it kills one that stops progressing, or
    reaches its cap), so the start only reads its verdict: the same process still
    ``starting`` with a ``loading`` report means still progressing.
    """

    #: The pid of each worker not ready (another pid: it was killed and respawned).
    pids: dict[str, int | None]
    #: When the last of their caps passes (monotonic s): the start waits no longer.
    until: float
    #: The longest of their caps (s since a worker's spawn), for the messages.
    cap_s: float

    @classmethod
    def judge(
        cls, processes: list[WorkerStatus], before: _StillLoading | None, now: float
    ) -> _StillLoading | None:
        """The loading workers of this ``status`` poll, taken at ``now`` (monotonic s);
        None (give up) if a worker not ready is not loading, or is not the process
        it was at the poll before (``before``). The wait's end is fixed at the first
        poll that found them loading."""
        pending = [p for p in processes if p["state"] != "ready"]
        loads = [(p, p.get("loading")) for p in pending if p["state"] == "starting"]
        reports = [load for _, load in loads if load is not None]
        if not pending or len(reports) != len(pending):
            return None
        pids = {p["worker_id"]: p["pid"] for p in pending}
        if before is not None:
            return before if pids == before.pids else None
        left_s = max(load["cap_ms"] - load["loading_ms"] for load in reports) / 1000
        return cls(pids, now + left_s, max(load["cap_ms"] for load in reports) / 1000)


def _wait_on_loading(
    status: dict[str, Any],
    before: _StillLoading | None,
    begun: float,
    wait_s: float,
    logfile: Path,
) -> _StillLoading:
    """Past ``--wait-s``: whether the start waits on (``_StillLoading.judge``); says
    so the first time, with what the node serves meanwhile.

    Raises:
        click.ClickException: a worker not ready is not loading (any more).
    """
    processes: list[WorkerStatus] = status.get("processes", [])
    now = time.monotonic()
    loading = _StillLoading.judge(processes, before, now)
    if loading is None:
        raise click.ClickException(
            f"workers not ready after {now - begun:.0f}s"
            f"{_not_ready_reasons(processes)}; see {logfile}"
        )
    if before is None:
        click.echo(
            f"workers still loading after {wait_s:g}s and making progress "
            f"({_loading_words(processes)}); waiting while they progress, "
            f"at most {loading.until - begun:.0f}s in all (a worker whose load makes no "
            f"progress for workers.ready_timeout_ms is killed, and the start "
            f"fails). {_serving_words(status)}"
        )
    return loading


def _loading_words(processes: list[WorkerStatus]) -> str:
    """``llm-0: 12.3s CPU, 180 MiB`` for each loading worker."""
    words = []
    for p in processes:
        loading = p.get("loading")
        if p["state"] == "starting" and loading is not None:
            words.append(
                f"{p['worker_id']}: {loading['cpu_s']:.1f}s CPU, "
                f"{format_size(loading['rss_bytes'])} in {loading['loading_ms'] / 1000:.0f}s"
            )
    return "; ".join(words)


def _serving_words(status: dict[str, Any]) -> str:
    """What the node serves meanwhile: its health line (``node.service.health.judge``),
    e.g. ``serving (rules only): model 0/1 ready, rules ready, ...`` in degrade mode."""
    health = judge(status)
    if health.ready:
        return f"Meanwhile the node answers: {health.line}."
    return f"Meanwhile the node cannot answer yet: {health.line}."


def _not_ready_reasons(processes: list[WorkerStatus]) -> str:
    """``: llm-0 restarting (not READY within ...)`` for each worker not ready, or ""."""
    words = [
        f"{p['worker_id']} {p['state']}" + (f" ({p['last_exit']})" if p["last_exit"] else "")
        for p in processes
        if p["state"] != "ready"
    ]
    return ": " + "; ".join(words) if words else ""


def _exit_reason(logfile: Path) -> str:
    """The node's own error line (click's "Error: ..."), else the log's tail."""
    tail = logfile.read_text(errors="replace").splitlines()[-15:]
    errors = [line.removeprefix("Error: ") for line in tail if line.startswith("Error: ")]
    return errors[-1] if errors else "\n" + "\n".join(tail)


def _stop_started(proc: subprocess.Popen[bytes], config: NodeConfig) -> str:
    """Stop the node this start launched (its own child: the pid cannot have been
    reused while unreaped); returns what happened, for the error message."""
    if proc.poll() is not None:
        return f"(the node, pid {proc.pid}, has exited)"
    proc.terminate()
    # The node's own stop: drain within stop_grace_ms, then the workers get as
    # long again; the margin covers the cgroups' removal.
    grace_s = 2 * config.workers.stop_grace_ms / 1000 + STOP_MARGIN_S
    try:
        proc.wait(grace_s)
        return f"the node it started (pid {proc.pid}) was stopped"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return (
            f"the node it started (pid {proc.pid}) did not stop within {grace_s:g}s and was "
            "killed; the next start reaps its cgroups"
        )


@cli.command()
@click.option(
    "--timeout-s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Wait this long for exit.",
)
@click.pass_context
def stop(ctx: click.Context, timeout_s: float) -> None:
    """Stop the running node (drain, then stop workers). Exit 0 also if none runs.

    A stopped node (SIGSTOP) is continued after its SIGTERM (SIGCONT, to it and its
    workers) and stops as any other.

    Only the process holding the run directory's lock is signalled, and only if
    it is an edgenode start (a node, or a background start still launching one,
    which then stops its node); the pidfile is never trusted for that. Another
    process holding the lock is named, not signalled, and the exit is 1. The
    lock is followed until nobody holds it: a start that finished meanwhile has
    handed it to its node, which is stopped in turn. If nobody holds it, starts
    already running that have not taken their lock yet are waited for (at most
    ``START_LOCK_WAIT_S``), so ``start & stop`` stops that start.
    """
    config = node_config(ctx)
    deadline = time.monotonic() + timeout_s
    stopped: list[str] = []
    waited = False
    while True:
        try:
            holder = signal_holder(config.run_dir, signal.SIGTERM)
        except ForeignHolderError as exc:
            raise click.ClickException(f"{exc.message}; nothing was signalled") from exc
        except (PermissionError, psutil.AccessDenied) as exc:
            raise click.ClickException(
                f"not permitted to stop the edgenode of {config.run_dir} (another user's?): {exc}"
            ) from exc
        if holder is None:
            if waited or stopped:
                break
            # A start launched just before this stop may not hold its lock yet.
            waited = True
            wait_for_starts(min(START_LOCK_WAIT_S, max(0.0, deadline - time.monotonic())))
            continue
        stopped.append(_what(holder))  # before it exits: its command line goes with it
        _resume(holder)
        while _alive(holder):
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"edgenode (pid {holder.pid}) did not stop within {timeout_s:g}s"
                )
            time.sleep(0.1)
    if not stopped:
        click.echo("edgenode is not running" + _not_a_dir(config.run_dir))
        return
    click.echo("edgenode stopped (" + "; ".join(stopped) + ")")


def _resume(holder: psutil.Process) -> None:
    """SIGCONT the node just sent SIGTERM, and its workers: a stopped process
    (SIGSTOP, a job-control stop) keeps SIGTERM pending and cannot act on it, nor
    answer its node's stop, until it is continued. A running one ignores SIGCONT
    (no edgenode process handles it)."""
    with contextlib.suppress(psutil.Error):
        family = [holder, *holder.children(recursive=True)]
        for proc in family:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGCONT)


def _what(proc: psutil.Process) -> str:
    """``pid N``, marked when it is a background start still launching its node."""
    if not is_launcher(proc):
        return f"pid {proc.pid}"
    return f"pid {proc.pid}, a start still launching its node"


def _alive(proc: psutil.Process) -> bool:
    # is_running() also checks the start time (a reused pid is not ours); a
    # zombie has exited, its parent just has not reaped it yet.
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@cli.command()
@click.option(
    "--ready",
    is_flag=True,
    help="Print nothing; exit 0 only if the node can serve now, 1 if it answers but "
    "cannot (starting, stopping, no worker ready for its routing mode), 3 if none runs "
    f"(for probes; at most {READY_WAIT_MS} ms).",
)
@click.option("--watch", is_flag=True, help="Refresh the view, with rates, until Ctrl-C.")
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="--watch: seconds between refreshes.",
)
@click.option("--count", type=click.IntRange(min=1), hidden=True, help="--watch: N refreshes.")
@click.pass_context
def status(
    ctx: click.Context, ready: bool, watch: bool, interval: float, count: int | None
) -> None:
    """Show workers, queue and counters of the running node (exit 3 if none runs)."""
    # --ready: node.service.health.judge's rule (README, "Health probes").
    if ready and watch:
        raise click.UsageError("--ready and --watch do not go together")
    as_json = wants_json(ctx)
    config = node_config(ctx)
    # The node of the run dir recorded where it listens: no -c needed to find it.
    record = read_node_record(config.run_dir)
    if record is not None:
        config = dataclasses.replace(
            config, node=dataclasses.replace(config.node, frontend=record.frontend)
        )
    address = connect_endpoint(config.frontend)
    holder = _holder(config.run_dir)
    try:
        secured = _status_keys(config, holder, record)
    except click.ClickException as exc:
        # This host cannot ask: say so, on stderr even for --ready (a broken setup,
        # not a state of the node), and exit 3, no answer.
        click.echo(f"edgenode status: {exc.message}", err=True)
        if as_json and not ready:
            click.echo(json.dumps(_unanswered(config, holder, exc.message)))
        sys.exit(EXIT_NOT_RUNNING)
    if secured is None:  # no local key and no node: nothing to ask, nothing to make
        _not_running(config, holder, address, as_json, ready)
    if ready:
        with Client(address, wait_ms=READY_WAIT_MS, **secured) as client:
            try:
                health = judge(client.status())
            except EdgeNodeError:
                sys.exit(EXIT_NOT_RUNNING)
        sys.exit(0 if health.ready else 1)
    with Client(address, wait_ms=2000, **secured) as client:
        if watch:
            answered = watch_status(
                lambda: _status_or_none(client), render_status, interval, count, as_json
            )
            sys.exit(0 if answered else EXIT_NOT_RUNNING)
        node = _status_or_none(client)
    if node is None:
        _not_running(config, _holder(config.run_dir), address, as_json, ready)
    if as_json:
        click.echo(json.dumps({"running": True, **node}, indent=2, sort_keys=True))
        return
    click.echo(render_status(node))


def _not_a_dir(run_dir: Path) -> str:
    """A note for "not running" when ``run_dir`` exists but is no directory (a
    mistyped --run-dir naming a file): no node can run there, and ``start`` refuses
    it; else ""."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"; run dir {run_dir} is not a directory: no node can use it"
    return ""


def _holder(run_dir: Path) -> psutil.Process | None:
    """The live process holding the run directory's lock (a node, or a start
    launching one), or None."""
    with contextlib.suppress(psutil.Error, OSError):
        holder = lock_holder(run_dir)
        if holder is not None and _alive(holder):
            return holder
    return None


def _no_answer(holder: psutil.Process | None, address: str) -> str:
    """Why nothing answered on ``address``, as far as this host can tell: no
    process holds the lock, or it does (a stopped one, ``SIGSTOP`` or a job
    control stop, cannot answer) and says nothing."""
    if holder is None:
        return f"edgenode is not running (no answer on {address})"
    try:
        state = holder.status()
    except psutil.Error:
        return f"edgenode is not running (no answer on {address})"
    if is_launcher(holder):
        return (
            f"edgenode is starting: pid {holder.pid}, a start still launching its node "
            f"(no answer on {address} yet)"
        )
    if state in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        hint = f"stopped? its state is {state}; kill -CONT {holder.pid} resumes it"
    else:
        hint = f"busy or hung? its state is {state}"
    return f"edgenode pid {holder.pid} is alive but does not answer on {address} ({hint})"


def _unanswered(config: NodeConfig, holder: psutil.Process | None, reason: str) -> dict[str, Any]:
    """``status --json`` when no status map could be had: ``running`` false (not
    serving), the lock holder's ``pid`` and process ``state`` (None: none), and why."""
    state = None
    with contextlib.suppress(psutil.Error):
        state = holder.status() if holder is not None else None
    return {
        "running": False,
        "frontend": config.frontend,
        "pid": holder.pid if holder is not None else None,
        "state": state,
        "reason": reason,
    }


def _not_running(
    config: NodeConfig,
    holder: psutil.Process | None,
    address: str,
    as_json: bool,
    ready: bool,
) -> NoReturn:
    """Say why no node answered (nothing with ``--ready``) and exit 3."""
    if not ready:
        reason = _no_answer(holder, address) + _not_a_dir(config.run_dir)
        click.echo(json.dumps(_unanswered(config, holder, reason)) if as_json else reason)
    sys.exit(EXIT_NOT_RUNNING)


def _status_keys(
    config: NodeConfig, holder: psutil.Process | None, record: NodeRecord | None
) -> dict[str, Any] | None:
    """``_keys`` for ``status``, which never makes a local key: a node reads its
    allowlist, the local key included, when it starts, so a key made now would not
    be let in. None when the key is missing and no node runs (nothing to ask).
    The node's ``record`` (its pidfile), if any, says whether its frontend is CURVE
    and its server key, whatever the config says.

    Raises:
        click.ClickException: a node runs (``holder``) and the local key cannot be
            read, or the server key cannot be.
    """
    if record is None:
        curve = bool(config.security.server_secret_key)
    else:
        curve = record.server_public_key is not None
    if curve:
        key = local_key_file(config.run_dir)
        try:
            key.open("rb").close()
        except OSError as exc:
            if holder is None and isinstance(exc, FileNotFoundError):
                return None
            raise click.ClickException(
                f"cannot read the node's client key {key}: {exc.strerror or exc} "
                "(the node makes it when it starts; a restart makes a new one)"
            ) from exc
    if record is None:
        return _keys(config)
    if record.server_public_key is None:
        return {}
    local = local_keypair(config.run_dir)  # exists: checked above
    return {
        "server_public_key": record.server_public_key,
        "client_keypair": (local.public, local.secret),
    }


def _status_or_none(client: Client) -> dict[str, Any] | None:
    """The node's status map, or None when no node answers within the client's wait."""
    try:
        return client.status()
    except EdgeNodeError:
        return None


@cli.command()
@click.argument("text")
@click.option("--stream", is_flag=True, help="Print tokens as they arrive.")
@click.option("--max-tokens", default=128, show_default=True, type=int)
@click.option("--timeout-ms", type=int, help="Request budget (default: the node's).")
@click.option("--raw", is_flag=True, help="Plain completion of TEXT (no chat template).")
@click.option(
    "--route",
    type=click.Choice(["auto", "llm", "rules"]),
    default="llm",
    show_default=True,
    help="llm asks the model, rules the rule engine; auto follows the node's migration "
    "mode, as apps' requests do by default.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0.0),
    default=None,
    help="Sampling temperature; 0 = greedy (the same answer every time with "
    "--no-cache-prompt on an otherwise idle worker at a fixed thread count: "
    "workers.adaptive_threads = false). Default: the node's 0.8.",
)
@click.option(
    "--cache-prompt/--no-cache-prompt",
    default=True,
    show_default=True,
    help="Reuse the prompt prefix a slot's KV cache holds; --no-cache-prompt evaluates "
    "the whole prompt (reproducible greedy answers, at its whole prompt's time).",
)
@click.pass_context
def ask(
    ctx: click.Context,
    text: str,
    stream: bool,
    max_tokens: int,
    timeout_ms: int | None,
    raw: bool,
    route: str,
    temperature: float | None,
    cache_prompt: bool,
) -> None:
    """Ask the running node TEXT and print the answer with its usage counts
    (``--json``: the whole final reply as JSON, an error reply's too, exit 1)."""
    as_json = wants_json(ctx)
    config = node_config(ctx)
    fields: dict[str, Any] = {"max_tokens": max_tokens, "route": route}
    if timeout_ms is not None:
        fields["timeout_ms"] = timeout_ms
    if temperature is not None:
        fields["temperature"] = temperature
    if not cache_prompt:
        fields["cache_prompt"] = False
    messages = [{"role": "user", "content": text}]
    address = connect_endpoint(config.frontend)
    secured = _keys(config)
    try:
        with Client(address, wait_ms=2000, **secured) as probe:
            probe.ping()  # fail in seconds, not after a whole budget, if no node runs
        limit = config.broker.max_body_bytes
        with Client(address, max_body_bytes=limit, **secured) as client:
            if stream:
                s = (
                    client.stream_generate(text, **fields)
                    if raw
                    else client.stream_chat(messages, **fields)
                )
                for piece in s:
                    click.echo(piece, nl=False)
                click.echo()
                reply = s.result
            else:
                reply = client.generate(text, **fields) if raw else client.chat(messages, **fields)
                if not as_json:
                    click.echo(reply.text)
    except EdgeNodeError as exc:
        if as_json:  # the error reply's fields, as the final reply's on success
            body = error_reply(
                None,
                exc.code,
                exc.message,
                retry_after_ms=exc.retry_after_ms,
                text=exc.partial_text,
                reason=exc.reason,
            )
            del body["id"]  # the client made it up; the reply's fields are what apps read
            click.echo(json.dumps(body, indent=2))
        partial = f"\npartial text: {exc.partial_text}" if exc.partial_text else ""
        retry = f" (retry after {exc.retry_after_ms} ms)" if exc.retry_after_ms else ""
        reason = f" [{exc.reason}]" if exc.reason else ""
        raise click.ClickException(
            f"{int(exc.code)} {exc.code.name}{reason}: {exc.message}{retry}{partial}"
        ) from exc
    assert reply is not None
    if as_json:
        click.echo(json.dumps(reply.raw, indent=2))
        return
    u = reply.usage
    cached = f" ({u['cached_tokens']} cached)" if "cached_tokens" in u else ""
    click.echo(
        f"[{u.get('prompt_tokens', '?')} prompt{cached} + {u.get('completion_tokens', '?')} "
        f"completion tokens, {reply.finish_reason}, {reply.total_ms} ms, "
        f"served by {reply.served_by} {reply.raw.get('worker', '')}{_degraded(reply.raw)}]",
        err=True,
    )


def _degraded(raw: dict[str, Any]) -> str:
    return f", degraded: {raw.get('degrade_reason')}" if raw.get("degraded") else ""


def _keys(config: NodeConfig) -> dict[str, Any]:
    """The ``Client`` keywords of this host's commands (``client_keys``: the node's
    local key with a CURVE frontend).

    Raises:
        click.ClickException: the server key file cannot be read.
    """
    try:
        return client_keys(config.security, config.run_dir)
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc


cli.add_command(rules)
cli.add_command(report)
cli.add_command(capacity)
cli.add_command(keys)
cli.add_command(worker)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="edgenode")
