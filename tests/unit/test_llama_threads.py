"""The compute thread policy of the llama engine (node.llama.threads) with fake
schedstat readings, the reader on a fake and on the real /proc, the broker keeping
a HEARTBEAT's ``compute_threads`` for ``status``, and the status view's THR.

Readings are built by ``Host``: per task, ns run and ns waited, advanced by the
share of each window the test says; the times are the test's own numbers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from broker.protocol import WorkerCommand
from brokerkit import BrokerHarness
from node.cli.status_view import render_status
from node.llama.threads import (
    DEMAND_MIN,
    HOLD_MAX_S,
    HOLD_S,
    STARVED_SHARE,
    STARVED_WINDOWS,
    WINDOW_S,
    Switch,
    TaskTimes,
    ThreadPolicy,
    read_task_times,
    wait_share,
)

ENGINE, OMP, IO = 101, 102, 103  # the engine thread, libgomp's worker, the worker's I/O thread


class Host:
    """Cumulative (run ns, wait ns) per task, moved on by ``advance``."""

    def __init__(self) -> None:
        self.times: dict[int, tuple[int, int]] = {ENGINE: (0, 0), OMP: (0, 0), IO: (0, 0)}
        self.now = 100.0

    def advance(self, seconds: float, waits: dict[int, float], demand: float = 1.0) -> TaskTimes:
        """``seconds`` pass; task ``t`` wanted a core ``demand`` of them (the I/O thread
        5 %) and waited ``waits[t]`` of what it wanted. Returns the new reading."""
        self.now += seconds
        for tid, (run, wait) in self.times.items():
            wanted = seconds * 1e9 * (0.05 if tid == IO else demand if tid in waits else 0.0)
            share = waits.get(tid, 0.0)
            self.times[tid] = (run + round(wanted * (1 - share)), wait + round(wanted * share))
        return dict(self.times)


def started(threads: int = 2) -> tuple[ThreadPolicy, Host]:
    policy, host = ThreadPolicy(threads), Host()
    assert policy.due(host.now)  # no window yet: the first reading begins one
    assert policy.observe(host.now, dict(host.times)) is None
    return policy, host


def quiet(host: Host) -> TaskTimes:
    return host.advance(WINDOW_S, {ENGINE: 0.02, OMP: 0.05})


def starved(host: Host, share: float = 0.9) -> TaskTimes:
    """Two busy host loops: the OpenMP thread waits ``share``, the engine thread spins
    at the barrier (it has a core: run time, no wait)."""
    return host.advance(WINDOW_S, {ENGINE: 0.0, OMP: share})


def drop(policy: ThreadPolicy, host: Host) -> Switch:
    """Starved windows in a row until the policy drops to one thread: the last decides."""
    for _ in range(STARVED_WINDOWS - 1):
        assert policy.observe(host.now + WINDOW_S, starved(host)) is None
    switch = policy.observe(host.now + WINDOW_S, starved(host))
    assert switch is not None
    return switch


def test_a_quiet_host_keeps_the_configured_threads() -> None:
    policy, host = started()
    for _ in range(100):
        assert not policy.due(host.now + WINDOW_S / 2)  # no reading inside a window
        assert policy.due(host.now + WINDOW_S)
        assert policy.observe(host.now + WINDOW_S, quiet(host)) is None
    assert policy.threads == 2 and not policy.probing


def test_one_starved_thread_drops_the_context_to_one_thread() -> None:
    """The slowest thread sets the barrier's pace: the OpenMP thread waiting 90 % is
    enough, while the engine thread (spinning at the barrier) hardly waits."""
    policy, host = started()
    switch = drop(policy, host)
    assert (switch.threads, switch.reason, switch.hold_s) == (1, "starved", HOLD_S)
    assert switch.share == pytest.approx(0.9)
    assert switch.window_s == pytest.approx(WINDOW_S)
    assert policy.threads == 1


def test_two_threads_each_waiting_under_the_line_add_up_to_a_starved_window() -> None:
    """A host loop taking half of one core: the two compute threads, moved between the
    cores by the scheduler, waited 0.30-0.46 each and 0.52-0.66 summed, and made 52.5
    tokens/s where one thread on the free core made 65.4. With the busiest thread's
    share as the signal the two-window streak almost never formed; the step waits for
    both threads' waits, so the sum is the window's share."""
    policy, host = started()
    for _ in range(STARVED_WINDOWS - 1):
        assert (
            policy.observe(host.now + WINDOW_S, host.advance(WINDOW_S, {ENGINE: 0.3, OMP: 0.28}))
            is None
        )
    switch = policy.observe(host.now + WINDOW_S, host.advance(WINDOW_S, {ENGINE: 0.31, OMP: 0.27}))
    assert switch is not None and (switch.threads, switch.reason) == (1, "starved")
    assert switch.share == pytest.approx(0.58)
    # Waits summing past the whole window are a share of 1, not more.
    before = dict(host.times)
    assert wait_share(before, host.advance(WINDOW_S, {ENGINE: 0.8, OMP: 0.9}), WINDOW_S) == 1.0


def test_the_threshold_is_the_share_not_below_it() -> None:
    policy, host = started()
    for _ in range(2 * STARVED_WINDOWS):
        below = host.advance(WINDOW_S, {ENGINE: 0.0, OMP: STARVED_SHARE - 0.01})
        assert policy.observe(host.now, below) is None
    for _ in range(STARVED_WINDOWS - 1):
        at = host.advance(WINDOW_S, {ENGINE: 0.0, OMP: STARVED_SHARE})
        assert policy.observe(host.now, at) is None
    at = host.advance(WINDOW_S, {ENGINE: 0.0, OMP: STARVED_SHARE})
    switch = policy.observe(host.now, at)
    assert switch is not None and switch.threads == 1


def test_a_lone_starved_window_is_a_burst_not_a_starved_host() -> None:
    """A node starting beside its first requests: its first window after ready had
    the busiest thread waiting 44 %, and one thread for the next 10 s cost a
    benchmark round ~12 %. Starved windows must come in a row."""
    policy, host = started()
    for _ in range(20):
        assert policy.observe(host.now + WINDOW_S, starved(host, 0.44)) is None
        assert policy.observe(host.now + WINDOW_S, quiet(host)) is None
    assert policy.threads == 2
    # An idle gap after a starved window ends the streak: a whole one is needed again.
    assert policy.observe(host.now + WINDOW_S, starved(host)) is None
    host.advance(60, {})
    policy.restart(host.now, dict(host.times))
    assert drop(policy, host).reason == "starved"


def test_threads_that_hardly_wanted_a_core_are_not_counted() -> None:
    """The worker's I/O thread waits for a core at each wake-up under load, but wants
    one for a few % of the window: it is not a compute thread."""
    host = Host()
    before = dict(host.times)
    after = host.advance(WINDOW_S, {ENGINE: 0.0, OMP: 0.0, IO: 0.99})
    assert wait_share(before, after, WINDOW_S) == pytest.approx(0.0)
    # A compute thread asleep most of the window (an idle OpenMP team) neither.
    before = dict(host.times)
    after = host.advance(WINDOW_S, {OMP: 0.99}, demand=DEMAND_MIN / 2)
    assert wait_share(before, after, WINDOW_S) is None


def test_tasks_that_started_or_ended_in_the_window_are_left_out() -> None:
    before = {ENGINE: (0, 0), 7: (0, 0)}
    after = {ENGINE: (450_000_000, 50_000_000), 8: (0, 500_000_000)}
    assert wait_share(before, after, WINDOW_S) == pytest.approx(0.1)
    assert wait_share(before, after, 0.0) is None


def test_an_idle_window_decides_nothing() -> None:
    """No compute thread wanted a core (no step ran): nothing is known of the host."""
    policy, host = started()
    assert policy.observe(host.now + 30, host.advance(30, {})) is None
    assert policy.threads == 2


def test_after_the_hold_a_probe_goes_back_and_a_quiet_probe_stays() -> None:
    policy, host = started()
    drop(policy, host)
    dropped_at = host.now
    # The hold: no reading asked for until one window before its end.
    assert not policy.due(dropped_at + HOLD_S - WINDOW_S - 0.01)
    assert policy.due(dropped_at + HOLD_S - WINDOW_S)
    host.advance(HOLD_S - WINDOW_S, {ENGINE: 0.0})  # one thread, host gone quiet
    assert policy.observe(host.now, dict(host.times)) is None  # begins the deciding window
    assert not policy.due(host.now + WINDOW_S / 2)
    one_quiet = host.advance(WINDOW_S, {ENGINE: 0.01})
    probe = policy.observe(host.now, one_quiet)
    assert probe is not None
    assert (probe.threads, probe.reason) == (2, "probe")
    assert policy.probing
    assert policy.observe(host.now + WINDOW_S, quiet(host)) is None
    assert policy.threads == 2 and not policy.probing and policy.hold_s == HOLD_S


def test_a_failed_probe_doubles_the_hold_up_to_its_ceiling() -> None:
    """One core taken by the host: one thread runs freely, two starve. Each failed
    probe doubles the hold, so the probes' cost shrinks."""
    policy, host = started()
    drop(policy, host)
    holds = []
    for _ in range(8):
        reading = host.advance(policy.hold_s - WINDOW_S, {ENGINE: 0.0})
        assert policy.observe(host.now, reading) is None  # begins the deciding window
        probe = policy.observe(host.now + WINDOW_S, host.advance(WINDOW_S, {ENGINE: 0.0}))
        assert probe is not None and probe.reason == "probe"
        failed = policy.observe(host.now + WINDOW_S, starved(host))
        assert failed is not None and (failed.threads, failed.reason) == (1, "probe_failed")
        holds.append(failed.hold_s)
    assert holds == [6.0, 12.0, 24.0, 48.0, 96.0, 160.0, 160.0, 160.0]
    assert HOLD_MAX_S == 160.0


def test_no_probe_while_one_thread_alone_is_starved() -> None:
    """Both cores busy (two host loops): one thread waits too, so would a second;
    the hold starts again instead of a probe."""
    policy, host = started()
    drop(policy, host)
    for _ in range(5):
        reading = host.advance(HOLD_S - WINDOW_S, {ENGINE: 0.9})
        assert policy.observe(host.now, reading) is None
        assert policy.observe(host.now + WINDOW_S, host.advance(WINDOW_S, {ENGINE: 0.9})) is None
        assert policy.threads == 1 and not policy.probing
    assert policy.hold_s == HOLD_S  # not a failed probe: the hold is not doubled


def test_a_restart_after_idle_begins_the_window_there() -> None:
    """The engine restarts the window at the first step after an idle gap: a starved
    first step is then judged on its own time, not diluted by the idle minutes."""
    policy, host = started()
    host.advance(120, {})  # idle
    policy.restart(host.now, dict(host.times))
    assert not policy.due(host.now + WINDOW_S / 2)
    switch = drop(policy, host)
    assert switch.threads == 1


def test_one_configured_thread_never_reads_nor_switches() -> None:
    policy, host = ThreadPolicy(1), Host()
    assert not policy.due(host.now)
    assert policy.observe(host.now + WINDOW_S, starved(host)) is None
    assert policy.threads == 1


def test_the_reader_parses_schedstat_and_skips_what_it_cannot_read(tmp_path: Path) -> None:
    for tid, text in {"11": "5000 700 3\n", "12": "9 1 1\n", "13": "garbage\n"}.items():
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(text)
    (tmp_path / "14").mkdir()  # a task that ended while the directory was read
    assert read_task_times(tmp_path) == {11: (5000, 700), 12: (9, 1)}
    assert read_task_times(tmp_path / "absent") == {}


def test_the_reader_sees_this_process_threads_run() -> None:
    """On this kernel: every thread of the process, its run time growing while it
    computes (the engine reads the same files)."""
    stop = threading.Event()
    tids: list[int] = []

    def spin() -> None:
        tids.append(threading.get_native_id())
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        while not tids:
            pass
        first = read_task_times()
        assert threading.get_native_id() in first and tids[0] in first
        while read_task_times()[tids[0]][0] == first[tids[0]][0]:
            pass  # ends when the kernel accounted more run time to the thread
    finally:
        stop.set()
        thread.join()


def test_the_broker_keeps_a_heartbeats_compute_threads_for_status() -> None:
    h = BrokerHarness()
    h.ready(b"w1", 0.0, slots=4)
    worker = h.broker.status(0.0)["workers"][0]
    assert worker["compute_threads"] is None  # no heartbeat carried it yet
    for value, shown in ((1, 1), (0, 1), ("2", 1), (True, 1), (2, 2)):
        body = {"state": "busy", "progress": 1, "compute_threads": value}
        h.worker_send(b"w1", WorkerCommand.HEARTBEAT, body, 0.1)
        assert h.broker.status(0.1)["workers"][0]["compute_threads"] == shown


def test_status_shows_fewer_compute_threads_as_now_of_configured() -> None:
    proc = {"worker_id": "llm-0", "state": "ready", "pid": 42, "restarts": 0, "cpus": [0, 1]}
    proc |= {"threads": 2, "last_exit": ""}
    reg = {"worker_id": "llm-0", "state": "busy", "credit": 0, "slots": 4}
    base = {"queue_depth": 0, "queue_bound": 1, "in_flight": 0, "credit": 0}

    def thr(compute: int | None) -> str:
        node = {**base, "processes": [proc], "workers": [{**reg, "compute_threads": compute}]}
        header, line = render_status(node).splitlines()[-2:]
        return line.split()[header.split().index("THR")]

    assert thr(1) == "1/2"
    assert thr(2) == "2"
    assert thr(None) == "2"
