"""Liveness: heartbeats, and the verdicts that a worker is dead, stalled or hung.

Kept apart from credit on purpose (the Paranoid Pirate queue mixed them up and
dispatched to busy workers): *alive* is driven by any traffic and by the
progress counter in heartbeats and partials; a heartbeat never grants credit
(``broker.dispatch``).

* **dead**: silent for ``heartbeat_interval_ms`` x ``heartbeat_liveness``;
* **stalled**: busy with a progress counter frozen for ``stall_timeout_ms``;
* **hung**: no ack to a CANCEL within ``cancel_grace_ms``, while its progress
  stopped too (a multi-slot worker still producing tokens gets more graces).
  The grace is the cancelled job's ``ack`` timer (``broker.jobs``), so that all
  of a job's timers fire in one order; ``Liveness`` only judges it.

A broker that did not run for two heartbeat intervals or more (SIGSTOP, a VM or
swap stall, a core it shares with the workers taken) forgives its workers that
time beyond one interval (``excuse``). ``Liveness`` only gives the
verdicts; what happens to a lost worker's requests is the core's
(``broker.core.Broker``). Times are monotonic seconds.
"""

from __future__ import annotations

from broker.exits import Verdict
from broker.outbox import Outbox
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings
from broker.workers import WorkerRegistry, WorkerState

#: Heartbeat intervals between two of the broker's ticks beyond which it paused: it
#: ticks at least once an interval (the loop waits at most until the next heartbeat
#: is due), a few ms late on a busy host.
PAUSE_TICKS = 2


class Liveness:
    """The heartbeat schedule, the broker's own pauses, and the verdicts.

    Args:
        settings: the broker's knobs (heartbeat, stall and cancel timings).
        workers: the registry whose workers it judges.
        outbox: where the heartbeats go.
    """

    def __init__(self, settings: BrokerSettings, workers: WorkerRegistry, outbox: Outbox) -> None:
        self.settings = settings
        self.workers = workers
        self.outbox = outbox
        self.next_heartbeat = 0.0
        #: When ``verdicts`` last ran, to notice the broker's own pauses.
        self._last_tick: float | None = None

    # ------------------------------------------------------------------ news

    @staticmethod
    def heard_from(worker: WorkerState, now: float) -> None:
        """Any message from ``worker`` shows it alive."""
        worker.last_seen = now

    @staticmethod
    def note_progress(worker: WorkerState, progress: object, now: float) -> None:
        """``worker`` reported its progress counter (tokens processed)."""
        if isinstance(progress, int) and progress != worker.progress:
            worker.progress = progress
            worker.progress_at = now

    # ------------------------------------------------------------------ verdicts

    def verdicts(self, now: float) -> list[tuple[WorkerState, Verdict]]:
        """Workers to give up on at ``now``, with the verdict: ``dead`` (silent
        for liveness x interval; any traffic counts) or ``stalled`` (busy with a
        frozen progress counter). Every worker is checked, busy ones included (the
        zguide broker only purged idle ones)."""
        s = self.settings
        interval = s.heartbeat_interval_ms / 1000
        dead_after = interval * s.heartbeat_liveness
        if self._last_tick is not None and now - self._last_tick > PAUSE_TICKS * interval:
            # The workers' silence while the broker did not run is no evidence: those
            # that gave up on it re-registered with READYs still unread, and a pause
            # that froze a worker too (one core, a stolen vCPU) left it no time to
            # speak. Only the time beyond one normal interval between ticks is
            # forgiven (test_core.py::test_the_brokers_own_pause_is_not_held_against_its_workers,
            # ::test_a_broker_pause_shorter_than_the_window_is_not_held_against_its_workers).
            self._excuse(now - self._last_tick - interval)
        self._last_tick = now
        stall_after = s.stall_timeout_ms / 1000
        out: list[tuple[WorkerState, Verdict]] = []
        for w in self.workers:
            if now - w.last_seen > dead_after:
                out.append((w, "dead"))
            elif w.active and now - w.progress_at > stall_after:
                out.append((w, "stalled"))
        return out

    def ack_overdue(self, worker: WorkerState, late_since: float, now: float) -> float | None:
        """The grace for ``worker``'s ack of a CANCEL ran out at ``now`` (first at
        ``late_since``): when to look again (its progress counter moved during the
        grace), or None: it is hung.

        A multi-slot worker acks a cancel after its current step, which under host
        CPU load can outlast the grace while its other slots go on producing
        tokens; killing it would cost all its slots. Such a worker gets more
        graces, up to ``stall_timeout_ms`` in all.
        """
        grace = self.settings.cancel_grace_ms / 1000
        working = worker.progress_at > now - grace
        if working and now - late_since < self.settings.stall_timeout_ms / 1000:
            return now + grace
        return None

    # ------------------------------------------------------------------ heartbeats

    def heartbeats(self, now: float) -> None:
        """Send every registered worker a HEARTBEAT if one is due at ``now``."""
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.settings.heartbeat_interval_ms / 1000
        for worker in self.workers:
            self.outbox.worker(worker.identity, WorkerCommand.HEARTBEAT, {})

    def _excuse(self, seconds: float) -> None:
        """Move every worker's ``last_seen`` and ``progress_at`` ``seconds`` later:
        time in which the broker did not look does not count against them."""
        for w in self.workers:
            w.last_seen += seconds
            w.progress_at += seconds
