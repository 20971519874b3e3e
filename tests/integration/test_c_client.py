"""The C client of examples/c, compiled with the system's cc and pkg-config and
run against a real node (test engine): a generate and a stream, printed."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from node.testing import REPO, NodeProcess

SOURCE = REPO / "examples" / "c" / "edgenode_client.c"
#: msgpack-c's pkg-config module is "msgpack-c" from 6.0 on, "msgpack" before (Debian 12: 4.0).
MSGPACK_MODULES = ("msgpack-c", "msgpack")
PROMPT = "Robot arm status: all joints nominal"


def _pkg_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["pkg-config", *args], capture_output=True, text=True, check=False)


def _build_flags() -> list[str]:
    """``pkg-config --cflags --libs`` for libzmq and msgpack-c, or skip saying what is missing."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) on PATH: apt-get install gcc")
    if shutil.which("pkg-config") is None:
        pytest.skip("no pkg-config on PATH: apt-get install pkg-config")
    if _pkg_config("--exists", "libzmq").returncode != 0:
        pytest.skip("libzmq's development files are missing: apt-get install libzmq3-dev")
    msgpack = next((m for m in MSGPACK_MODULES if _pkg_config("--exists", m).returncode == 0), None)
    if msgpack is None:
        pytest.skip("msgpack-c's development files are missing: apt-get install libmsgpack-dev")
    return _pkg_config("--cflags", "--libs", "libzmq", msgpack).stdout.split()


@pytest.fixture(scope="module")
def c_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client compiled as examples/c/README.md says, with warnings as errors."""
    flags = _build_flags()
    binary = tmp_path_factory.mktemp("c-client") / "edgenode_client"
    cmd = ["cc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", str(SOURCE), "-o", str(binary)]
    built = subprocess.run([*cmd, *flags], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stderr
    return binary


def run_client(binary: Path, node: NodeProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), node.frontend, *args], capture_output=True, text=True, timeout=45
    )


def test_the_c_client_generates_and_streams(
    c_client: Path, make_node: Callable[..., NodeProcess]
) -> None:
    node = make_node(workers={"count": 1})
    done = run_client(c_client, node, PROMPT, "16")
    assert done.returncode == 0, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    expected = "echo: " + PROMPT
    words = len(PROMPT.split()) + 1  # the test engine's tokens: "echo:" and each word
    assert lines[0] == f"generate text: {expected}"
    assert lines[1].startswith("generate ok finish_reason=stop served_by=llm worker=llm-0 ")
    assert f" completion_tokens={words} " in lines[1]
    partials = [line for line in lines if line.startswith("stream partial ")]
    assert [p.split(":", 1)[0] for p in partials] == [f"stream partial {i}" for i in range(words)]
    assert "".join(p.split(": ", 1)[1] for p in partials) == expected
    assert lines[-2] == f"stream text: {expected}"
    assert lines[-1].startswith(f"stream ok partials={words} finish_reason=stop served_by=llm ")
    assert done.stderr == ""


def test_the_c_client_prints_a_typed_error_and_fails(
    c_client: Path, make_node: Callable[..., NodeProcess]
) -> None:
    node = make_node(workers={"count": 1})
    done = run_client(c_client, node, "!crash now", "4")  # the worker dies running it
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("generate error 503 UNAVAILABLE reason=worker_lost "), done.stderr
    assert "stream" not in done.stdout + done.stderr  # the stream is not sent after a failure
