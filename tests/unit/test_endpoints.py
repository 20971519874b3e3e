"""Endpoint syntax and the address local commands connect to (real zmq sockets)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from broker.client import Client
from broker.core import Broker
from broker.errors import ConfigError
from broker.loop import BrokerLoop, make_router
from broker.records import BrokerSettings
from node.endpoints import check_free, connect_endpoint, parse_endpoint
from node.testing import free_port


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("bind", "connect"),
    [
        ("tcp://*:5555", "tcp://127.0.0.1:5555"),
        ("tcp://0.0.0.0:5555", "tcp://127.0.0.1:5555"),
        ("tcp://[::]:5555", "tcp://[::1]:5555"),
        ("tcp://[::1]:5555", "tcp://[::1]:5555"),
        ("tcp://[fe80::1]:5555", "tcp://[fe80::1]:5555"),
        ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555"),
        ("tcp://10.1.2.3:5555", "tcp://10.1.2.3:5555"),
        ("tcp://localhost:5555", "tcp://localhost:5555"),
        ("ipc:///run/edgenode/frontend.sock", "ipc:///run/edgenode/frontend.sock"),
    ],
)
def test_a_bind_endpoint_maps_to_the_address_a_local_client_connects_to(
    bind: str, connect: str
) -> None:
    assert connect_endpoint(bind) == connect


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tcp://lo:5555", "interface"),  # libzmq binds it; no client can connect to it
        ("tcp://no-such-host.invalid:5555", "resolves"),
        ("tcp://::1:5555", "brackets"),
        ("tcp://[127.0.0.1]:5555", "not an IPv6 address"),
    ],
)
def test_a_host_a_client_cannot_connect_to_is_refused_naming_the_key(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_endpoint("node.frontend", text)
    assert info.value.message.startswith("node.frontend: ") and says in info.value.message


@contextmanager
def serving(frontend: str) -> Iterator[None]:
    """A real broker loop bound on ``frontend``, served by a thread."""
    with tempfile.TemporaryDirectory(prefix="en-") as tmp:
        loop = BrokerLoop(Broker(BrokerSettings()), frontend, f"ipc://{tmp}/b.sock")
        thread = threading.Thread(target=loop.run, kwargs={"max_wait_s": 0.05})
        thread.start()
        try:
            yield
        finally:
            loop.stop()
            thread.join()
            loop.close()


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "[::]", "[::1]"])
def test_a_client_reaches_a_node_bound_on_a_wildcard_or_ipv6_through_the_connect_address(
    host: str,
) -> None:
    if ":" in host and not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this host")
    bind = f"tcp://{host}:{free_port()}"
    with serving(bind), Client(connect_endpoint(bind), wait_ms=10_000) as client:
        assert client.ping()["status"] == "ok"


def test_a_port_held_by_a_node_socket_names_the_node() -> None:
    # ZMQ_IPV6 makes tcp://127.0.0.1:PORT listen on ::ffff:127.0.0.1; the holder
    # was then "another process" instead of this pid.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_router(ctx, endpoint, 1 << 20)
    try:
        with pytest.raises(ConfigError) as info:
            check_free("node.frontend", endpoint)
        assert f"in use by pid {os.getpid()}" in info.value.message
    finally:
        sock.close()
        ctx.term()
