"""A real node under a fake systemd: the test binds the datagram socket systemd
would (``$NOTIFY_SOCKET``, a path or an abstract name) with a 1 s watchdog
(``$WATCHDOG_USEC``), and reads what the node says: READY=1 once its workers
are ready, STATUS= lines when its state changes, WATCHDOG=1 pings from the
broker loop, STOPPING=1 on SIGTERM. Workers do not inherit the notify socket."""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from node.testing import REPO, NodeProcess, wait_for

#: The watchdog timeout the fake systemd gives (µs): pings due every 0.5 s.
WATCHDOG_USEC = 1_000_000


class FakeSystemd:
    """A bound ``AF_UNIX`` datagram socket collecting notify messages."""

    def __init__(self, abstract: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="en-notify-"))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            name = f"edgenode-test-{os.getpid()}-{id(self):x}"
            self.sock.bind("\0" + name)
            self.env = "@" + name
        else:
            path = self.dir / "notify.sock"
            self.sock.bind(str(path))
            self.env = str(path)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def read(self, seconds: float) -> None:
        """Collect datagrams for ``seconds``."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines())
            self.messages.append((time.monotonic(), fields))

    def until(self, predicate: Callable[[dict[str, str]], bool], timeout: float) -> dict[str, str]:
        """Read until a message satisfies ``predicate``; returns it."""
        end = time.monotonic() + timeout
        seen = len(self.messages)
        while time.monotonic() < end:
            for _, fields in self.messages[seen:]:
                if predicate(fields):
                    return fields
            seen = len(self.messages)
            self.read(0.1)
        raise AssertionError(f"no such notify message in {timeout}s: {self.messages}")

    def with_key(self, key: str) -> list[dict[str, str]]:
        return [fields for _, fields in self.messages if key in fields]

    def close(self) -> None:
        self.sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def systemd(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(abstract=request.param)
    # The node inherits the test's environment (NodeProcess.start).
    monkeypatch.setenv("NOTIFY_SOCKET", fake.env)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    yield fake
    fake.close()


def test_ready_status_watchdog_and_stopping(
    systemd: FakeSystemd, make_node: Callable[..., NodeProcess]
) -> None:
    node = make_node(
        workers={"count": 1},
        fallback={"rules": str(REPO / "etc" / "rules.toml")},
    )  # returns once every worker is ready
    systemd.until(lambda m: m.get("READY") == "1", timeout=10)
    # The line with READY=1 (or just before it, when it was news then) says serving.
    lines = [m["STATUS"] for m in systemd.with_key("STATUS")]
    assert lines[-1].startswith("serving: model 1/1 ready, rules ready"), lines
    # Periodic pings from the broker loop: about 2 a second; 2 in 3 s leaves
    # room for a loaded machine.
    systemd.read(3.0)
    pings = [t for t, m in systemd.messages if m.get("WATCHDOG") == "1"]
    assert len(pings) >= 2, systemd.messages
    assert len(systemd.with_key("READY")) == 1, systemd.messages
    # STATUS= on changes, not every turn: the state held, so no new line.
    lines = [m["STATUS"] for m in systemd.with_key("STATUS")]
    assert all(a != b for a, b in itertools.pairwise(lines)), "\n".join(lines)

    # Workers do not inherit the notify socket: only the node speaks to systemd.
    for pid in node.worker_pids():
        env = psutil.Process(pid).environ()
        assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env, env

    # A state change: the model worker killed, the rules serve meanwhile (degrade).
    (llm,) = [p for p in node.status()["processes"] if p["worker_id"] == "llm-0"]
    os.kill(llm["pid"], signal.SIGKILL)
    changed = systemd.until(lambda m: "model 0/1" in m.get("STATUS", ""), timeout=10)
    assert changed["STATUS"].startswith("serving (rules only): model 0/1 ready"), changed
    systemd.until(lambda m: "model 1/1" in m.get("STATUS", ""), timeout=20)
    wait_for(lambda: node.status()["all_ready"], timeout=10)

    assert node.proc is not None
    node.proc.send_signal(signal.SIGTERM)
    stopping = systemd.until(lambda m: m.get("STOPPING") == "1", timeout=10)
    assert stopping["STATUS"].startswith("stopping: "), stopping
    assert node.proc.wait(30) == 0


def test_no_pings_for_another_watchdog_pid(
    monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., NodeProcess]
) -> None:
    """``$WATCHDOG_PID`` naming another process: the watchdog is not the node's
    (sd_watchdog_enabled(3)); READY and STATUS still go out."""
    fake = FakeSystemd(abstract=False)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", fake.env)
        monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
        monkeypatch.setenv("WATCHDOG_PID", "1")  # init, never the node
        make_node(workers={"count": 1})
        fake.until(lambda m: m.get("READY") == "1", timeout=10)
        fake.read(1.5)  # three ping periods
        assert not [m for m in fake.messages if "WATCHDOG" in m[1]], fake.messages
    finally:
        fake.close()
