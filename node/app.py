"""Composition root: wires the broker, the worker pool and (later) the fallback.

This is the only place where ``broker`` and the process side meet: the broker
reports worker events through callbacks, the supervisor reports exits back, and
neither imports the other. Signals and ``edgenode stop`` take the same path:
SIGTERM -> drain -> answer the rest -> stop workers -> remove run files.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from broker.admission import TokenCounter
from broker.core import Broker, WorkerEvent
from broker.loop import BrokerLoop
from node.config import NodeConfig
from node.engine import EngineSpec, make_token_counter
from node.model import resolve_model
from node.pidfile import remove_pidfile, write_pidfile
from node.supervisor import Supervisor
from node.worker import WorkerSpec

log = logging.getLogger("edgenode.node")


class Node:
    """A running edgenode: broker loop in this process, workers as children.

    Raises (from ``run``):
        ConfigError: the model cannot be resolved or the run directory is unusable.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.run_dir = config.run_dir
        self.pidfile = self.run_dir / "edgenode.pid"
        self._stop_requested = False

    def worker_specs(self, model_path: str) -> list[WorkerSpec]:
        """One spec per configured worker."""
        c = self.config
        engine = EngineSpec(
            kind=c.workers.engine,
            model_path=model_path,
            n_ctx=c.model.n_ctx,
            n_batch=c.model.n_batch,
            threads=c.workers.threads,
            chat_format=c.model.chat_format,
            repack=c.model.repack,
            test_token_ms=c.workers.test_token_ms,
            test_load_ms=c.workers.test_load_ms,
        )
        return [
            WorkerSpec(
                worker_id=f"llm-{i}",
                backend=c.backend,
                engine=engine,
                heartbeat_interval_ms=c.broker.heartbeat_interval_ms,
                heartbeat_liveness=c.broker.heartbeat_liveness,
            )
            for i in range(c.workers.count)
        ]

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the exit code (0 on a clean stop)."""
        c = self.config
        model = str(resolve_model(c.model.path)) if c.workers.engine == "llama" else "test"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o700)
        write_pidfile(self.pidfile)
        specs = self.worker_specs(model)
        supervisor = Supervisor(
            specs,
            log_dir=self.run_dir / "logs",
            ready_timeout_s=c.workers.ready_timeout_ms / 1000,
            backoff_s=c.workers.restart_backoff_ms / 1000,
            backoff_max_s=c.workers.restart_backoff_max_ms / 1000,
            log_level=c.node.log_level,
        )
        broker = Broker(
            c.broker,
            status_hook=lambda: self._status_extra(supervisor, model),
            count_tokens=self._token_counter(specs),
        )
        loop = BrokerLoop(
            broker,
            c.frontend,
            c.backend,
            on_event=lambda ev: self._on_worker_event(supervisor, ev),
            on_tick=supervisor.tick,
        )
        supervisor.on_exit = lambda wid, reason: broker.worker_exited(wid, reason, time.monotonic())
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        signal.set_wakeup_fd(wake_w.fileno())
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # SIGCHLD only needs to wake the loop so an exited worker is reaped at once.
        signal.signal(signal.SIGCHLD, lambda *_: None)
        loop.add_fd(wake_r.fileno(), lambda: _drain_fd(wake_r))
        try:
            supervisor.start()
            log.info(
                "edgenode serving on %s (%d workers, pid %d)",
                c.frontend,
                c.workers.count,
                os.getpid(),
            )
            while not self._stop_requested:
                loop.turn()
            self._drain(loop, broker, supervisor)
        finally:
            supervisor.stop(c.workers.stop_grace_ms / 1000)
            loop.close()
            signal.set_wakeup_fd(-1)
            wake_r.close()
            wake_w.close()
            for name in ("frontend.sock", "workers/backend.sock"):
                (self.run_dir / name).unlink(missing_ok=True)
            remove_pidfile(self.pidfile)
            log.info("edgenode stopped")
        return 0

    @staticmethod
    def _token_counter(specs: list[WorkerSpec]) -> TokenCounter | None:
        """The broker's prompt-token counter, or None (workers still check sizes)."""
        if not specs:
            return None
        try:
            return make_token_counter(specs[0].engine)
        except Exception as exc:  # a model llama.cpp cannot read: workers will say why
            log.warning("no token counter (%s); prompt sizes are checked by workers only", exc)
            return None

    def _drain(self, loop: BrokerLoop, broker: Broker, supervisor: Supervisor) -> None:
        """No new work; let in-flight requests finish within the grace, answer the rest."""
        log.info("draining %d request(s)", broker.pending_jobs())
        broker.draining = True
        supervisor.stopping = True
        deadline = time.monotonic() + self.config.workers.stop_grace_ms / 1000
        while broker.pending_jobs() and time.monotonic() < deadline:
            loop.turn(max_wait_s=0.05)
        broker.abort_all("node is shutting down")
        loop.flush()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        self._stop_requested = True

    @staticmethod
    def _on_worker_event(supervisor: Supervisor, event: WorkerEvent) -> None:
        if event.kind == "ready":
            supervisor.worker_ready(event.worker_id, event.pid)
        elif event.kind == "lost":
            supervisor.worker_lost(event.worker_id, event.pid, event.reason)

    def _status_extra(self, supervisor: Supervisor, model: str) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "model": model,
            "engine": self.config.workers.engine,
            "endpoints": {"frontend": self.config.frontend, "backend": self.config.backend},
            "run_dir": str(self.run_dir),
            "processes": supervisor.status(),
            "all_ready": supervisor.all_ready(),
        }


def _drain_fd(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except BlockingIOError:
        pass


def log_path(run_dir: Path) -> Path:
    """Where a background node writes its own log."""
    return run_dir / "logs" / "node.log"
