"""CURVE keys of one broker socket: what ``broker.loop`` needs to run it as a
CURVE server with an allowlist (the "Ironhouse" pattern of the ZeroMQ guide,
chapter 5: every peer proves a key, and only listed keys get in).

Only data: the node (``node.security.keys``) reads the key files, the loop
sets the socket options and answers the ZAP requests. Keys are Z85 text as
``zmq.auth.load_certificate`` returns it (40 bytes for a 32-byte key).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Length of a Z85-encoded CURVE key (32 bytes -> 40 characters, ZeroMQ RFC 32).
Z85_KEY_BYTES = 40


@dataclass(frozen=True)
class CurveServer:
    """A socket's CURVE server keypair and the client keys it admits.

    Args:
        public_key, secret_key: the server's keypair (Z85, 40 bytes each).
        allowed: the public keys (Z85) that may connect; any other peer's
            handshake is refused and counted (``Refusal`` ``key_not_allowed``).

    Raises:
        ValueError: a key that is not 40 bytes of Z85 text.
    """

    public_key: bytes
    secret_key: bytes
    allowed: frozenset[bytes]

    def __post_init__(self) -> None:
        for key in (self.public_key, self.secret_key, *self.allowed):
            if len(key) != Z85_KEY_BYTES:
                raise ValueError(f"a CURVE key is {Z85_KEY_BYTES} bytes of Z85, got {len(key)}")

    def allows(self, key: bytes) -> bool:
        """Whether the peer with public key ``key`` (Z85) may connect."""
        return key in self.allowed
