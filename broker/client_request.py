"""The client request: a decoded client body validated into a ``ClientRequest``.

This is the validating half of the client conversation of wire protocol version 1
(``docs/PROTOCOL.md``, the request fields); framing, encoding and the reply bodies
are ``broker.protocol``. Every check raises ``ProtocolError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from broker.errors import ProtocolError
from broker.kinds import PRIORITIES, Priority

#: What a client asks for (``op`` on the wire).
Op = Literal["generate", "chat", "cancel", "ping", "status"]
OPS: tuple[Op, ...] = get_args(Op)
#: Which engine a client asks for (``route`` on the wire): the migration mode's
#: choice (``auto``) or one engine kind.
RequestRoute = Literal["auto", "llm", "rules"]
ROUTES: tuple[RequestRoute, ...] = get_args(RequestRoute)
ROLES = ("system", "user", "assistant")

MAX_ID_CHARS = 128
MAX_TOKENS_LIMIT = 32768
MAX_STOP_SEQUENCES = 8
MAX_STOP_CHARS = 64


@dataclass(frozen=True)
class ClientRequest:
    """A validated client request (one body of the client conversation).

    ``max_tokens`` and ``timeout_ms`` are None when the client left them to the
    node's defaults. ``target`` is the id a ``cancel`` op refers to. ``retry``:
    this message resends an earlier ``generate``/``chat`` of the same id (safe
    retry, ``broker.reply_cache``); it never changes what the request asks for.
    ``cache_prompt``: False asks a model worker to evaluate the whole prompt,
    reusing no slot's cached prefix (llama-server's field of the same name).
    """

    id: str | int
    op: Op
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
    route: RequestRoute = "auto"
    priority: Priority = "normal"
    target: str | int | None = None
    retry: bool = False
    cache_prompt: bool = True

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
        if not self.cache_prompt:  # sent only when off: the default is the worker's
            body["cache_prompt"] = False
        return body


def request_id_of(msg: dict[str, Any]) -> str | int | None:
    """The message's ``id`` if it is a valid id, else None (for error replies)."""
    value = msg.get("id")
    try:
        return check_request_id("id", value)
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
    rid = check_request_id("id", msg.get("id"))
    op = _check_choice("op", msg.get("op"), OPS)
    kwargs: dict[str, Any] = {"id": rid, "op": op}
    if op == "generate":
        kwargs["prompt"] = _check_str("prompt", msg.get("prompt"), allow_empty=False)
    elif op == "chat":
        kwargs["messages"] = _check_messages(msg.get("messages"))
    elif op == "cancel":
        kwargs["target"] = check_request_id("target", msg.get("target"))
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
    kwargs["retry"] = opt(msg, "retry", _check_bool) or False
    kwargs["cache_prompt"] = opt(msg, "cache_prompt", _check_bool) is not False
    kwargs["route"] = opt(msg, "route", lambda n, v: _check_choice(n, v, ROUTES)) or "auto"
    kwargs["priority"] = (
        opt(msg, "priority", lambda n, v: _check_choice(n, v, PRIORITIES)) or "normal"
    )
    return ClientRequest(**kwargs)


_CLIENT_FIELDS = {
    "id", "op", "prompt", "messages", "max_tokens", "temperature", "top_p", "seed", "stop",
    "json_schema", "timeout_ms", "stream", "route", "priority", "target",
    "retry", "cache_prompt",
}  # fmt: skip


# --------------------------------------------------------------------------- field checks


def _optional(msg: dict[str, Any], name: str, check: Any) -> Any:
    value = msg.get(name)
    return None if value is None else check(name, value)


def check_request_id(name: str, value: Any) -> str | int:
    """``value`` if it is a valid request id: a string of 1-``MAX_ID_CHARS`` characters
    or an integer in [0, 2**63). The broker checks ``id`` and ``target`` with it, the
    client checks its ids before sending (the node's 400 for a bad id has no id to
    carry, so the client could not match it to the request).

    Raises:
        ProtocolError: missing (None) or not a valid id; the message names ``name``.
    """
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
        return value
    if value is None:
        raise ProtocolError(f"missing field {name!r}")
    raise ProtocolError(
        f"field {name!r} must be a non-empty string (<= {MAX_ID_CHARS} chars) "
        "or an integer in 0 … 2**63-1"
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
