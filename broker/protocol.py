"""Wire protocol version 1: framing and msgpack bodies of both conversations.

Client <-> broker (frontend ROUTER)::

    client sends   ["", "EDGE/C1", body]       (a REQ socket adds the "" itself)
    broker replies ["", "EDGE/C1", body]

Worker <-> broker (backend ROUTER, workers are DEALERs)::

    ["", "EDGE/W1", command, body]             command is one of WorkerCommand

Bodies are msgpack maps with string keys. The field tables live in
``docs/PROTOCOL.md``; this module is their executable form. Nothing here does
I/O, so the same code validates in the broker, the workers and the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import msgpack

# Cancelled and ConfigError are re-exported: the wire's error contract is what
# fallback/ may use, and it imports nothing else of the project.
from broker.errors import Cancelled as Cancelled
from broker.errors import ConfigError as ConfigError
from broker.errors import ErrorCode, TooLarge
from broker.errors import ProtocolError as ProtocolError

PROTOCOL_VERSION = 1
CLIENT_TAG = b"EDGE/C1"
WORKER_TAG = b"EDGE/W1"

#: Largest accepted client body in bytes (413 above it). The socket's
#: ZMQ_MAXMSGSIZE is set higher (see ``hard_message_limit``) so that an oversized
#: body still gets a typed reply instead of a silent disconnect.
DEFAULT_MAX_BODY_BYTES = 256 * 1024

OPS = ("generate", "chat", "cancel", "ping", "status")
ROUTES = ("auto", "llm", "rules")
PRIORITIES = ("critical", "normal", "sheddable")
ROLES = ("system", "user", "assistant")

MAX_ID_CHARS = 128
MAX_TOKENS_LIMIT = 32768
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 64


class WorkerCommand(bytes, Enum):
    """Commands of the worker conversation (third frame after "" and the tag)."""

    READY = b"READY"
    REQUEST = b"REQUEST"
    PARTIAL = b"PARTIAL"
    FINAL = b"FINAL"
    CANCEL = b"CANCEL"
    CREDIT = b"CREDIT"
    HEARTBEAT = b"HEARTBEAT"
    DISCONNECT = b"DISCONNECT"


def hard_message_limit(max_body_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE for a socket whose soft body limit is ``max_body_bytes``.

    Above the hard limit libzmq drops the connection without telling anyone,
    so it sits well above the soft limit that gets a typed 413.
    """
    return max(4 * max_body_bytes, 1024 * 1024)


def pack(body: dict[str, Any]) -> bytes:
    """Encode a body as msgpack (bin type on, so bytes stay bytes)."""
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def unpack_map(data: bytes) -> dict[str, Any]:
    """Decode a msgpack body that must be a map with string keys.

    msgpack >= 1.0 bounds every container by the buffer length, so a hostile
    body cannot make the unpacker allocate more than its own size suggests.

    Raises:
        ProtocolError: not msgpack, trailing bytes, or not a map of str keys.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except ValueError as exc:
        if "strict_map_key" in str(exc):
            raise ProtocolError(
                "map keys (field names) must be msgpack str, got an integer"
            ) from exc
        raise ProtocolError(f"body is not valid msgpack: {exc or type(exc).__name__}") from exc
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"body is not valid msgpack: {exc or type(exc).__name__}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"body must be a msgpack map, got {type(obj).__name__}")
    _check_str_keys(obj)
    return obj


def _check_str_keys(obj: dict[Any, Any]) -> None:
    """Refuse bin (bytes) keys anywhere: strict_map_key lets them through."""
    stack: list[Any] = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            bad = next((k for k in item if not isinstance(k, str)), None)
            if bad is not None:
                raise ProtocolError(f"map keys (field names) must be msgpack str, got {bad!r}")
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# --------------------------------------------------------------------------- client side


@dataclass(frozen=True)
class ClientRequest:
    """A validated client request (one body of the client conversation).

    ``max_tokens`` and ``timeout_ms`` are None when the client left them to the
    node's defaults. ``target`` is the id a ``cancel`` op refers to.
    """

    id: str | int
    op: str
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    json_schema: dict[str, Any] | None = None
    timeout_ms: int | None = None
    stream: bool = False
    route: str = "auto"
    priority: str = "normal"
    target: str | int | None = None

    def engine_fields(self) -> dict[str, Any]:
        """The fields a worker needs to run this request, as a msgpack-ready map."""
        body: dict[str, Any] = {"op": self.op, "stream": self.stream}
        if self.prompt is not None:
            body["prompt"] = self.prompt
        if self.messages is not None:
            body["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        for name in ("max_tokens", "temperature", "top_p", "seed", "json_schema"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        if self.stop:
            body["stop"] = list(self.stop)
        return body


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
        obj = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:
        return None
    return request_id_of(obj) if isinstance(obj, dict) else None


def request_id_of(msg: dict[str, Any]) -> str | int | None:
    """The message's ``id`` if it is a valid id, else None (for error replies)."""
    value = msg.get("id")
    try:
        return _check_id("id", value)
    except ProtocolError:
        return None


def parse_client_request(msg: dict[str, Any]) -> ClientRequest:
    """Validate a decoded client body.

    Raises:
        ProtocolError: a missing, unknown or mistyped field; the message names it.
    """
    unknown = sorted(set(msg) - _CLIENT_FIELDS)
    if unknown:
        raise ProtocolError(f"unknown field {unknown[0]!r}")
    rid = _check_id("id", msg.get("id"))
    op = _check_choice("op", msg.get("op"), OPS)
    kwargs: dict[str, Any] = {"id": rid, "op": op}
    if op == "generate":
        kwargs["prompt"] = _check_str("prompt", msg.get("prompt"), allow_empty=False)
    elif op == "chat":
        kwargs["messages"] = _check_messages(msg.get("messages"))
    elif op == "cancel":
        kwargs["target"] = _check_id("target", msg.get("target"))
    opt = _optional
    kwargs["max_tokens"] = opt(
        msg, "max_tokens", lambda n, v: _check_int(n, v, 1, MAX_TOKENS_LIMIT)
    )
    kwargs["temperature"] = opt(msg, "temperature", lambda n, v: _check_float(n, v, 0.0, 5.0))
    kwargs["top_p"] = opt(msg, "top_p", lambda n, v: _check_float(n, v, 0.0, 1.0))
    kwargs["seed"] = opt(msg, "seed", lambda n, v: _check_int(n, v, 0, 2**32 - 1))
    kwargs["timeout_ms"] = opt(msg, "timeout_ms", lambda n, v: _check_int(n, v, 1, 86_400_000))
    kwargs["json_schema"] = opt(msg, "json_schema", _check_schema)
    kwargs["stop"] = opt(msg, "stop", _check_stop) or ()
    kwargs["stream"] = opt(msg, "stream", _check_bool) or False
    kwargs["route"] = opt(msg, "route", lambda n, v: _check_choice(n, v, ROUTES)) or "auto"
    kwargs["priority"] = (
        opt(msg, "priority", lambda n, v: _check_choice(n, v, PRIORITIES)) or "normal"
    )
    return ClientRequest(**kwargs)


_CLIENT_FIELDS = {
    "id", "op", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
    "json_schema", "timeout_ms", "stream", "route", "priority", "target",
}  # fmt: skip


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
    """Frames a worker DEALER sends (no identity): ``["", "EDGE/W1", command, body]``."""
    return [b"", WORKER_TAG, command.value, pack(body or {})]


def to_worker_frames(
    identity: bytes, command: WorkerCommand, body: dict[str, Any] | None = None
) -> list[bytes]:
    """Frames the backend ROUTER sends to the worker ``identity``."""
    return [identity, *worker_frames(command, body)]


def parse_worker_frames(frames: list[bytes]) -> tuple[WorkerCommand, dict[str, Any]]:
    """Decode a worker-conversation message (without the routing identity).

    Args:
        frames: ``["", "EDGE/W1", command, body]``.

    Raises:
        ProtocolError: wrong framing, unknown command or undecodable body.
    """
    if len(frames) != 4 or frames[0] != b"" or frames[1] != WORKER_TAG:
        raise ProtocolError("worker message must be ['', 'EDGE/W1', command, body]")
    try:
        command = WorkerCommand(frames[2])
    except ValueError:
        raise ProtocolError(f"unknown worker command {frames[2][:16]!r}") from None
    return command, unpack_map(frames[3])


# --------------------------------------------------------------------------- field checks


def _optional(msg: dict[str, Any], name: str, check: Any) -> Any:
    value = msg.get(name)
    return None if value is None else check(name, value)


def _check_id(name: str, value: Any) -> str | int:
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    if value is None:
        raise ProtocolError(f"missing field {name!r}")
    raise ProtocolError(
        f"field {name!r} must be a non-empty string (<= {MAX_ID_CHARS} chars) "
        "or a non-negative integer"
    )


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value is None:
        raise ProtocolError(f"missing field {name!r}")
    if value not in choices or not isinstance(value, str):
        raise ProtocolError(f"field {name!r} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _check_str(name: str, value: Any, *, allow_empty: bool = True) -> str:
    if value is None:
        raise ProtocolError(f"missing field {name!r}")
    if not isinstance(value, str):
        raise ProtocolError(f"field {name!r} must be a string, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ProtocolError(f"field {name!r} must not be empty")
    return value


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ProtocolError(f"field {name!r} must be in [{low}, {high}], got {value}")
    return value


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"field {name!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or not low <= value <= high:
        raise ProtocolError(f"field {name!r} must be in [{low}, {high}], got {value}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name!r} must be a boolean, got {type(value).__name__}")
    return value


def _check_stop(name: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise ProtocolError(f"field {name!r} must be a string or a list of non-empty strings")
    if len(items) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in items):
        raise ProtocolError(
            f"field {name!r} allows {MAX_STOP_SEQUENCES} sequences of <= {MAX_STOP_CHARS} chars"
        )
    return tuple(items)


def _check_schema(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"field {name!r} must be a map (a JSON Schema object)")
    return value


def _check_messages(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        raise ProtocolError("missing field 'messages'")
    if not isinstance(value, list) or not value:
        raise ProtocolError("field 'messages' must be a non-empty list of {role, content} maps")
    out = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"role", "content"}:
            raise ProtocolError(f"messages[{i}] must be a map with exactly 'role' and 'content'")
        role = _check_choice(f"messages[{i}].role", item["role"], ROLES)
        out.append((role, _check_str(f"messages[{i}].content", item["content"])))
    return tuple(out)
