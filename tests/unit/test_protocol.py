"""Wire protocol v1: framing, body decoding, request validation, reply shapes."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest

from broker import protocol as p
from broker.client_request import MAX_TOKENS_LIMIT, ROUTES, parse_client_request, request_id_of
from broker.errors import (
    ERROR_BY_CODE,
    EdgeNodeError,
    ErrorCode,
    ProtocolError,
    TooLarge,
    error_from_wire,
)
from broker.kinds import PRIORITIES
from broker.protocol import WorkerCommand

BODY = p.pack({"id": "r1", "op": "ping"})


def valid(**fields: Any) -> dict[str, Any]:
    """A minimal valid generate request with ``fields`` merged (None removes a key)."""
    msg: dict[str, Any] = {"id": "r1", "op": "generate", "prompt": "hi"}
    msg.update(fields)
    return {k: v for k, v in msg.items() if v is not None}


def assert_rejected(msg: dict[str, Any], *names: str) -> ProtocolError:
    """Assert that ``msg`` is refused with a ProtocolError naming all of ``names``."""
    with pytest.raises(ProtocolError) as info:
        parse_client_request(msg)
    err = info.value
    assert err.code == ErrorCode.BAD_REQUEST
    for name in names:
        assert name in err.message, f"{name!r} not named in {err.message!r}"
    return err


# --------------------------------------------------------------------------- framing


def test_split_client_frames_returns_identity_and_body() -> None:
    assert p.split_client_frames([b"cli", b"", p.CLIENT_TAG, BODY]) == (b"cli", BODY)


def test_client_frames_round_trip() -> None:
    frames = p.client_frames(b"cli", {"id": 7, "status": "ok"})
    assert frames[:3] == [b"cli", b"", b"EDGE/C1"]
    identity, body = p.split_client_frames(frames)
    assert identity == b"cli"
    assert p.unpack_map(body) == {"id": 7, "status": "ok"}


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"cli"],
        [b"cli", b""],
        [b"cli", b"", p.CLIENT_TAG],
        [b"cli", b"", p.CLIENT_TAG, BODY, b"extra"],
        [b"cli", p.CLIENT_TAG, BODY],
    ],
    ids=["none", "identity-only", "delimiter-only", "no-body", "extra-frame", "no-delimiter-3"],
)
def test_split_client_frames_rejects_wrong_frame_count(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError) as info:
        p.split_client_frames(frames)
    assert "frame" in info.value.message or "envelope" in info.value.message


def test_split_client_frames_requires_empty_delimiter() -> None:
    with pytest.raises(ProtocolError, match="delimiter"):
        p.split_client_frames([b"cli", b"x", p.CLIENT_TAG, BODY])


@pytest.mark.parametrize("tag", [b"EDGE/C2", b"EDGE/W1", b"", b"X" * 1000])
def test_split_client_frames_requires_client_tag(tag: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        p.split_client_frames([b"cli", b"", tag, BODY])
    assert "EDGE/C1" in info.value.message
    assert len(info.value.message) < 200  # a hostile tag is not echoed in full


# --------------------------------------------------------------------------- unpack_map


def test_unpack_map_decodes_a_str_keyed_map() -> None:
    body = {"id": 1, "nested": {"a": [1, 2]}, "raw": b"\x00\x01"}
    assert p.unpack_map(p.pack(body)) == body


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x82\xa1a", p.pack({"id": 1}) + b"\x00"],
    ids=["empty", "reserved-byte", "truncated", "trailing-bytes"],
)
def test_unpack_map_rejects_invalid_msgpack(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="msgpack"):
        p.unpack_map(data)


@pytest.mark.parametrize(
    ("value", "type_name"),
    [([1, 2], "list"), (7, "int"), ("text", "str"), (None, "NoneType"), (b"raw", "bytes")],
)
def test_unpack_map_rejects_non_maps(value: Any, type_name: str) -> None:
    data = msgpack.packb(value, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        p.unpack_map(data)
    assert "map" in info.value.message
    assert type_name in info.value.message


@pytest.mark.parametrize(
    "body",
    [{1: "x"}, {b"id": "x"}, {"id": "x", "json_schema": {2: "y"}}],
    ids=["int-key", "bytes-key", "nested-int-key"],
)
def test_unpack_map_rejects_non_str_keys(body: dict[Any, Any]) -> None:
    data = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(ProtocolError) as info:
        p.unpack_map(data)
    assert "key" in info.value.message.lower(), info.value.message


# --------------------------------------------------------------------------- requests: id, op


def test_minimal_generate_gets_documented_defaults() -> None:
    req = parse_client_request(valid())
    assert (req.id, req.op, req.prompt) == ("r1", "generate", "hi")
    assert req.max_tokens is None and req.timeout_ms is None
    assert req.temperature is None and req.top_p is None and req.seed is None
    assert req.stop == () and req.json_schema is None
    assert req.stream is False and req.route == "auto" and req.priority == "normal"


def test_every_field_is_carried() -> None:
    schema = {"type": "object"}
    req = parse_client_request(
        valid(
            id=5,
            max_tokens=32,
            temperature=0.7,
            top_p=0.9,
            seed=11,
            stop=["\n"],
            json_schema=schema,
            timeout_ms=1500,
            stream=True,
            route="llm",
            priority="critical",
        )
    )
    assert req.id == 5 and req.max_tokens == 32 and req.seed == 11
    assert req.temperature == 0.7 and req.top_p == 0.9
    assert req.stop == ("\n",) and req.json_schema == schema and req.timeout_ms == 1500
    assert req.stream is True and req.route == "llm" and req.priority == "critical"


def test_missing_id_is_named() -> None:
    err = assert_rejected(valid(id=None), "'id'")
    assert "missing" in err.message


@pytest.mark.parametrize(
    "bad",
    ["", "x" * 129, -1, 2**63, 1.5, True, False, [1], {"a": 1}, b"raw"],
    ids=[
        "empty",
        "too-long",
        "negative",
        "too-big",
        "float",
        "true",
        "false",
        "list",
        "map",
        "bytes",
    ],
)
def test_bad_id_types_are_rejected(bad: Any) -> None:
    assert_rejected(valid(id=bad), "'id'")


def test_an_id_too_big_is_told_the_range() -> None:
    # A new user's 2**64-1 was told "a non-negative integer", which it is.
    assert_rejected(valid(id=2**64 - 1), "or an integer in 0 … 2**63-1")


@pytest.mark.parametrize("good", ["x", "x" * 128, 0, 2**63 - 1])
def test_id_limits_are_inclusive(good: str | int) -> None:
    assert parse_client_request(valid(id=good)).id == good


def test_request_id_of_only_returns_valid_ids() -> None:
    assert request_id_of({"id": "abc"}) == "abc"
    assert request_id_of({"id": 3}) == 3
    assert request_id_of({"id": True}) is None
    assert request_id_of({"id": ""}) is None
    assert request_id_of({}) is None


def test_missing_op_is_named() -> None:
    assert_rejected({"id": "r1"}, "'op'", "missing")


@pytest.mark.parametrize("bad", ["complete", "GENERATE", "", 1, ["generate"]])
def test_unknown_op_is_named(bad: Any) -> None:
    err = assert_rejected(valid(op=bad), "'op'")
    assert "generate" in err.message  # the choices are listed


@pytest.mark.parametrize("op", ["ping", "status"])
def test_ping_and_status_need_only_id_and_op(op: str) -> None:
    req = parse_client_request({"id": "r9", "op": op})
    assert (req.id, req.op) == ("r9", op)


def test_unknown_field_is_named() -> None:
    assert_rejected(valid(promt="typo"), "'promt'")


def test_unknown_field_wins_over_other_errors() -> None:
    assert_rejected({"op": "nope", "colour": "red"}, "'colour'")


# --------------------------------------------------------------------------- requests: body


@pytest.mark.parametrize(("bad", "word"), [(None, "missing"), ("", "empty"), (42, "string")])
def test_generate_needs_a_non_empty_prompt(bad: Any, word: str) -> None:
    err = assert_rejected(valid(prompt=bad), "'prompt'")
    assert word in err.message


def test_chat_messages_are_parsed_in_order() -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = parse_client_request({"id": 1, "op": "chat", "messages": msgs})
    assert req.messages == (("system", "be brief"), ("user", "hi"))
    assert req.prompt is None


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        (None, "'messages'"),
        ([], "'messages'"),
        ("hi", "'messages'"),
        ({"role": "user", "content": "hi"}, "'messages'"),
        (["hi"], "messages[0]"),
        ([{"role": "user"}], "messages[0]"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b", "x": 1}],
            "messages[1]",
        ),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
    ],
    ids=[
        "missing",
        "empty",
        "string",
        "map",
        "item-not-map",
        "no-content",
        "extra-key",
        "bad-role",
        "content-not-str",
    ],
)
def test_chat_messages_shape(messages: Any, named: str) -> None:
    msg: dict[str, Any] = {"id": 1, "op": "chat"}
    if messages is not None:
        msg["messages"] = messages
    assert_rejected(msg, named)


def test_cancel_needs_a_valid_target() -> None:
    assert parse_client_request({"id": 2, "op": "cancel", "target": "r1"}).target == "r1"
    assert_rejected({"id": 2, "op": "cancel"}, "'target'", "missing")
    assert_rejected({"id": 2, "op": "cancel", "target": True}, "'target'")


# --------------------------------------------------------------------------- requests: ranges


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("max_tokens", 1, 1),
        ("max_tokens", MAX_TOKENS_LIMIT, MAX_TOKENS_LIMIT),
        ("temperature", 0, 0.0),
        ("temperature", 5.0, 5.0),
        ("temperature", 1, 1.0),
        ("top_p", 0.0, 0.0),
        ("top_p", 1, 1.0),
        ("timeout_ms", 1, 1),
        ("timeout_ms", 86_400_000, 86_400_000),
        ("seed", 0, 0),
        ("seed", 2**32 - 1, 2**32 - 1),
    ],
)
def test_range_limits_are_inclusive(name: str, value: Any, expected: Any) -> None:
    got = getattr(parse_client_request(valid(**{name: value})), name)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", MAX_TOKENS_LIMIT + 1),
        ("max_tokens", "10"),
        ("max_tokens", 10.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", 5.01),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.5"),
        ("temperature", True),
        ("top_p", -0.01),
        ("top_p", 1.01),
        ("top_p", False),
        ("timeout_ms", 0),
        ("timeout_ms", 86_400_001),
        ("timeout_ms", 1.5),
        ("timeout_ms", True),
        ("seed", -1),
        ("seed", 2**32),
        ("seed", True),
    ],
)
def test_out_of_range_or_mistyped_numbers_are_named(name: str, value: Any) -> None:
    assert_rejected(valid(**{name: value}), f"'{name}'")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("END", ("END",)), (["a", "b"], ("a", "b")), (["x" * 64] * 8, ("x" * 64,) * 8)],
)
def test_stop_accepts_a_string_or_a_list(value: Any, expected: tuple[str, ...]) -> None:
    assert parse_client_request(valid(stop=value)).stop == expected


@pytest.mark.parametrize(
    "value",
    ["", [""], [1], ["a", None], {"a": 1}, ["x"] * 9, ["x" * 65], 3],
    ids=["empty-str", "empty-item", "int-item", "none-item", "map", "too-many", "too-long", "int"],
)
def test_bad_stop_is_named(value: Any) -> None:
    assert_rejected(valid(stop=value), "'stop'")


@pytest.mark.parametrize("value", [1, 0, "yes", "true"])
def test_stream_must_be_a_bool(value: Any) -> None:
    assert_rejected(valid(stream=value), "'stream'")


def test_json_schema_must_be_a_map() -> None:
    assert_rejected(valid(json_schema=["type", "object"]), "'json_schema'")


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_is_accepted(route: str) -> None:
    assert parse_client_request(valid(route=route)).route == route


@pytest.mark.parametrize("priority", PRIORITIES)
def test_every_priority_is_accepted(priority: str) -> None:
    assert parse_client_request(valid(priority=priority)).priority == priority


@pytest.mark.parametrize(
    ("name", "value"),
    [("route", "gpu"), ("route", 1), ("priority", "urgent"), ("priority", ["normal"])],
)
def test_bad_route_or_priority_is_named(name: str, value: Any) -> None:
    assert_rejected(valid(**{name: value}), f"'{name}'")


def test_engine_fields_carry_only_what_a_worker_needs() -> None:
    req = parse_client_request(
        {
            "id": "r1",
            "op": "chat",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "stop": "\n",
            "timeout_ms": 500,
            "route": "llm",
            "priority": "critical",
        }
    )
    assert req.engine_fields() == {
        "op": "chat",
        "stream": False,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "stop": ["\n"],
    }


def test_cache_prompt_false_reaches_the_worker_and_true_is_the_default() -> None:
    assert parse_client_request(valid()).cache_prompt is True
    off = parse_client_request(valid(cache_prompt=False))
    assert off.cache_prompt is False and off.engine_fields()["cache_prompt"] is False
    # On is the worker's default: sent or not, a worker reuses prefixes.
    assert "cache_prompt" not in parse_client_request(valid(cache_prompt=True)).engine_fields()
    assert_rejected(valid(cache_prompt="no"), "'cache_prompt'")
    assert_rejected(valid(cache_prompt=0), "'cache_prompt'")


# --------------------------------------------------------------------------- replies


def test_ok_reply_shape() -> None:
    assert p.ok_reply("r1", text="hi", usage={"completion_tokens": 1}) == {
        "id": "r1",
        "status": "ok",
        "text": "hi",
        "usage": {"completion_tokens": 1},
    }


def test_partial_reply_shape() -> None:
    assert p.partial_reply(3, "tok", 0) == {"id": 3, "status": "partial", "text": "tok", "index": 0}


def test_minimal_error_reply_shape() -> None:
    body = p.error_reply(None, ErrorCode.BAD_REQUEST, "field 'id' is bad")
    assert body == {
        "id": None,
        "status": "error",
        "code": 400,
        "error": "BAD_REQUEST",
        "message": "field 'id' is bad",
    }
    assert type(body["code"]) is int  # a plain int on the wire, not an IntEnum


def test_full_error_reply_shape_survives_msgpack() -> None:
    body = p.error_reply(
        "r1",
        ErrorCode.UNAVAILABLE,
        "worker lost",
        retry_after_ms=1500,
        text="partial",
        reason="worker_lost",
    )
    assert p.unpack_map(p.pack(body)) == {
        "id": "r1",
        "status": "error",
        "code": 503,
        "error": "UNAVAILABLE",
        "message": "worker lost",
        "retry_after_ms": 1500,
        "text": "partial",
        "reason": "worker_lost",
    }


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_wire_code_maps_back_to_its_class(code: ErrorCode) -> None:
    err = error_from_wire(int(code), "msg", retry_after_ms=10, partial_text="t")
    assert isinstance(err, EdgeNodeError) and type(err) is ERROR_BY_CODE[code]
    assert err.code == code
    assert (err.message, err.retry_after_ms, err.partial_text) == ("msg", 10, "t")


def test_unknown_wire_code_becomes_internal() -> None:
    assert error_from_wire(418, "teapot").code == ErrorCode.INTERNAL


# --------------------------------------------------------------------------- worker frames


@pytest.mark.parametrize("command", list(WorkerCommand))
def test_worker_frames_round_trip(command: WorkerCommand) -> None:
    body = {"rid": 3, "text": "x", "usage": {"n": 1}}
    frames = p.to_worker_frames(b"w1", command, body)
    assert frames[:2] == [b"w1", p.WORKER_TAG + b" " + command.value]
    assert len(frames) == 3  # routing id, header, body: EDGE/W1 had 5
    assert p.parse_worker_frames(frames[1:]) == (command, body)


def test_worker_frames_default_to_an_empty_body() -> None:
    assert p.parse_worker_frames(p.worker_frames(WorkerCommand.HEARTBEAT)) == (
        WorkerCommand.HEARTBEAT,
        {},
    )


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"EDGE/W2 READY"],
        [b"EDGE/W2 READY", p.pack({}), b"x"],
        [b"", b"EDGE/W1", b"READY", p.pack({})],
        [b"EDGE/W1 READY", p.pack({})],
        [b"EDGE/W2", b"READY"],
        [p.CLIENT_TAG + b" READY", p.pack({})],
    ],
    ids=["none", "one-frame", "three-frames", "edge-w1", "w1-tag", "no-command", "client-tag"],
)
def test_parse_worker_frames_rejects_bad_framing(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError, match="EDGE/W2 COMMAND"):
        p.parse_worker_frames(frames)


def test_parse_worker_frames_names_an_unknown_command() -> None:
    with pytest.raises(ProtocolError, match="HELLO"):
        p.parse_worker_frames([p.WORKER_TAG + b" HELLO", p.pack({})])


def test_parse_worker_frames_rejects_a_non_map_body() -> None:
    with pytest.raises(ProtocolError, match="map"):
        p.parse_worker_frames([p.WORKER_TAG + b" FINAL", msgpack.packb([1])])


# --------------------------------------------------------------------------- size


def test_body_at_the_limit_is_accepted() -> None:
    assert p.check_body_size(b"x" * 100, 100) is None  # no TooLarge raised


def test_body_over_the_limit_is_too_large() -> None:
    with pytest.raises(TooLarge) as info:
        p.check_body_size(b"x" * 101, 100)
    assert info.value.code == ErrorCode.TOO_LARGE == 413
    assert "101" in info.value.message and "100" in info.value.message


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"json_schema": {"const": 2**64 + 1}}, "integers go from -2\\*\\*63"),
        ({"n": -(2**63) - 1}, "out of range"),
        ({"stop": {"a", "b"}}, "'set'"),
    ],
)
def test_a_value_msgpack_cannot_carry_is_a_protocol_error(body: dict[str, Any], why: str) -> None:
    """msgpack's OverflowError reached a client's caller untyped (break-it pass, session 17)."""
    with pytest.raises(ProtocolError, match=f"cannot be encoded as msgpack.*{why}"):
        p.pack(body)


@pytest.mark.parametrize(
    ("key", "named"),
    [(1, "an integer"), (1.5, "a float"), (True, "a boolean"), (None, "nil"), ((1, 2), "an array")],
)
def test_a_non_string_key_is_named_and_the_400_keeps_the_requests_id(key: Any, named: str) -> None:
    """An array key (valid msgpack, as a Python client sends a tuple key) lost the id of
    its 400, so the client waited its whole timeout for a reply it could not match
    (break-it pass, session 18); every key type was reported as "an integer"."""
    body = msgpack.packb({"id": "k1", "op": "generate", "json_schema": {key: "x"}})
    with pytest.raises(ProtocolError, match=f"must be msgpack str, got {named}$"):
        p.unpack_map(body)
    assert p.salvage_id(body) == "k1"
