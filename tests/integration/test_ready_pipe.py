"""A background ``edgenode start`` learns that its node is ready from a pipe the node
writes to (``node.app.READY_FD_ENV``), not only from its next ``status`` poll: a real
node (``start --foreground``, the test engine) says so the moment every worker is READY,
and closes the pipe when it ends before that."""

from __future__ import annotations

import os
import select
import subprocess
from collections.abc import Iterator

import pytest

from node.app import READY_FD_ENV, inherited_ready_fd
from node.interpreter import module_command
from node.testing import REPO, NodeProcess

SLOW_LOAD = {"engine": "test", "count": 2, "test_load_ms": 1500}


@pytest.fixture
def pipe() -> Iterator[list[int]]:
    """[read end, write end]; an end closed by the test is set to -1 (its number may
    be reused at once: closing it twice could close another file)."""
    ends = list(os.pipe())
    yield ends
    for fd in ends:
        if fd >= 0:
            os.close(fd)


def launch(node: NodeProcess, ends: list[int]) -> None:
    """``node`` in the foreground, holding the write end as a background start hands it."""
    ready_w = ends[1]
    argv = module_command(
        "node.cli", "-c", str(node.config), "--run-dir", str(node.run_dir), "start", "--foreground"
    )
    with open(node.log, "ab") as out:
        node.proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=out,
            cwd=REPO,
            start_new_session=True,
            pass_fds=(ready_w,),
            env={**os.environ, READY_FD_ENV: str(ready_w)},
        )
    os.close(ready_w)  # the node holds the only write end now: its exit means EOF
    ends[1] = -1


def read_line(fd: int, timeout: float) -> bytes:
    readable, _, _ = select.select([fd], [], [], timeout)
    assert readable, "the node said nothing down its readiness pipe"
    return os.read(fd, 64)


def test_the_node_writes_ready_once_every_worker_is_ready_then_closes_the_pipe(
    pipe: list[int],
) -> None:
    r = pipe[0]
    node = NodeProcess({"workers": SLOW_LOAD})
    try:
        launch(node, pipe)
        assert read_line(r, 60) == b"\n"
        # Written when the node saw its last READY: status agrees, with no wait.
        status = node.status()
        assert status["all_ready"] is True
        assert [p["state"] for p in status["processes"]] == ["ready", "ready", "ready"]
        assert status["token_counter"] == "loaded"  # the test engine's: no vocabulary to load
        assert read_line(r, 5) == b""  # closed after its one line
    finally:
        node.cleanup()


def test_a_node_that_ends_before_it_is_ready_closes_the_pipe(pipe: list[int]) -> None:
    r = pipe[0]
    node = NodeProcess({"workers": {**SLOW_LOAD, "test_load_ms": 30_000}})
    try:
        launch(node, pipe)
        node.wait_ready(all_ready=False)  # up, its workers still loading
        assert node.stop() == 0
        assert read_line(r, 10) == b""  # EOF, no "ready" line
    finally:
        node.cleanup()


def test_only_an_open_pipe_is_taken_and_the_variable_is_not_passed_on(
    pipe: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    w = pipe[1]
    monkeypatch.setenv(READY_FD_ENV, str(w))
    assert inherited_ready_fd() == w
    assert READY_FD_ENV not in os.environ  # the workers never see it
    assert not os.get_inheritable(w)
    with open(os.devnull) as not_a_pipe:
        monkeypatch.setenv(READY_FD_ENV, str(not_a_pipe.fileno()))
        assert inherited_ready_fd() is None
    for value in ("", "x", "999999"):
        monkeypatch.setenv(READY_FD_ENV, value)
        assert inherited_ready_fd() is None
