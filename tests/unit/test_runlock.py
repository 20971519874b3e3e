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
from node.interpreter import module_command
from node.pidfile import (
    LOCK_FD_ENV,
    PIDFILE_NAME,
    EmbeddedHolderError,
    ForeignHolderError,
    RunLock,
    in_use_message,
    is_node_command,
    lock_holder,
    signal_holder,
    write_pidfile,
)

REPO = Path(__file__).resolve().parents[2]

#: Holds the lock on its last argument, says so, then waits for stdin to close.
HOLDER = """
import sys
from pathlib import Path
from node.pidfile import RunLock
with RunLock(Path(sys.argv[-1])):
    print("locked", flush=True)
    sys.stdin.read()
"""

#: HOLDER that also writes the pidfile as an embedded node does (``Node.start``).
EMBEDDING_HOLDER = """
import sys
from pathlib import Path
from node.pidfile import RunLock, write_pidfile
run_dir = Path(sys.argv[-1])
with RunLock(run_dir):
    write_pidfile(run_dir / "edgenode.pid", embedded=True)
    print("locked", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[subprocess.Popen[str]]:
    """Stands for a node: HOLDER run as ``python .../edgenode start DIR``, the
    command line of the entry point (``is_node_command``)."""
    script = tmp_path_factory.mktemp("bin") / "edgenode"
    script.write_text(HOLDER)
    proc = subprocess.Popen(
        [sys.executable, str(script), "start", str(tmp_path)],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
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
        # pytest is not an edgenode start: named as "another process".
        with pytest.raises(ConfigError, match=f"not an edgenode node \\(pid {os.getpid()}:"):
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


def test_signal_holder_never_signals_a_holder_that_is_not_an_edgenode_start(
    tmp_path: Path,
) -> None:
    stranger = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stranger.stdout is not None and stranger.stdout.readline().strip() == "locked"
        with pytest.raises(ForeignHolderError, match=f"pid {stranger.pid}: .* -c"):
            signal_holder(tmp_path, signal.SIGTERM)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
        assert stranger.stdin is not None and stranger.stdout is not None
        stranger.stdin.close()
        stranger.stdout.close()


#: Adopts the locked descriptor its parent handed over (``LOCK_FD_ENV``), says
#: so, then waits for stdin to close.
ADOPTER = """
import sys
from pathlib import Path
from node.pidfile import RunLock, inherited_lock_fd
with RunLock(Path(sys.argv[1]), fd=inherited_lock_fd()):
    print("adopted", flush=True)
    sys.stdin.read()
"""


def test_a_handed_over_lock_is_found_with_its_new_holder_after_the_locker_exits(
    tmp_path: Path,
) -> None:
    # /proc/locks keeps naming the process that took the lock (this test's);
    # the holder is the child that kept a descriptor carrying it.
    with RunLock(tmp_path) as lock:
        child = subprocess.Popen(
            [sys.executable, "-c", ADOPTER, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            pass_fds=(lock.fd,),
            env={**os.environ, LOCK_FD_ENV: str(lock.fd)},
        )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "adopted"
        found = lock_holder(tmp_path)
        assert found is not None and found.pid == child.pid
        with pytest.raises(ConfigError, match=f"pid {child.pid}"):
            RunLock(tmp_path).__enter__()
    finally:
        child.kill()
        child.wait()
        assert child.stdin is not None and child.stdout is not None
        child.stdin.close()
        child.stdout.close()
    assert lock_holder(tmp_path) is None
    with RunLock(tmp_path):
        pass


def test_a_descriptor_of_another_directory_is_not_adopted(tmp_path: Path) -> None:
    other = os.open(tmp_path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ConfigError, match=f"not an open descriptor of {tmp_path}"):
            RunLock(tmp_path, fd=other).__enter__()
    finally:
        os.close(other)


@pytest.mark.parametrize(
    ("cmdline", "node"),
    [
        (["/usr/bin/python3", "-m", "node.cli", "-c", "x.toml", "start"], True),
        (["python3", "-m", "node.cli", "start", "--foreground"], True),
        (module_command("node.cli", "start", "--foreground", safe_path_flag=True), True),
        (module_command("node.cli", "start", "--foreground", safe_path_flag=False), True),
        (module_command("node.cli", "stop", safe_path_flag=False), False),
        (["/venv/bin/python", "/venv/bin/edgenode", "--run-dir", "/r", "start"], True),
        (["/usr/local/bin/edgenode", "start", "--wait-s", "5"], True),
        (["python3", "-m", "node.cli", "stop"], False),
        (["/venv/bin/python", "/venv/bin/edgenode", "status"], False),
        (["flock", "-x", "/run/edgenode", "sleep", "60"], False),
        (["flock", "-x", "/run/edgenode", "start"], False),
        (["sleep", "60"], False),
        (["python3", "-c", "start"], False),
        ([], False),
    ],
)
def test_only_an_edgenode_start_counts_as_a_node(cmdline: list[str], node: bool) -> None:
    assert is_node_command(cmdline) is node


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


def test_an_app_that_embeds_a_node_is_named_as_such_and_never_signalled(tmp_path: Path) -> None:
    app = subprocess.Popen(
        [sys.executable, "-c", EMBEDDING_HOLDER, str(tmp_path)],
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert app.stdout is not None and app.stdout.readline().strip() == "locked"
        with pytest.raises(EmbeddedHolderError, match=f"embedded in an app \\(pid {app.pid}: "):
            signal_holder(tmp_path, signal.SIGTERM)
        with pytest.raises(
            ConfigError, match=f"already running, embedded in an app \\(pid {app.pid}"
        ):
            RunLock(tmp_path).__enter__()
        assert app.poll() is None
        # A pidfile that says "embedded" but names another process (here this one)
        # makes the holder no node: a stranger stays a stranger.
        write_pidfile(tmp_path / PIDFILE_NAME, embedded=True)
        with pytest.raises(ForeignHolderError, match="not an edgenode node") as refused:
            signal_holder(tmp_path, signal.SIGTERM)
        assert not isinstance(refused.value, EmbeddedHolderError)
    finally:
        app.kill()
        app.wait()
        assert app.stdin is not None and app.stdout is not None
        app.stdin.close()
        app.stdout.close()


def test_a_lock_let_go_before_the_look_is_not_called_a_running_node(tmp_path: Path) -> None:
    """Break-it finding (session 13): a start that lost a race with a stop said
    "edgenode already running (a process that just exited, ...)" with no node
    running. Nobody holds the lock when the message is made: it says what happened."""
    message = in_use_message(tmp_path, wait_s=0)
    assert message.startswith(f"{tmp_path} was locked by a node that has exited since")
    assert "already running" not in message and message.endswith("start again")
