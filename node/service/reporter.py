"""The node's side of systemd's notify protocol, driven by the broker loop's turn.

The seam: ``BrokerLoop`` (``broker.loop``, the broker's only zmq module) calls
its ``on_tick`` hook once per turn, after the poll, the reads and
``Broker.tick``; the node composes that hook (``node.app``) and calls
``ServiceReporter.turn`` from it. So a ``WATCHDOG=1`` ping proves that a whole
turn of the broker's own loop completed, and a loop wedged anywhere in its turn
(a blocking call, a livelock in the core) stops the pings and gets the node
restarted. The broker imports nothing of the node or of systemd, and the loop
needs no new hook: the node also caps each poll (``Notifier.max_wait_s``), so
an idle loop still turns often enough to ping on time.
"""

from __future__ import annotations

import faulthandler
from typing import Any

from broker.core import Broker
from node.service.health import judge
from node.service.notify import Notifier
from node.supervisor import Supervisor

#: How often the state line is recomputed (s): the loop may turn thousands of
#: times a second under load, and the line changes on the scale of seconds.
CHECK_S = 0.25


class ServiceReporter:
    """Sends ``READY=1`` once every worker is ready (what ``edgenode start``
    waits for), ``STATUS=`` when the one-line state (``node.service.health``)
    changes, ``WATCHDOG=1`` when due and ``STOPPING=1`` on ``stopping``.

    Args:
        notifier: where the messages go (a no-op one outside systemd).
        broker: read for the registered workers, breaker, pressure, draining.
        supervisor: read for the worker processes' states.
    """

    def __init__(self, notifier: Notifier, broker: Broker, supervisor: Supervisor) -> None:
        self.notifier = notifier
        self.broker = broker
        self.supervisor = supervisor
        self._next_check = 0.0
        if notifier.watchdog_s is not None:
            # systemd ends a silent node with SIGABRT (WatchdogSignal=): the
            # journal then shows every thread's Python stack, i.e. where it hung.
            faulthandler.enable(all_threads=True)

    def state(self, now: float) -> dict[str, Any]:
        """The part of ``status`` that ``judge`` reads, without the status hook
        (which reads cgroup files: too slow for every quarter second)."""
        return {
            "draining": self.broker.draining,
            "routing": self.broker.router.snapshot(now),
            "workers": [w.snapshot(now) for w in self.broker.workers],
            "processes": self.supervisor.status(),
            "pressure": self.broker.pressure.level,
            "cpu_pressure": self.broker.pressure.cpu,
        }

    def turn(self, now: float) -> None:
        """Called once per loop turn with monotonic seconds: the watchdog ping
        when due, then (every ``CHECK_S``) the state line and READY."""
        if not self.notifier.enabled:
            return
        self.notifier.watchdog(now)
        if now < self._next_check:
            return
        self._next_check = now + CHECK_S
        line = judge(self.state(now)).line
        if self.supervisor.all_ready():
            self.notifier.ready(line)
        else:
            self.notifier.status(line)

    def stopping(self, now: float) -> None:
        """``STOPPING=1`` with the state line (call once ``broker.draining`` is set)."""
        self.notifier.stopping(judge(self.state(now)).line)
