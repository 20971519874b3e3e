"""The host agent: ``edgenode worker --connect tcp://gateway:5556``.

It runs on a board that lends its cores to a node on another board (the
gateway). It owns this board's sandbox and workers exactly as a node owns its
own, through the same ``node.pool.WorkerPool`` (core plan, cgroups, capacity
plan, supervisor with restarts and backoff), but runs no broker: its model
workers connect their DEALERs to the gateway's backend and register there as
``<name>.llm-N`` with ``host = <name>`` in READY (``broker.workers.parse_ready``).
The gateway's broker then gives them credit like its own workers, after its own
(``broker.dispatch = "local_first"``).

On a gateway whose backend has CURVE (``[security] backend_secret_key``), the
agent's workers prove the agent's keypair (``--key``, a ``NAME.key_secret`` whose
public half the gateway allowed with ``edgenode keys allow --worker``) and check
the gateway's backend public key (``--server-key``); without an allowed key a
worker gets no connection at all. A plaintext link to an address other hosts
can reach is refused unless ``security.allow_plaintext``, as on the gateway.

The agent learns that the gateway registered a worker from the worker itself
(``node.remote.registration``: the first HEARTBEAT or REQUEST of the gateway's
broker on a connection, which it sends to registered workers only). A worker
that is not registered within ``workers.ready_timeout_ms`` of its spawn (a wrong
key, a gateway down or unreachable) is killed and restarted with the pool's
backoff, as on the gateway; once registered, a lost link does not kill it (it
re-registers when the link is back, ``node.worker.WorkerLoop``). A worker that
stayed registered for ``workers.restart_backoff_max_ms`` (the longest delay: a good
run) starts its next restart from the first delay again. The agent gets no kill
verdict from the gateway (a worker the gateway declares dead gets DISCONNECT and
re-registers under a fresh identity); an exit is restarted with the backoff.

The agent writes what it knows to ``<run_dir>/agent-status.json`` each time it
changes (``agent_status``): per worker its pid, state, registrations, restarts,
failures in a row and last exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.errors import ConfigError
from broker.exits import ExitCause
from broker.workers import HOST_NAME
from node.capacity.plan import check_fits
from node.config import NodeConfig
from node.endpoints import is_loopback, parse_endpoint
from node.model import resolve_model
from node.pidfile import PIDFILE_NAME, RunLock, remove_pidfile, write_pidfile
from node.pool import WorkerPool
from node.remote.registration import REGISTERED_DIR_ENV, read_note
from node.security.keys import load_keypair, load_public
from node.supervisor import Supervisor

log = logging.getLogger("edgenode.agent")

#: The agent process's ``role`` in its log lines (``node.observe.logs``).
AGENT_ROLE = "agent"
#: How often the agent reaps exits, reads its workers' registration notes and starts
#: due restarts (s) when no signal wakes it.
TICK_S = 0.1
#: The agent's view of its workers, in its run dir (``agent_status``).
STATUS_FILE = "agent-status.json"
#: The directory of its workers' registration notes, in its run dir.
NOTES_DIR = "registered"


def agent_name(name: str | None) -> str:
    """The agent's name: ``name``, or this host's name (``socket.gethostname``).

    Raises:
        ConfigError: it does not match ``broker.workers.HOST_NAME`` (it ends the
            worker ids, ``<name>.llm-0``, and names their logs and cgroups).
    """
    chosen = name if name is not None else socket.gethostname().split(".")[0]
    if HOST_NAME.fullmatch(chosen) is None:
        raise ConfigError(f"worker --name must match {HOST_NAME.pattern}, got {chosen!r}")
    return chosen


@dataclass(frozen=True)
class AgentKeys:
    """What the agent's workers need on a CURVE backend: the gateway backend's
    public key (Z85, 40 bytes) and the file of the agent's keypair (``NAME.key_secret``,
    mode 0600: each worker reads it, so the secret is never on a command line)."""

    server_public: bytes
    key_file: Path


def agent_keys(key: str | None, server_key: str | None) -> AgentKeys | None:
    """The agent's CURVE credentials from ``--key`` and ``--server-key``, or None
    (a plaintext backend) when neither is given.

    Raises:
        ConfigError: only one of them is given, or a file is unusable (unreadable,
            no secret in ``--key``, ``--key`` readable by group or others).
    """
    if (key is None) != (server_key is None):
        raise ConfigError(
            "worker --key and --server-key go together: this agent's keypair file "
            "(NAME.key_secret) and the gateway's backend public key file (NAME.key)"
        )
    if key is None or server_key is None:
        return None
    load_keypair("worker --key", Path(key))  # refused now, not in every worker
    return AgentKeys(load_public("worker --server-key", Path(server_key)), Path(key).resolve())


def agent_config(config: NodeConfig, connect: str, keys: AgentKeys | None = None) -> NodeConfig:
    """``config`` with the workers' backend set to the gateway's ``connect`` endpoint.

    Raises:
        ConfigError: ``connect`` is not ``tcp://HOST:PORT`` (or ``ipc://PATH``, a
            gateway on this host) with a host that resolves here; or it is
            reachable from other hosts, without ``keys`` and without
            ``security.allow_plaintext`` (prompts would cross the network in clear).
    """
    endpoint = parse_endpoint("--connect", connect)
    if endpoint.transport == "tcp" and endpoint.host == "*":
        raise ConfigError(f"--connect needs the gateway's address, not a wildcard: {connect!r}")
    if keys is None and not config.security.allow_plaintext and not is_loopback(endpoint):
        raise ConfigError(
            f"--connect {connect} is reachable from other hosts without CURVE: give "
            "--key and --server-key (edgenode keys generate), or set "
            "security.allow_plaintext = true in this agent's config"
        )
    # The frontend is unused (no broker here); it must only differ from the backend.
    return dataclasses.replace(config, node=dataclasses.replace(config.node, backend=connect))


class HostAgent:
    """This board's workers, registered with a remote node's broker.

    Args:
        config: this board's config (``[workers]``, ``[model]``, ``[capacity]``,
            ``node.cpus``, ``node.run_dir`` for the pidfile, logs and the cgroup
            name); its ``node.backend`` is the gateway's (``agent_config``).
        name: the agent's name (``agent_name``), the prefix of its worker ids (``<name>.llm-N``).
        keys: its CURVE credentials for a CURVE backend (``agent_keys``), or None.

    Raises (from ``run``):
        ConfigError: the model cannot be resolved, the plan does not fit this
            board, or the run directory is held by another node or agent.
        SandboxError: ``workers.sandbox = "required"`` and cgroups cannot be used.
    """

    def __init__(self, config: NodeConfig, name: str, keys: AgentKeys | None = None) -> None:
        self.config = config
        self.name = name
        self.keys = keys
        self.run_dir = config.run_dir
        self._stop = False
        self._registrations: Registrations | None = None
        self._shown = ""

    def run(self) -> int:
        """Supervise the workers until SIGTERM/SIGINT; returns the exit code (0)."""
        c = self.config
        model = str(resolve_model(c.model.path)) if c.workers.engine == "llama" else "test"
        plan = check_fits(c)
        keys = self.keys
        pool = WorkerPool(
            c,
            model,
            None,
            self.run_dir,
            plan,
            slots=plan.slots,
            backend_key=b"" if keys is None else keys.server_public,
            key_file=None if keys is None else keys.key_file,
            host=self.name,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        notes = self.run_dir / NOTES_DIR
        notes.mkdir(mode=0o700, exist_ok=True)
        for old in notes.iterdir():  # a previous agent's workers' notes
            with contextlib.suppress(OSError):
                old.unlink()
        # Inherited by the workers it spawns (and by nothing else: the agent runs no node).
        os.environ[REGISTERED_DIR_ENV] = str(notes)
        self._registrations = Registrations(pool.supervisor, notes)
        wake_r, wake_w = socket.socketpair()
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop to reap at once
        pidfile = self.run_dir / PIDFILE_NAME
        try:
            with RunLock(self.run_dir):
                write_pidfile(pidfile)
                try:
                    self._serve(pool, wake_r)
                finally:
                    pool.stop(c.workers.stop_grace_ms / 1000)
                    remove_pidfile(pidfile)
        finally:
            signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()
        log.info("host agent %s stopped", self.name)
        return 0

    def _serve(self, pool: WorkerPool, wake: socket.socket) -> None:
        pool.open()  # cgroups before any zmq thread (the agent itself has none)
        pool.start(self._on_exit)
        log.info(
            "host agent %s: %d model workers x %d slots -> %s (%s, pid %d)",
            self.name,
            len(pool.specs),
            pool.slots,
            self.config.backend,
            "plaintext" if self.keys is None else "curve",
            os.getpid(),
        )
        wake.settimeout(TICK_S)
        assert self._registrations is not None
        while not self._stop:
            now = time.monotonic()
            self._registrations.tick(now)
            pool.supervisor.tick(now)
            self._show(pool.supervisor)
            with contextlib.suppress(TimeoutError):
                wake.recv(64)

    def _show(self, supervisor: Supervisor) -> None:
        """Write ``agent_status`` to ``STATUS_FILE`` when it changed (aside, then renamed)."""
        assert self._registrations is not None
        view = agent_status(self.name, self.config.backend, supervisor, self._registrations)
        text = json.dumps(view, indent=2, sort_keys=True)
        if text == self._shown:
            return
        path = self.run_dir / STATUS_FILE
        aside = path.with_name(f".{STATUS_FILE}")
        try:
            aside.write_text(text + "\n")
            os.replace(aside, path)
            self._shown = text
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    def _on_exit(self, worker_id: str, cause: ExitCause) -> None:
        log.warning("%s exited: %s", worker_id, cause.describe())

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self._stop = True


class Registrations:
    """What the agent knows of its workers' registration with the gateway, from their
    notes (``node.remote.registration``), and what follows from it for the supervisor.

    Args:
        supervisor: the pool's; told ``worker_ready`` when a worker's current process
            registers, which ends its READY timeout and starts its good run (the
            supervisor's, as for a node's own workers: registered for
            ``workers.restart_backoff_max_ms``, its next restart waits the first delay).
        notes: the notes' directory.
    """

    def __init__(self, supervisor: Supervisor, notes: Path) -> None:
        self.supervisor = supervisor
        self.notes = notes
        #: worker_id -> (pid, registrations).
        self.known: dict[str, tuple[int, int]] = {}

    def tick(self, now: float) -> None:
        """Read every worker's note; tell the supervisor what is new."""
        for worker_id, handle in self.supervisor.handles.items():
            pid = handle.pid
            known = self.known.get(worker_id)
            if pid is None or (known is not None and known[0] != pid):
                self.known.pop(worker_id, None)  # that process is gone
                known = None
            if pid is None:
                continue
            note = read_note(self.notes, worker_id)
            if note is None or note[0] != pid:
                continue
            if known is None:
                log.info("%s registered with the gateway (pid %d)", worker_id, pid)
                self.supervisor.worker_ready(worker_id, pid)
            elif note[1] != known[1]:
                log.info("%s registered again (pid %d, %d times)", worker_id, pid, note[1])
            self.known[worker_id] = (pid, note[1])

    def registrations(self, worker_id: str) -> int:
        """How many times the worker's current process registered (0: not yet)."""
        known = self.known.get(worker_id)
        return known[1] if known is not None else 0


def agent_status(
    name: str, connect: str, supervisor: Supervisor, registrations: Registrations
) -> dict[str, Any]:
    """The agent's view of its workers (``STATUS_FILE``): ``{"agent", "connect",
    "workers": [{worker_id, pid, state, registered, registrations, restarts,
    failures_in_row, last_exit}]}``. ``state`` is the supervisor's (``ready`` once
    registered); ``failures_in_row`` sets the next restart's delay
    (``restart_backoff_ms`` doubled per failure, at most ``restart_backoff_max_ms``)."""
    workers = []
    for row in supervisor.status():
        worker_id = row["worker_id"]
        count = registrations.registrations(worker_id)
        workers.append(
            {
                **row,
                "registered": count > 0,
                "registrations": count,
                "failures_in_row": supervisor.handles[worker_id].failures_in_row,
            }
        )
    return {"agent": name, "connect": connect, "workers": workers}
