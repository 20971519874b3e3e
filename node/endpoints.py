"""The node's ZeroMQ endpoints: their syntax, and whether another process holds one.

A node checks its endpoints before it binds. A TCP port in use would make the
bind fail; an ipc path in use is worse: libzmq unlinks a socket file it finds
and binds anew, silently taking the path from the process that serves it. The
check names the holder (``psutil.net_connections``: the process listening on
the port, or bound to the socket path), so the operator knows whom to stop.
A narrow window remains between the check and the bind; the bind's own error
is reported the same way.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Literal

import psutil

from broker.errors import ConfigError

#: Longest ipc path: ``sun_path`` holds 108 bytes with the terminating NUL (unix(7)).
MAX_IPC_PATH = 107
#: TCP ports an endpoint may name (a fixed port: clients must know where to connect).
PORTS = range(1, 65536)


@dataclass(frozen=True)
class Endpoint:
    """A parsed ``ipc://PATH`` or ``tcp://HOST:PORT`` endpoint."""

    transport: Literal["ipc", "tcp"]
    path: str = ""
    host: str = ""
    port: int = 0


def parse_endpoint(key: str, text: str) -> Endpoint:
    """Parse ``ipc://PATH`` (at most ``MAX_IPC_PATH`` bytes) or ``tcp://HOST:PORT``
    (port 1..65535; HOST ``*``, an IPv4 address, an IPv6 address in brackets, or a
    host name that resolves here, e.g. ``localhost``).

    An interface name (``tcp://eth0:5555``) is refused although libzmq binds it:
    clients of this host (``edgenode status``, ``stop``, ``ask``, the workers)
    must connect to the same endpoint, and a connect takes no interface name
    (it would fail as "not ready"). Name the interface's address instead.

    Raises:
        ConfigError: anything else, naming ``key``.
    """
    transport, sep, rest = text.partition("://")
    if sep and transport == "ipc" and rest:
        if len(os.fsencode(rest)) > MAX_IPC_PATH:
            raise ConfigError(
                f"{key}: ipc path {rest!r} is {len(os.fsencode(rest))} bytes, "
                f"longer than the {MAX_IPC_PATH} a unix socket address holds"
            )
        return Endpoint("ipc", path=rest)
    if sep and transport == "tcp":
        host, colon, port = rest.rpartition(":")
        if colon and host and port.isdigit() and int(port) in PORTS:
            return Endpoint("tcp", host=_tcp_host(key, text, host), port=int(port))
        raise ConfigError(f"{key}: {text!r} needs tcp://HOST:PORT with a port in 1..65535")
    raise ConfigError(f'{key} must be "", ipc://PATH or tcp://HOST:PORT, got {text!r}')


def _tcp_host(key: str, text: str, host: str) -> str:
    """The host of a tcp endpoint, without IPv6 brackets.

    Raises:
        ConfigError: an IPv6 address without brackets, a bracketed non-IPv6, or
            a name that does not resolve (an interface name, a typo), naming ``key``.
    """
    if host == "*":
        return host
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        if _ip_version(inner) == 6:
            return inner
        raise ConfigError(f"{key}: {text!r}: [{inner}] is not an IPv6 address")
    version = _ip_version(host)
    if version == 6:
        raise ConfigError(
            f"{key}: {text!r}: write an IPv6 address in brackets, tcp://[{host}]:PORT"
        )
    if version == 4:
        return host
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(
            f"{key}: {text!r}: host {host!r} is neither an IP address, '*', nor a name that "
            f"resolves here ({exc}); for an interface, give its address (e.g. 127.0.0.1 for lo)"
        ) from exc
    return host


def _ip_version(text: str) -> int | None:
    """4 or 6 for an IP address literal, else None."""
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


def connect_endpoint(text: str) -> str:
    """The endpoint a process on this host connects to, for the bind endpoint ``text``
    (a valid ``node.frontend`` / ``node.backend``).

    A wildcard is where a node listens, never an address to connect to: ``*`` and
    ``0.0.0.0`` become 127.0.0.1, ``::`` becomes ``[::1]``; an IPv6 address gets
    the brackets libzmq wants. ipc endpoints, IPv4 addresses and names are kept.
    Every local connect (``edgenode start``'s readiness check, ``status``,
    ``ask``, the workers' backend) goes through it.

    Raises:
        ConfigError: ``text`` is not a valid endpoint (see ``parse_endpoint``).
    """
    endpoint = parse_endpoint("endpoint", text)
    if endpoint.transport == "ipc":
        return text
    host = endpoint.host
    if host in ("*", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if _ip_version(host) == 6:
        host = f"[{host}]"
    return f"tcp://{host}:{endpoint.port}"


def check_free(key: str, text: str) -> None:
    """Refuse an endpoint another process holds now.

    Raises:
        ConfigError: in use; the message names the endpoint, ``key`` and the holder.
    """
    endpoint = parse_endpoint(key, text)
    busy = _ipc_busy(endpoint.path) if endpoint.transport == "ipc" else _tcp_busy(endpoint)
    if busy:
        raise ConfigError(in_use_message(key, text))


def in_use_message(key: str, text: str) -> str:
    """ "<key> <endpoint> is already in use by pid N (name)"."""
    return f"{key} {text} is already in use by {holder_of(parse_endpoint(key, text))}"


def holder_of(endpoint: Endpoint) -> str:
    """Who listens on the endpoint: "pid N (cmd)", or "another process" when the
    kernel does not say (another user's process, without root)."""
    try:
        conns = psutil.net_connections(kind="unix" if endpoint.transport == "ipc" else "tcp")
    except (psutil.Error, OSError):
        conns = []
    for conn in conns:
        if conn.pid is None or not _matches(endpoint, conn.laddr, conn.status):
            continue
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(conn.pid)
            return f"pid {conn.pid} ({_short(' '.join(proc.cmdline()) or proc.name())})"
        return f"pid {conn.pid}"
    return "another process"


#: Addresses that listen on every interface: they clash with any host on their port.
_WILDCARDS = ("", "*", "0.0.0.0", "::")


def _short(cmdline: str, limit: int = 80) -> str:
    """One line of at most ``limit`` characters, for messages."""
    line = " ".join(cmdline.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _matches(endpoint: Endpoint, laddr: object, status: str) -> bool:
    """Whether a connection's local address (a path for unix sockets, else
    ``(ip, port)``) is the endpoint's."""
    if endpoint.transport == "ipc":
        return laddr == endpoint.path
    if status != psutil.CONN_LISTEN or not isinstance(laddr, tuple) or len(laddr) != 2:
        return False
    ip, port = _unmapped(str(laddr[0])), laddr[1]
    if port != endpoint.port:
        return False
    return ip in _WILDCARDS or endpoint.host in _WILDCARDS or ip == endpoint.host


def _unmapped(ip: str) -> str:
    """An IPv4-mapped IPv6 address as its IPv4 address: a socket with ZMQ_IPV6 bound
    on tcp://127.0.0.1:PORT listens on ``::ffff:127.0.0.1``."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped) if mapped is not None else ip


def _ipc_busy(path: str) -> bool:
    """Whether a process accepts connections on the socket file ``path`` (a file
    left by a process that died refuses them: stale, libzmq may replace it)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _tcp_busy(endpoint: Endpoint) -> bool:
    """Whether binding the port fails with EADDRINUSE (with SO_REUSEADDR, as libzmq
    binds, so only a listener counts, not connections in TIME_WAIT)."""
    host = "" if endpoint.host == "*" else endpoint.host
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host or "0.0.0.0").version == 6 else 0
    except ValueError:
        return False  # an interface or host name: libzmq resolves it, its bind error tells
    with socket.socket(family or socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, endpoint.port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def is_loopback(endpoint: Endpoint) -> bool:
    """Whether only this host can reach the tcp ``endpoint``: a loopback address
    (127.0.0.0/8, ::1), or a name whose every address is one. ``*`` and every
    other address are reachable from the network; an ipc endpoint is a file
    (its directory's permissions guard it) and counts as loopback."""
    if endpoint.transport == "ipc":
        return True
    if endpoint.host == "*":
        return False
    if _ip_version(endpoint.host) is not None:
        return ipaddress.ip_address(endpoint.host).is_loopback
    try:
        infos = socket.getaddrinfo(endpoint.host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # parse_endpoint refused it already; never call the unknown safe
    addresses = {str(info[4][0]).split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)
