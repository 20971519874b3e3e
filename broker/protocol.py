"""Wire protocol version 1: framing and msgpack bodies of both conversations.

Client <-> broker (frontend ROUTER)::

    client sends   ["", "EDGE/C1", body]       (a REQ socket adds the "" itself)
    broker replies ["", "EDGE/C1", body]

Worker <-> broker (backend ROUTER, workers are DEALERs)::

    ["EDGE/W2 " + command, body]               command is one of WorkerCommand

Bodies are msgpack maps with string keys. The field tables live in
``docs/PROTOCOL.md``; this module (framing, encoding, reply bodies) and
``broker.client_request`` (validating a client's request) are their executable
form. Nothing here does I/O, so the same code validates in the
broker, the workers and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

from broker.client_request import request_id_of
from broker.errors import ConfigError, ErrorCode, ProtocolError, TooLarge

PROTOCOL_VERSION = 1
CLIENT_TAG = b"EDGE/C1"
#: The worker conversation's tag; its header frame is the tag, a space and the
#: command, one frame (PROTOCOL §13.1): EDGE/W1's 4 frames a message, each a
#: send and a receive call on both sides, cost the broker's loop 2 of them more.
WORKER_TAG = b"EDGE/W2"

#: Default of ``broker.max_body_bytes``, the one setting every size limit of
#: both conversations derives from (``message_limits``).
DEFAULT_MAX_BODY_BYTES = 256 * 1024
#: Range of ``broker.max_body_bytes`` (bytes). Below 1 KiB a chat request with a
#: few messages no longer fits; above 16 MiB (about 4 million tokens of text, far
#: beyond any context an edge model has) the sockets' cap (4 x the setting) would
#: let one peer make the node allocate 64 MiB for a single frame.
MIN_BODY_BYTES = 1024
MAX_BODY_BYTES = 16 * 1024 * 1024
#: Bytes a worker's FINAL may carry beside its text: rid, status, finish_reason,
#: usage (3 x int64), a rule's name and confidence, an error's code and message
#: (512 characters, at most 2 KiB of UTF-8; ``node.worker.MAX_MESSAGE_CHARS``).
#: Measured fields take ~200 bytes; the rest is room for a long rule name.
ENVELOPE_BYTES = 16 * 1024
#: Floor of the sockets' cap (bytes), so that a small ``max_body_bytes`` still
#: leaves room to answer an oversized body with 413 instead of a dropped connection.
MIN_FRAME_BYTES = 1024 * 1024

#: Deepest nesting of maps and lists msgpack's C unpacker decodes, the outermost
#: map included (its stack of 1024 containers); a deeper body is refused (400).
MSGPACK_MAX_DEPTH = 1024


class WorkerCommand(bytes, Enum):
    """Commands of the worker conversation (after the tag in the header frame)."""

    READY = b"READY"
    REQUEST = b"REQUEST"
    PARTIAL = b"PARTIAL"
    FINAL = b"FINAL"
    CANCEL = b"CANCEL"
    CREDIT = b"CREDIT"
    HEARTBEAT = b"HEARTBEAT"
    DISCONNECT = b"DISCONNECT"


#: Each command's header frame (``worker_frames``), and back (``parse_worker_frames``).
WORKER_HEADERS = {command: WORKER_TAG + b" " + command.value for command in WorkerCommand}
_HEADER_COMMANDS = {header: command for command, header in WORKER_HEADERS.items()}


@dataclass(frozen=True)
class MessageLimits:
    """Every size limit of the node's sockets, in bytes, from ``broker.max_body_bytes``.

    ``body_bytes``: the largest client body (the setting); a larger one gets 413
    ``body is N bytes, the limit is M`` from the broker, or from the client library
    before it is sent.
    ``text_bytes``: the largest text one reply carries (UTF-8; also the setting): a
    worker whose completion grows past it stops and answers 413 with the text
    clipped to it, instead of a FINAL the broker's socket would drop.
    ``reply_bytes``: the largest FINAL body a worker sends, ``text_bytes +
    ENVELOPE_BYTES``.
    ``frame_bytes``: ZMQ_MAXMSGSIZE of every socket of the node (frontend and
    backend ROUTERs, worker DEALERs), ``max(4 x body_bytes, MIN_FRAME_BYTES)``.
    libzmq checks it per frame against the frame's length header and drops the
    connection above it, silently and before the application sees a byte, so it
    sits above everything the node's own parts send: a REQUEST is at most
    ``1.8 x body_bytes + 64`` (the broker re-encodes the body's fields; a float32
    becomes a float64, 5 -> 9 bytes, and nothing grows more; it adds ``rid``,
    ``max_tokens`` and ``timeout_ms``), a FINAL at most ``reply_bytes``, and a
    body between ``body_bytes`` and ``frame_bytes`` still reaches the broker's 413.
    """

    body_bytes: int
    text_bytes: int
    reply_bytes: int
    frame_bytes: int


def message_limits(max_body_bytes: int) -> MessageLimits:
    """The limits of every hop for ``broker.max_body_bytes`` (bytes); see ``MessageLimits``.

    Raises:
        ConfigError: ``max_body_bytes`` outside ``MIN_BODY_BYTES`` ... ``MAX_BODY_BYTES``.
    """
    if not MIN_BODY_BYTES <= max_body_bytes <= MAX_BODY_BYTES:
        raise ConfigError(
            f"broker.max_body_bytes must be in {MIN_BODY_BYTES}..{MAX_BODY_BYTES} bytes,"
            f" got {max_body_bytes}"
        )
    return MessageLimits(
        body_bytes=max_body_bytes,
        text_bytes=max_body_bytes,
        reply_bytes=max_body_bytes + ENVELOPE_BYTES,
        frame_bytes=max(4 * max_body_bytes, MIN_FRAME_BYTES),
    )


def pack(body: dict[str, Any]) -> bytes:
    """Encode a body as msgpack (bin type on, so bytes stay bytes).

    Raises:
        ProtocolError: a value msgpack cannot carry: an integer outside
            -2**63 .. 2**64-1 (such as a schema's ``{"const": 2**64}``), a type it
            does not know (a set, a datetime). msgpack's own OverflowError or
            TypeError would reach the caller untyped.
    """
    try:
        data: bytes = msgpack.packb(body, use_bin_type=True)
    except OverflowError as exc:
        raise ProtocolError(
            f"the body cannot be encoded as msgpack: {exc} (integers go from -2**63 to 2**64-1)"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"the body cannot be encoded as msgpack: {exc}") from exc
    return data


def unpack_map(data: bytes) -> dict[str, Any]:
    """Decode a msgpack body that must be a map with string keys.

    msgpack >= 1.0 bounds every container by the buffer length, so a hostile
    body cannot make the unpacker allocate more than its own size suggests.

    Raises:
        ProtocolError: not msgpack (the message says why: e.g. the byte 0xc1,
            nesting deeper than ``MSGPACK_MAX_DEPTH``, truncated), trailing
            bytes, or not a map of str keys.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except ValueError as exc:
        if "strict_map_key" in str(exc):
            # msgpack names the key's Python type first: "float is not allowed for map key ..."
            kind = _KEY_TYPES.get(str(exc).split(" ", 1)[0], "a non-string key")
            raise ProtocolError(f"map keys (field names) must be msgpack str, got {kind}") from exc
        raise ProtocolError(f"body is not valid msgpack: {_unpack_failure(exc)}") from exc
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"body is not valid msgpack: {_unpack_failure(exc)}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"body must be a msgpack map, got {type(obj).__name__}")
    _check_str_keys(obj)
    return obj


#: What msgpack's strict_map_key refusal names, in the wire's words.
_KEY_TYPES = {
    "int": "an integer",
    "float": "a float",
    "bool": "a boolean",
    "NoneType": "nil",
    "list": "an array",
    "dict": "a map",
}


def _unpack_failure(exc: Exception) -> str:
    """What is wrong with a body msgpack refused, as a non-empty phrase."""
    # The C unpacker raises StackError and FormatError without any text.
    if isinstance(exc, msgpack.StackError):
        return f"nesting deeper than {MSGPACK_MAX_DEPTH} maps and lists"
    text = str(exc)
    if isinstance(exc, msgpack.FormatError):
        # The only byte msgpack leaves undefined; the pure-Python unpacker names it itself.
        return text or "byte 0xc1, which msgpack never uses"
    if "exceeds max_" in text:
        # unpackb caps every length at the body's size: a larger one is cut off data.
        return f"truncated ({text})"
    return text or type(exc).__name__


def _check_str_keys(obj: dict[Any, Any]) -> None:
    """Refuse bin (bytes) keys anywhere: strict_map_key lets them through.

    The unpacker builds exact ``dict``, ``list`` and ``str`` objects, so exact type
    tests suffice; only containers are visited (every message crosses here: the
    broker's busiest check)."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            for key, value in item.items():
                if type(key) is not str:
                    raise ProtocolError(f"map keys (field names) must be msgpack str, got {key!r}")
                if type(value) is dict or type(value) is list:
                    stack.append(value)
        else:
            stack.extend(v for v in item if type(v) is dict or type(v) is list)


# --------------------------------------------------------------------------- client side


def split_client_frames(frames: list[bytes]) -> tuple[bytes, bytes]:
    """Split a frontend ROUTER message into (routing identity, body).

    Args:
        frames: as received: ``[identity, b"", b"EDGE/C1", body]``.

    Raises:
        ProtocolError: wrong frame count, missing delimiter or wrong tag.
    """
    if len(frames) < 2:
        raise ProtocolError("message has no routing envelope")
    if len(frames) != 4:
        raise ProtocolError(f"expected 3 frames ['', 'EDGE/C1', body], got {len(frames) - 1}")
    if frames[1] != b"":
        raise ProtocolError("first frame must be the empty delimiter")
    if frames[2] != CLIENT_TAG:
        raise ProtocolError(f"second frame must be {CLIENT_TAG.decode()}, got {frames[2][:16]!r}")
    return frames[0], frames[3]


def client_frames(identity: bytes, body: dict[str, Any]) -> list[bytes]:
    """Frames the frontend ROUTER sends to reach ``identity`` with ``body``."""
    return [identity, b"", CLIENT_TAG, pack(body)]


def salvage_id(body: bytes) -> str | int | None:
    """The ``id`` of a body that failed validation, if one can be read at all,
    so even a malformed request's error reply reaches the caller's waiting id."""
    try:
        # use_list=False: an array used as a map key (valid msgpack) becomes a
        # hashable tuple; as a list it made this fail, and the 400 lost its id.
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=False)
    except Exception:
        return None
    return request_id_of(obj) if isinstance(obj, dict) else None


def ok_reply(rid: str | int, **fields: Any) -> dict[str, Any]:
    """A final success reply body (``status: ok``) with the given fields."""
    return {"id": rid, "status": "ok", **fields}


def partial_reply(rid: str | int, text: str, index: int) -> dict[str, Any]:
    """A streamed chunk (``status: partial``); ``index`` counts chunks from 0."""
    return {"id": rid, "status": "partial", "text": text, "index": index}


def error_reply(
    rid: str | int | None,
    code: ErrorCode,
    message: str,
    *,
    retry_after_ms: int | None = None,
    text: str = "",
    reason: str | None = None,
) -> dict[str, Any]:
    """A final error reply body (``status: error``).

    Args:
        rid: the request's id, or None when the message had no usable id.
        code: HTTP-aligned wire code.
        message: human-readable cause, naming the offending field where there is one.
        retry_after_ms: set only where retrying can succeed (429, 503).
        text: partial text generated before the failure.
        reason: a short machine-readable cause (e.g. ``worker_lost``).
    """
    body: dict[str, Any] = {
        "id": rid,
        "status": "error",
        "code": int(code),
        "error": code.name,
        "message": message,
    }
    if retry_after_ms is not None:
        body["retry_after_ms"] = int(retry_after_ms)
    if text:
        body["text"] = text
    if reason:
        body["reason"] = reason
    return body


def check_body_size(body: bytes, limit: int) -> None:
    """Raise ``TooLarge`` when a client body exceeds ``limit`` bytes."""
    if len(body) > limit:
        raise TooLarge(f"body is {len(body)} bytes, the limit is {limit}")


# --------------------------------------------------------------------------- worker side


def worker_frames(command: WorkerCommand, body: dict[str, Any] | None = None) -> list[bytes]:
    """Frames a worker DEALER sends (no identity): ``["EDGE/W2 COMMAND", body]``."""
    return [WORKER_HEADERS[command], pack(body or {})]


def to_worker_frames(
    identity: bytes, command: WorkerCommand, body: dict[str, Any] | None = None
) -> list[bytes]:
    """Frames the backend ROUTER sends to the worker ``identity``."""
    return [identity, *worker_frames(command, body)]


def clip_text(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, at a character boundary."""
    data = text.encode()
    return text if len(data) <= limit else data[:limit].decode(errors="ignore")


def fit_final(body: dict[str, Any], limits: MessageLimits, outgrew: bool = False) -> dict[str, Any]:
    """A worker's FINAL ``body`` if it fits ``limits``, else a 413 FINAL for its request.

    It fits when its text is at most ``limits.text_bytes`` of UTF-8 and it packs into
    at most ``limits.reply_bytes``. ``outgrew``: the worker already stopped the
    request because its streamed text passed ``text_bytes``. The 413 carries the
    text clipped to ``text_bytes``, so it always fits (clipped text + ~300 bytes).
    """
    text = body.get("text")
    text = text if isinstance(text, str) else ""
    fits = len(text.encode()) <= limits.text_bytes and len(pack(body)) <= limits.reply_bytes
    if fits and not outgrew:
        return body
    return {
        "rid": body.get("rid"),
        "status": "error",
        "code": int(ErrorCode.TOO_LARGE),
        "message": (
            f"the reply outgrew the most a reply may carry: {limits.text_bytes} bytes of"
            " text (broker.max_body_bytes); lower max_tokens or raise that limit"
        ),
        "text": clip_text(text, limits.text_bytes),
    }


def parse_worker_frames(frames: list[bytes]) -> tuple[WorkerCommand, dict[str, Any]]:
    """Decode a worker-conversation message (without the routing identity).

    Args:
        frames: ``["EDGE/W2 COMMAND", body]``.

    Raises:
        ProtocolError: wrong framing (an EDGE/W1 worker's 4 frames too), unknown
            command or undecodable body.
    """
    command = _HEADER_COMMANDS.get(frames[0]) if len(frames) == 2 else None
    if command is None:
        tag, _, word = frames[0].partition(b" ") if len(frames) == 2 else (b"", b"", b"")
        if tag != WORKER_TAG or not word:
            raise ProtocolError("worker message must be ['EDGE/W2 COMMAND', body]")
        raise ProtocolError(f"unknown worker command {word[:16]!r}")
    return command, unpack_map(frames[1])
