"""How many compute threads a llama worker runs with: its configured count while the
host lets them run, one while the host starves them.

llama.cpp's CPU threads compute each graph node together and meet at a barrier
after it (``#pragma omp barrier`` in this build), so a step advances only while
*every* compute thread has a core. On a host whose other processes keep the cores
busy, a thread at nice 10 gets a small share of its core, two of them rarely run
at once, and a step takes as long as the host lets both run together (two nice-0
busy loops left a 2-thread worker ~2 tokens in 30 s; one thread made 16 tokens
in 5.6 s). One thread needs no partner to progress.

The signal is each thread's own scheduler accounting: ``/proc/self/task/<tid>/schedstat``
holds the ns it ran on a CPU and the ns it waited runnable on a runqueue (Linux
``sched_info``, kernel ``Documentation/scheduler/sched-stats.rst``). Over a window,
a thread's *wait share* is ``wait / (run + wait)``: the part of the time it wanted a
core and had none (sleep is in neither term). The compute threads are the ones that
wanted a core for most of the window (``DEMAND_MIN``): the engine thread and
libgomp's worker threads while steps run; the worker's I/O thread, zmq's threads
and an idle OpenMP team want a core for a few % of it. The window's share is the
sum of theirs (at most 1): a step waits at the barrier for each thread's waits in
turn, while the threads that have a core spin there (run time, not wait), so lockstep
threads lose about the sum. Beside a loop taking half of one core, two threads waited
0.30-0.46 each (the largest alone rarely reached the line two windows in a row) and
0.52-0.66 summed, and made 52.5 tokens/s where one thread on the free core made 65.4
(docs/bench/figures.md, node.llama.threads).

``ThreadPolicy`` is the decision, pure: readings and the time are its arguments.
The engine reads, feeds it, and applies what it returns (``node.llama.engine``):

* at the configured count: ``STARVED_WINDOWS`` windows in a row whose share reaches
  ``STARVED_SHARE`` drop to one thread for ``HOLD_S`` (one window may be a burst,
  such as a process starting);
* at one thread: when the hold is over, a *probe* goes back to the configured count
  for one window, unless one thread alone still waits that much (then the other
  threads would not get a core either: the hold starts again). A probe whose
  window reaches the share drops back with the hold doubled (at most
  ``HOLD_MAX_S``), so a host with one core taken costs one failed probe per few
  minutes; a probe below it keeps the configured count and resets the hold.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

#: tid -> (ns run on a CPU, ns waited runnable on a runqueue), cumulative since the
#: task started: the first two fields of its ``schedstat``.
TaskTimes = Mapping[int, tuple[int, int]]

#: A window's wait share (summed over the compute threads) at or above which the
#: configured threads are starved. Two threads beat one while ``(1 - share) x s2 > 1``,
#: ``s2`` the quiet speedup of two threads over one (1.2-1.5 on one machine, 1.85 on
#: another: docs/bench/figures.md §node.llama.threads), i.e. below a share of
#: ``1 - 1/s2`` = 0.17-0.46. 0.4 leans to the configured count. The node's own windows
#: at 4 busy slots measured 0.04-0.06 summed; a loop taking half a core 0.52-0.66;
#: two busy host loops 0.76-1.0 for the busiest thread alone.
STARVED_SHARE = 0.4
#: s; the shortest window a decision is made on: ~12 decode steps at 4 slots,
#: long enough that one burst of another process does not decide it.
WINDOW_S = 0.5
#: Starved windows in a row that drop the configured count: a lone one may be a
#: burst (a process starting); a host that starves the threads does it in every
#: window (docs/bench/figures.md, node.llama.threads).
STARVED_WINDOWS = 2
#: Share of a window a thread must have wanted a core (run + wait) to count as
#: a compute thread. A compute thread between steps sleeps only briefly (libgomp's
#: team barrier); the worker's I/O thread wants a few % of the window.
DEMAND_MIN = 0.25
#: s; how long one thread is kept before a probe; doubled after each failed
#: probe, up to HOLD_MAX_S. A failed probe costs about one window of slow steps;
#: a hold too long costs more after a short burst, such as the node's own start
#: (its broker loads the token counter right after ready: docs/bench/figures.md).
HOLD_S = 3.0
HOLD_MAX_S = 160.0

#: Why the count changed: ``starved`` (configured -> 1), ``probe`` (1 -> configured
#: after the hold), ``probe_failed`` (the probe's window was starved: -> 1).
SwitchReason = Literal["starved", "probe", "probe_failed"]


@dataclass(frozen=True)
class Switch:
    """A change of the compute thread count, for the engine to apply and log.

    Attributes:
        threads: the count to run with from the next step.
        share: the wait share of the window that decided it (0..1).
        window_s: that window's length (s).
        reason: see ``SwitchReason``.
        hold_s: at one thread, s until the next probe; 0 otherwise.
    """

    threads: int
    share: float
    window_s: float
    reason: SwitchReason
    hold_s: float = 0.0


def wait_share(before: TaskTimes, after: TaskTimes, span_s: float) -> float | None:
    """The sum of the wait shares of the tasks that wanted a core for at least
    ``DEMAND_MIN`` of ``span_s`` between two readings, at most 1 (the module
    docstring says why the sum); None if no task did (the engine was idle) or
    ``span_s`` is not positive. Tasks absent from either reading (started or ended
    meanwhile) are left out."""
    if span_s <= 0:
        return None
    least = DEMAND_MIN * span_s * 1e9
    shares = []
    for tid, (run, wait) in after.items():
        if tid not in before:
            continue
        ran, waited = run - before[tid][0], wait - before[tid][1]
        demand = ran + waited
        if demand >= least and demand > 0:
            shares.append(waited / demand)
    return min(1.0, sum(shares)) if shares else None


class ThreadPolicy:
    """The compute thread count of one llama context (see the module docstring).

    Args:
        threads: the configured count (``EngineSpec.threads``); with 1 the policy
            never changes anything and never asks for a reading.

    Times are ``time.monotonic()`` seconds; readings are ``TaskTimes``.
    """

    def __init__(self, threads: int) -> None:
        self.configured = max(1, threads)
        self.threads = self.configured
        self.probing = False
        self.hold_s = HOLD_S
        self._start: float | None = None  # the window's start, None before a reading
        self._before: TaskTimes = {}
        self._hold_until = 0.0
        self._streak = 0  # starved windows in a row at the configured count

    def due(self, now: float) -> bool:
        """Whether the engine should read ``schedstat`` at ``now`` and call
        ``observe``: a window of ``WINDOW_S`` has passed; at one thread only from
        ``WINDOW_S`` before the hold's end (the window read there begins the one
        that decides the probe)."""
        if self.configured == 1:
            return False
        if self._start is None:
            return True
        if self.threads == 1 and now < self._hold_until - WINDOW_S:
            return False
        return now - self._start >= WINDOW_S

    def restart(self, now: float, reading: TaskTimes) -> None:
        """Begin a window at ``now`` without deciding: after the engine was idle, whose
        time says nothing of the host (its compute threads slept); a streak of
        starved windows ends there too."""
        self._start, self._before = now, reading
        self._streak = 0

    def observe(self, now: float, reading: TaskTimes) -> Switch | None:
        """End the window at ``now`` with ``reading``, begin the next one, and return
        the change of count it decides, if any."""
        if self.configured == 1:
            return None
        if self._start is None:
            self.restart(now, reading)
            return None
        span = now - self._start
        share = wait_share(self._before, reading, span)
        self._start, self._before = now, reading
        if share is None:
            return None
        if self.threads == 1:
            if now < self._hold_until:
                return None  # the window just begun ends at the hold's end
            if share >= STARVED_SHARE:  # one thread alone waits that much: stay
                self._hold_until = now + self.hold_s
                return None
            self.threads, self.probing = self.configured, True
            return Switch(self.configured, share, span, "probe")
        if share < STARVED_SHARE:
            if self.probing:
                self.probing, self.hold_s = False, HOLD_S
            self._streak = 0
            return None
        reason: SwitchReason = "starved"
        if self.probing:  # a probe is one window's trial: it fails at once
            reason, self.hold_s = "probe_failed", min(2 * self.hold_s, HOLD_MAX_S)
        else:
            self._streak += 1
            if self._streak < STARVED_WINDOWS:
                return None
        self.threads, self.probing, self._streak = 1, False, 0
        self._hold_until = now + self.hold_s
        return Switch(1, share, span, reason, self.hold_s)


def read_task_times(task_dir: Path = Path("/proc/self/task")) -> dict[int, tuple[int, int]]:
    """Each task's (run ns, wait ns) from ``<task_dir>/<tid>/schedstat``; {} where
    the kernel has no ``sched_info`` (then the policy never decides). A task that
    ends while it is read is left out. ~10 tasks: ~0.1 ms."""
    times: dict[int, tuple[int, int]] = {}
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return times
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (task_dir / tid / "schedstat").read_text().split()
            times[int(tid)] = (int(fields[0]), int(fields[1]))
    return times
