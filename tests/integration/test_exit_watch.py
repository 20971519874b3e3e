"""``node.app.ExitWatch``: an embedded node's loop learns of a worker's exit from a
pidfd (no SIGCHLD handler), with a real ``BrokerLoop`` and real child processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.core import Broker
from broker.loop import BrokerLoop
from broker.records import BrokerSettings
from node.app import ExitWatch


@pytest.fixture
def loop() -> Iterator[BrokerLoop]:
    run = Path(tempfile.mkdtemp(prefix="en-"))
    broker_loop = BrokerLoop(Broker(BrokerSettings()), f"ipc://{run}/f.sock", f"ipc://{run}/b.sock")
    yield broker_loop
    broker_loop.close()
    shutil.rmtree(run, ignore_errors=True)


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def readable(loop: BrokerLoop) -> set[int]:
    """The extra fds the loop's poller reports readable now (no wait)."""
    return {fd for fd, _ in loop.poller.poll(0) if isinstance(fd, int)}


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no os.pidfd_open on this Python")
def test_a_worker_exit_makes_its_pidfd_readable_and_sync_closes_it(loop: BrokerLoop) -> None:
    a, b = sleeper(), sleeper()
    watch = ExitWatch(loop)
    try:
        watch.sync({a.pid, b.pid})
        assert watch.available
        fds = dict(watch._fds)
        assert set(fds) == {a.pid, b.pid}
        assert readable(loop) == set()  # both alive: nothing wakes the loop
        os.kill(a.pid, signal.SIGKILL)
        # The exit alone wakes a poll of the loop (bounded, not timed: it returns
        # as soon as the process is a zombie); b's pidfd stays quiet.
        woke = {fd for fd, _ in loop.poller.poll(10_000) if isinstance(fd, int)}
        assert woke == {fds[a.pid]}
        a.wait()  # reaped, as Supervisor.tick reaps in the turn the pidfd woke
        watch.sync({b.pid})  # the supervisor no longer lists a
        assert set(watch._fds) == {b.pid}
        with pytest.raises(OSError):
            os.fstat(fds[a.pid])  # closed
        assert readable(loop) == set()
        assert fds[a.pid] not in loop._extra
    finally:
        watch.close()
        for proc in (a, b):
            proc.kill()
            proc.wait()
    assert watch._fds == {}
    assert not [fd for fd in fds.values() if fd in loop._extra]


def test_remove_fd_unregisters_only_what_was_added(loop: BrokerLoop) -> None:
    r, w = os.pipe()
    try:
        loop.add_fd(r, lambda: None)
        os.write(w, b"x")
        assert r in readable(loop)
        loop.remove_fd(r)
        loop.remove_fd(r)  # a second remove is a no-op
        assert r not in readable(loop)
        assert loop.frontend in dict(loop.poller.sockets)  # the sockets stay registered
    finally:
        os.close(r)
        os.close(w)
