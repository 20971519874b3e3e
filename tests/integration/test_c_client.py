"""The C client of examples/c, compiled with the system's cc and pkg-config and
run against a real node (test engine): a generate and a stream, printed; over CURVE
with the key files ``edgenode keys generate`` writes (options and environment), a
refused key getting nothing. Against a fake node (a ROUTER of this test): a reply
that breaks PROTOCOL §4 ends it with exit 4 and a message naming the fault, and
control characters in the node's text are printed escaped."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from node.security.keys import allow, generate
from node.testing import REPO, NodeProcess, free_port

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


def run_client(
    binary: Path, node: NodeProcess, *args: str, opts: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """The client's options (``opts``: before the operands, as POSIX getopt takes
    them), the node's endpoint, then ``args``."""
    return subprocess.run(
        [str(binary), *opts, node.frontend, *args], capture_output=True, text=True, timeout=45
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


# ---- CURVE against a real node ---------------------------------------------------


@pytest.fixture
def curve_node(make_node: Callable[..., NodeProcess], tmp_path: Path) -> tuple[NodeProcess, Path]:
    """A node with CURVE on a loopback TCP frontend that allows alice (not mallory):
    (node, the directory of node.key, alice.key_secret and mallory.key_secret)."""
    keys, allowed = tmp_path / "keys", tmp_path / "clients"
    allowed.mkdir()
    for name in ("node", "alice", "mallory"):
        generate(keys, name)
    allow(keys / "alice.key", allowed)
    node = make_node(
        workers={"count": 1},
        node={"frontend": f"tcp://127.0.0.1:{free_port()}"},
        security={"server_secret_key": str(keys / "node.key_secret"), "client_keys": str(allowed)},
    )
    return node, keys


def test_the_c_client_talks_curve_with_key_files(
    c_client: Path, curve_node: tuple[NodeProcess, Path]
) -> None:
    node, keys = curve_node
    opts = ("-s", str(keys / "node.key"), "-k", str(keys / "alice.key_secret"))
    done = run_client(c_client, node, PROMPT, "16", opts=opts)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout.splitlines()[0] == f"generate text: echo: {PROMPT}"
    assert done.stdout.splitlines()[-1].startswith("stream ok partials=")
    # The same keys from the environment.
    env = {
        **os.environ,
        "EDGENODE_SERVER_KEY_FILE": str(keys / "node.key"),
        "EDGENODE_CLIENT_KEY_FILE": str(keys / "alice.key_secret"),
    }
    done = subprocess.run(
        [str(c_client), node.frontend, PROMPT, "4"], capture_output=True, text=True, env=env,
        timeout=45,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout, done.stderr)


def test_the_c_client_with_a_refused_key_gets_nothing(
    c_client: Path, curve_node: tuple[NodeProcess, Path]
) -> None:
    node, keys = curve_node
    opts = ("-t", "300", "-s", str(keys / "node.key"), "-k", str(keys / "mallory.key_secret"))
    done = run_client(c_client, node, PROMPT, "4", opts=opts)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert done.stderr.startswith("generate: no reply within 2300 ms"), done.stderr
    assert node.status()["refused"]["frontend"]["key_not_allowed"] >= 1
    # A key file without the key asked for is refused before anything is sent.
    bad = run_client(
        c_client, node, opts=("-s", str(keys / "node.key"), "-k", str(keys / "node.key"))
    )
    assert bad.returncode == 3
    assert f"the key file {keys / 'node.key'} has no valid secret-key" in bad.stderr


# ---- against a fake node -----------------------------------------------------------

#: A well-formed ``ok`` for a generate (PROTOCOL §4.2), to break one field at a time.
GOOD_OK: dict[str, Any] = {
    "status": "ok",
    "text": "fine",
    "finish_reason": "stop",
    "usage": {"prompt_tokens": 2, "completion_tokens": 1},
    "served_by": "llm",
    "worker": "llm-0",
    "degraded": False,
    "queue_ms": 0,
    "ttft_ms": 1,
    "total_ms": 2,
}

Replies = Callable[[dict[str, Any]], list[Any]]


class FakeNode:
    """A ROUTER on an ipc endpoint that answers each request with what ``replies``
    makes of its body: msgpack-able bodies (framed as EDGE/C1) or raw frame lists
    (``list[bytes]``, sent after the client's routing id as they are)."""

    def __init__(self, endpoint: str, replies: Replies) -> None:
        self.endpoint = endpoint
        self.replies = replies
        self.requests: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(endpoint)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            routing, _empty, _tag, body = self._router.recv_multipart()
            request = msgpack.unpackb(body)
            self.requests.append(request)
            for reply in self.replies(request):
                if isinstance(reply, list):
                    self._router.send_multipart([routing, *reply])
                else:
                    packed = msgpack.packb({"id": request["id"], **reply})
                    self._router.send_multipart([routing, b"", b"EDGE/C1", packed])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._router.close(0)
        self._ctx.term()


@pytest.fixture
def fake_node(tmp_path: Path) -> Iterator[Callable[[Replies], FakeNode]]:
    made: list[FakeNode] = []

    def factory(replies: Replies) -> FakeNode:
        made.append(FakeNode(f"ipc://{tmp_path}/fake.sock", replies))
        return made[-1]

    yield factory
    for fake in made:
        fake.close()


def run_against(binary: Path, fake: FakeNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), "-t", "2000", fake.endpoint, *args],
        capture_output=True,
        text=True,
        timeout=30,
        errors="surrogateescape",
    )


@pytest.mark.parametrize(
    ("reply", "fault"),
    [
        ({**GOOD_OK, "text": 7}, '"text" is not a str'),
        ({k: v for k, v in GOOD_OK.items() if k != "finish_reason"}, '"finish_reason" is missing'),
        ({**GOOD_OK, "usage": [1, 2]}, '"usage" is not a map'),
        ({**GOOD_OK, "usage": {"completion_tokens": "1"}}, '"completion_tokens" is not a non-negative integer (in "usage")'),  # noqa: E501
        ({**GOOD_OK, "degraded": 0}, '"degraded" is not a bool'),
        ({**GOOD_OK, "degraded": True}, '"degrade_reason" is missing'),
        ({**GOOD_OK, "total_ms": -1}, '"total_ms" is not a non-negative integer'),
        ({**GOOD_OK, "queue_ms": 1.5}, '"queue_ms" is not a non-negative integer'),
        ({**GOOD_OK, "status": "done"}, '"status" is missing or not partial, ok or error'),
        ({"status": "error", "code": "503", "error": "UNAVAILABLE", "message": "x"}, '"code" is not a non-negative integer'),  # noqa: E501
        ({"status": "partial", "text": b"raw", "index": 0}, '"text" is not a str'),
        ([b"", b"EDGE/C1"], "2 frames, not"),
        ([b"", b"EDGE/C1", b"\xc1"], "the body is not one msgpack value"),
        ([b"", b"EDGE/C1", msgpack.packb([1, 2])], "the body is not a map"),
        ([b"", b"EDGE/C1", msgpack.packb({"status": "ok"})], '"id" is missing'),
    ],
)  # fmt: skip
def test_the_c_client_refuses_a_malformed_reply(
    c_client: Path, fake_node: Callable[[Replies], FakeNode], reply: Any, fault: str
) -> None:
    fake = fake_node(lambda _request: [reply])
    done = run_against(c_client, fake, "hello", "4")
    assert done.returncode == 4, (done.stdout, done.stderr)
    assert done.stderr.startswith("generate: malformed reply: "), done.stderr
    assert fault in done.stderr, done.stderr
    assert "generate ok" not in done.stdout and "stream" not in done.stdout
    assert len(fake.requests) == 1  # the stream is not sent after it


def test_a_well_formed_reply_with_optional_fields_is_taken(
    c_client: Path, fake_node: Callable[[Replies], FakeNode]
) -> None:
    """The fake node's well-formed replies pass (the check refuses only what breaks
    §4): a degraded rules answer with confidence and a nil rule, a late reply to
    another id first."""
    rules_ok = {
        **GOOD_OK,
        "served_by": "rules",
        "worker": "rules-0",
        "degraded": True,
        "degrade_reason": "circuit_open",
        "confidence": 0.0,
        "rule": None,
        "usage": {},
    }

    def replies(request: dict[str, Any]) -> list[Any]:
        late = [b"", b"EDGE/C1", msgpack.packb({**GOOD_OK, "id": "old-1"})]
        if request.get("stream"):
            return [late, {"status": "partial", "text": "fine", "index": 0}, rules_ok]
        return [late, rules_ok]

    done = run_against(c_client, fake_node(replies), "hello", "4")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "generate ok finish_reason=stop served_by=rules worker=rules-0 degraded=1" in done.stdout
    assert done.stdout.splitlines()[-1].startswith("stream ok partials=1 ")


#: Text a model (or a fake node) may send: terminal escapes, a bell, a CR, a backspace,
#: C1's CSI, an invalid byte; and what the client must keep as it is.
NASTY = "\x1b[31mred\x07 over\r\x08 \u009b2J tab\there\nline two \u00e9\u4e2d\U0001f916 \x7f"
ESCAPED = (
    "\\x1b[31mred\\x07 over\\x0d\\x08 \\u009b2J tab\there\nline two \u00e9\u4e2d\U0001f916 \\x7f"
)


def test_the_c_client_escapes_control_characters_in_text(
    c_client: Path, fake_node: Callable[[Replies], FakeNode]
) -> None:
    def replies(request: dict[str, Any]) -> list[Any]:
        final = {**GOOD_OK, "text": NASTY, "worker": "llm-\x1b[2J"}
        if request.get("stream"):
            return [{"status": "partial", "text": NASTY, "index": 0}, final]
        return [final]

    done = run_against(c_client, fake_node(replies), "hello", "4")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\r" not in done.stdout
    assert "\u009b" not in done.stdout and "\x7f" not in done.stdout
    assert done.stdout.startswith(f"generate text: {ESCAPED}\n"), done.stdout
    assert "worker=llm-\\x1b[2J " in done.stdout
    assert f"stream partial 0: {ESCAPED}\n" in done.stdout
    assert f"stream text: {ESCAPED}\n" in done.stdout


def test_the_c_client_escapes_bytes_that_are_not_utf8(
    c_client: Path, fake_node: Callable[[Replies], FakeNode]
) -> None:
    """A str that is not UTF-8 (the node never sends one): each such byte as \\xHH,
    overlong forms and surrogates included; the valid text around it as it is."""
    raw = b"ok \xff \xc0\xaf \xed\xa0\x80 \xe2\x82 end \xc3\xa9"
    body = {**GOOD_OK, "id": "", "text": "", "worker": "w"}

    def replies(request: dict[str, Any]) -> list[Any]:
        packed = msgpack.packb({**body, "id": request["id"]}).replace(
            b"\xa4text\xa0", b"\xa4text" + bytes([0xA0 | len(raw)]) + raw
        )
        return [[b"", b"EDGE/C1", packed]]

    done = run_against(c_client, fake_node(replies), "hello", "4")
    assert done.returncode == 0, (done.stdout, done.stderr)
    first = done.stdout.splitlines()[0]
    assert first == ("generate text: ok \\xff \\xc0\\xaf \\xed\\xa0\\x80 \\xe2\\x82 end \u00e9"), (
        first
    )
