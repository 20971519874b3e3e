"""A body msgpack refuses gets a 400 whose message says what is wrong, never an empty cause.

msgpack's C unpacker raises ``FormatError`` (byte 0xc1) and ``StackError`` (too
deep) with no text, which made the message end in ``body is not valid msgpack: ``.
"""

from __future__ import annotations

import pytest

from broker import protocol as p
from broker.errors import ProtocolError


def nested(lists: int) -> bytes:
    """``{"a": [[...[nil]...]]}`` with ``lists`` nested one-element lists, as msgpack."""
    return b"\x81\xa1a" + b"\x91" * lists + b"\xc0"


def refusal(data: bytes) -> str:
    with pytest.raises(ProtocolError) as info:
        p.unpack_map(data)
    message = info.value.message
    assert message.startswith("body is not valid msgpack: ")
    assert message.removeprefix("body is not valid msgpack: ").strip(), message
    return message


@pytest.mark.parametrize("data", [b"\xc1", b"\x81\xa1a\xc1"], ids=["alone", "as-a-value"])
def test_reserved_byte_is_named(data: bytes) -> None:
    assert "0xc1" in refusal(data)


def test_nesting_beyond_the_limit_says_so() -> None:
    message = refusal(nested(p.MSGPACK_MAX_DEPTH))  # the map + MAX_DEPTH lists: one too many
    assert f"nesting deeper than {p.MSGPACK_MAX_DEPTH}" in message


def test_nesting_at_the_limit_decodes() -> None:
    """The constant is msgpack's real limit: the map and MAX_DEPTH - 1 lists still decode."""
    body = p.unpack_map(nested(p.MSGPACK_MAX_DEPTH - 1))
    depth, item = 1, body["a"]
    while isinstance(item, list):
        depth, item = depth + 1, item[0]
    assert depth == p.MSGPACK_MAX_DEPTH


@pytest.mark.parametrize(
    "data",
    [b"\x93\x01", b"\x82\xa1a", b"\x81\xa5ab"],
    ids=["list", "map", "str"],
)
def test_truncated_body_says_so(data: bytes) -> None:
    """msgpack's own text is ``3 exceeds max_array_len(2)`` for a length the body cannot
    hold (its limits are the body's size), ``incomplete input`` for a short string."""
    message = refusal(data)
    assert "truncated" in message or "incomplete" in message


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (b"", "Unpack failed: incomplete input"),
        (p.pack({"id": 1}) + b"\x00", "received extra data"),
    ],
    ids=["empty", "trailing-bytes"],
)
def test_other_refusals_keep_msgpack_text(data: bytes, text: str) -> None:
    assert text in refusal(data)
