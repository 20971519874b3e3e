"""``[metrics] listen``: where the metrics HTTP server binds, checked once at load.

"HOST:PORT" with HOST an IPv4 address, an IPv6 address in brackets or
``localhost``, and PORT in 1..65535; "" turns metrics off. A host name other than
``localhost`` is refused: what it resolves to can change, and binding a public
interface must be a decision the operator writes down as an address.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from broker.errors import ConfigError


@dataclass(frozen=True)
class Listen:
    """A parsed listen address: ``host`` without brackets, ``port`` in 1..65535."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        """Whether only this machine can connect (127.0.0.0/8, ::1, localhost)."""
        return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback


def parse_listen(key: str, text: str) -> Listen | None:
    """``text`` as a ``Listen``, or None for "" (metrics off).

    Raises:
        ConfigError: not HOST:PORT as the module doc says, naming ``key``.
    """
    if text == "":
        return None
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f'{key} must be "" (off) or HOST:PORT with a port in 1..65535, '
            f'e.g. "127.0.0.1:9464"; got {text!r}'
        )
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if bare == "localhost" and not bracketed:
        return Listen(bare, int(port))
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        raise ConfigError(
            f"{key}: {host!r} is not an IP address (or localhost); "
            f'name the address to bind, e.g. "127.0.0.1:{port}"'
        ) from None
    if (address.version == 6) != bracketed:
        raise ConfigError(f'{key}: an IPv6 address goes in brackets ("[::1]:{port}"), got {text!r}')
    return Listen(bare, int(port))
