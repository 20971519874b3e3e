"""Both clients over CURVE against a raw CURVE ROUTER on loopback TCP (the node's own
CURVE frontend is another branch's; this checks the client's side of the handshake).

The ROUTER is a CURVE server with ``zmq.auth``'s authenticator holding an allowlist of
client public keys (Ironhouse): the allowed client's keypair, and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from clientkit import AnyClient
from zmq.auth.thread import ThreadAuthenticator

from broker import protocol as p
from broker.client import AsyncClient, Client
from broker.errors import ConfigError, NoReply

Connect = Callable[..., AnyClient]
Keys = tuple[bytes, bytes]


class CurveRouter:
    """A CURVE ROUTER answering ``ping`` and ``generate`` (``echo: <prompt>``) from a thread."""

    def __init__(self, server: Keys, allowed_dir: Path | str) -> None:
        # A context of its own: ZAP binds inproc://zeromq.zap.01 once per context, and
        # libzmq frees an inproc name only after the socket's asynchronous close, so a
        # router sharing zmq.Context.instance() with the previous test's could find it
        # still taken (EADDRINUSE at setup, seen once in CI).
        self.ctx = ctx = zmq.Context()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        # ``allowed_dir``: the allowlist's directory, or ``zmq.auth.CURVE_ALLOW_ANY``.
        self.auth.configure_curve(domain="*", location=str(allowed_dir))
        self.served = 0
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.curve_server = True
        self._sock.curve_publickey, self._sock.curve_secretkey = server
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(10):
                continue
            peer, _, _, raw = self._sock.recv_multipart()
            body = p.unpack_map(raw)
            self.served += 1
            if body.get("op") == "ping":
                reply = p.ok_reply(body["id"], pong=True, version=1)
            else:
                reply = p.ok_reply(body["id"], text=f"echo: {body.get('prompt')}")
            self._sock.send_multipart(p.client_frames(peer, reply))
        self._sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.auth.stop()
        self.ctx.destroy(linger=0)  # the thread closed its socket; nothing else is left


def make_keys(where: Path, name: str) -> Keys:
    _, secret_file = zmq.auth.create_certificates(where, name)
    public, secret = zmq.auth.load_certificate(secret_file)
    assert secret is not None
    return public, secret


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Keys]:
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    return {
        "server": make_keys(other, "server"),
        "client": make_keys(allowed, "client"),  # its .key file is in the allowlist dir
        "stranger": make_keys(other, "stranger"),
    }


@pytest.fixture
def router(keys: dict[str, Keys], tmp_path: Path) -> Iterator[CurveRouter]:
    server = CurveRouter(keys["server"], tmp_path / "allowed")
    yield server
    server.close()


def test_an_allowed_keypair_gets_answers(
    router: CurveRouter, keys: dict[str, Keys], connect_client: Connect
) -> None:
    server_public = keys["server"][0]
    with connect_client(
        router.endpoint,
        wait_ms=5000,
        server_public_key=server_public,
        client_keypair=keys["client"],
    ) as c:
        assert c.ping()["pong"] is True
        assert c.generate("over curve").text == "echo: over curve"
    assert router.served == 2


@pytest.mark.parametrize("who", ["stranger", "ephemeral", "wrong_server_key"])
def test_a_refused_client_gets_no_reply_and_the_router_sees_nothing(
    router: CurveRouter, keys: dict[str, Keys], connect_client: Connect, who: str
) -> None:
    kwargs: dict[str, Any] = {"server_public_key": keys["server"][0]}
    if who == "stranger":
        kwargs["client_keypair"] = keys["stranger"]  # a valid key, not in the allowlist
    elif who == "wrong_server_key":
        kwargs["client_keypair"] = keys["client"]
        kwargs["server_public_key"] = keys["stranger"][0]
    # "ephemeral": a server key alone: the client makes up a pair, which is not allowed.
    with connect_client(router.endpoint, wait_ms=500, **kwargs) as c, pytest.raises(NoReply):
        c.generate("let me in")
    assert router.served == 0


def test_a_client_keypair_without_the_servers_key_is_refused(keys: dict[str, Keys]) -> None:
    with pytest.raises(ConfigError, match="server_public_key"):
        Client("tcp://127.0.0.1:1", client_keypair=keys["client"])


def test_an_ephemeral_pair_gets_answers_from_a_server_that_allows_any_key(
    keys: dict[str, Keys], connect_client: Connect
) -> None:
    # zmq.auth's CURVE_ALLOW_ANY ("Stonehouse"): encrypted, any client key. A node
    # allows only listed keys, and so never answers an ephemeral pair (above).
    server = CurveRouter(keys["server"], zmq.auth.CURVE_ALLOW_ANY)
    try:
        with connect_client(
            server.endpoint, wait_ms=5000, server_public_key=keys["server"][0]
        ) as c:
            assert c.ping()["pong"] is True
    finally:
        server.close()
    assert server.served == 1


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"server_public_key": "S" * 40}, "server_public_key"),  # str, not bytes
        ({"server_public_key": b"short"}, "server_public_key"),
        ({"server_public_key": b"\x00" * 40}, "server_public_key"),  # not z85
        ({"client_keypair": (b"P" * 40, None)}, r"client_keypair\[1\]"),  # no secret
        ({"client_keypair": ("P" * 40, b"S" * 40)}, r"client_keypair\[0\]"),
        ({"client_keypair": (b"P" * 40,)}, "client_keypair"),
    ],
)
def test_a_malformed_key_is_a_config_error_naming_the_argument(
    keys: dict[str, Keys], client_kind: str, kwargs: dict[str, Any], named: str
) -> None:
    kwargs = {"server_public_key": keys["server"][0], **kwargs}
    cls = Client if client_kind == "sync" else AsyncClient
    with pytest.raises(ConfigError, match=named):
        cls("tcp://127.0.0.1:1", **kwargs)
