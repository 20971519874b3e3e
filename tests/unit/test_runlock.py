"""The run-directory lock (real flocks) and the endpoint check (real sockets)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.errors import ConfigError
from node.endpoints import check_free
from node.pidfile import RunLock, lock_holder, signal_holder

#: Holds the lock on argv[1], says so, then waits for stdin to close.
HOLDER = """
import sys
from pathlib import Path
from node.pidfile import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.close()
    proc.stdout.close()


def test_a_second_lock_on_the_directory_is_refused_naming_the_holder(tmp_path: Path) -> None:
    assert lock_holder(tmp_path) is None
    with RunLock(tmp_path):
        holder = lock_holder(tmp_path)
        assert holder is not None and holder.pid == os.getpid()
        with pytest.raises(ConfigError, match=f"already running \\(pid {os.getpid()},"):
            RunLock(tmp_path).__enter__()
    assert lock_holder(tmp_path) is None  # released on exit
    with RunLock(tmp_path):
        pass


def test_the_lock_ends_with_its_process(tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    found = lock_holder(tmp_path)
    assert found is not None and found.pid == holder.pid
    holder.kill()
    holder.wait()
    assert lock_holder(tmp_path) is None
    with RunLock(tmp_path):
        pass


def test_signal_holder_signals_the_lock_holder_only(
    tmp_path: Path, holder: subprocess.Popen[str]
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    assert signal_holder(other, signal.SIGTERM) is None  # nobody holds it: nothing sent
    signalled = signal_holder(tmp_path, signal.SIGTERM)
    assert signalled is not None and signalled.pid == holder.pid
    assert holder.wait(10) == -signal.SIGTERM


def test_a_child_process_does_not_inherit_the_lock(tmp_path: Path) -> None:
    with RunLock(tmp_path):
        child = subprocess.Popen(["sleep", "60"], close_fds=False)
    try:
        assert lock_holder(tmp_path) is None
        with RunLock(tmp_path):
            pass
    finally:
        child.kill()
        child.wait()


def test_an_ipc_socket_in_use_is_named_and_a_stale_one_is_free() -> None:
    # A short path: unix socket addresses hold at most 107 bytes.
    with tempfile.TemporaryDirectory(prefix="en-") as tmp:
        path = f"{tmp}/f.sock"
        live = socket.socket(socket.AF_UNIX)
        live.bind(path)
        live.listen()
        with pytest.raises(ConfigError) as info:
            check_free("node.frontend", f"ipc://{path}")
        assert f"node.frontend ipc://{path} is already in use by pid {os.getpid()}" in str(
            info.value.message
        )
        live.close()  # the file stays, nobody serves it: stale
        assert Path(path).exists()
        check_free("node.frontend", f"ipc://{path}")


def test_a_tcp_port_in_use_is_named() -> None:
    with socket.socket() as live:
        live.bind(("127.0.0.1", 0))
        live.listen()
        port = live.getsockname()[1]
        for endpoint in (f"tcp://127.0.0.1:{port}", f"tcp://*:{port}"):
            with pytest.raises(ConfigError, match=f"in use by pid {os.getpid()}"):
                check_free("node.frontend", endpoint)
