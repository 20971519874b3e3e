"""The metrics endpoint: a Prometheus text exposition on ``[metrics] listen``, in the
broker's process (``prometheus_client``'s threaded WSGI server, one daemon thread).

No multiprocess mode: workers' figures reach the broker as they always have
(READY, heartbeats, FINAL usage) and the pool's cgroup readings are the
node's own, so one process holds every number.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    ProcessCollector,
    disable_created_metrics,
    start_http_server,
)

from broker.core import Broker
from broker.errors import ConfigError
from broker.outbox import Effects
from node.observe.events import EventMetrics
from node.observe.listen import Listen
from node.observe.state import StateCollector
from node.pool import WorkerPool

log = logging.getLogger("edgenode.metrics")


class MetricsServer:
    """Serves ``/metrics`` for one node until ``close``.

    Args:
        listen: where to bind (``node.observe.listen.parse_listen``).
        broker, pool: read on the loop's thread by ``publish`` only.

    Raises:
        ConfigError: the address cannot be bound (in use, not this host's); the
            message names ``metrics.listen``.
    """

    def __init__(self, listen: Listen, broker: Broker, pool: WorkerPool) -> None:
        # No ``*_created`` series: they double the exposition for a start time
        # that ``process_start_time_seconds`` already gives (process-wide switch).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self._failures = 0
        self.registry = CollectorRegistry()
        self.events = EventMetrics(self.registry)
        self.state = StateCollector(broker, pool)
        self.registry.register(self.state)
        # The broker process's own CPU, memory and open files (process_*).
        ProcessCollector(registry=self.registry)
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        try:
            self._server: WSGIServer
            self._server, self._thread = start_http_server(
                listen.port, addr=listen.host, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"metrics.listen {host}:{listen.port}: cannot listen: {exc.strerror or exc}"
            ) from exc
        where = "" if listen.loopback else " (not loopback: reachable from the network)"
        log.info("metrics on http://%s:%d/metrics%s", host, listen.port, where)

    def publish(self, now: float) -> None:
        """Refresh the state gauges' snapshot if due (call from the loop's tick).
        A failure is logged, never raised: metrics must not take the broker down."""
        try:
            self.state.publish(now)
        except Exception:
            self._failed("publishing the state snapshot")

    def observe(self, effects: Effects) -> None:
        """Record one batch of the broker's effects (call from ``on_effects``);
        a failure is logged, never raised, as for ``publish``."""
        try:
            self.events.observe(effects.observations, effects.transitions)
        except Exception:
            self._failed("recording the broker's observations")

    def _failed(self, what: str) -> None:
        """Log the first failure with its traceback, later ones in one line (a
        failure that repeats every loop turn must not flood the log)."""
        if not self._failures:
            log.exception("metrics: %s failed", what)
        else:
            log.debug("metrics: %s failed again", what, exc_info=True)
        self._failures += 1

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
