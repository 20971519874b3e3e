"""The size limits of every hop, from the one setting ``broker.max_body_bytes``
(``broker.protocol.message_limits``, issue 11): what the frontend accepts fits a
REQUEST, what a worker may send back fits a FINAL, and both fit every socket's cap."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest

from broker import protocol as p
from broker.client_request import parse_client_request
from broker.errors import ConfigError
from node import config as cfg
from node.config import from_dict

SETTINGS = [p.MIN_BODY_BYTES, 4096, p.DEFAULT_MAX_BODY_BYTES, 2 * 2**20, p.MAX_BODY_BYTES]


def float32(value: float) -> bytes:
    """A msgpack float 32 (5 bytes), which the broker re-encodes as a float 64 (9)."""
    return b"\xca" + struct.pack(">f", value)


def worst_body(size: int) -> bytes:
    """A valid request body of at most ``size`` bytes, nearly all float32s in its
    ``json_schema``: the body that grows most when the broker re-encodes it."""
    head = {"id": 2**62, "op": "generate", "prompt": "hi", "stream": False, "json_schema": None}
    start = msgpack.packb(head)[:-1]  # without the nil: the schema follows

    def body(count: int) -> bytes:
        array = b"\xdd" + struct.pack(">I", count) + float32(0.5) * count
        return start + b"\x81" + msgpack.packb("enum") + array

    return body((size - len(body(0))) // 5)


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_cap_sits_above_what_the_nodes_own_parts_send(setting: int) -> None:
    limits = p.message_limits(setting)
    assert limits.body_bytes == limits.text_bytes == setting
    assert limits.reply_bytes == setting + p.ENVELOPE_BYTES
    assert limits.frame_bytes >= max(4 * setting, p.MIN_FRAME_BYTES)
    assert limits.frame_bytes >= limits.reply_bytes  # a FINAL always fits


@pytest.mark.parametrize("setting", [p.MIN_BODY_BYTES, p.DEFAULT_MAX_BODY_BYTES, 2 * 2**20])
def test_the_request_that_grows_most_on_reencoding_still_fits_the_worker_hop(setting: int) -> None:
    body = worst_body(setting)
    assert len(body) <= setting  # the frontend accepts it
    req = parse_client_request(p.unpack_map(body))
    # What the broker sends a worker (Dispatcher.dispatch), with the largest numbers.
    request = {"rid": 2**63 - 1, **req.engine_fields(), "max_tokens": 2**31, "timeout_ms": 2**31}
    frame = p.worker_frames(p.WorkerCommand.REQUEST, request)[-1]
    assert len(frame) > 1.7 * len(body)  # it did grow: float32 -> float64
    assert len(frame) <= 1.8 * len(body) + 64 <= p.message_limits(setting).frame_bytes


@pytest.mark.parametrize("setting", [0, p.MIN_BODY_BYTES - 1, p.MAX_BODY_BYTES + 1])
def test_a_setting_out_of_range_is_a_config_error_naming_the_key(setting: int) -> None:
    with pytest.raises(ConfigError, match=r"broker\.max_body_bytes must be in 1024\.\.16777216"):
        cfg.validate(from_dict({"broker": {"max_body_bytes": setting}}))


def test_a_final_that_fits_is_sent_as_it_is() -> None:
    limits = p.message_limits(p.MIN_BODY_BYTES)
    body: dict[str, Any] = {"rid": 7, "status": "ok", "text": "é" * (p.MIN_BODY_BYTES // 2)}
    assert p.fit_final(body, limits) is body  # 1024 bytes of UTF-8: exactly the limit


@pytest.mark.parametrize(
    "body",
    [
        {"rid": 7, "status": "ok", "text": "é" * 600, "finish_reason": "stop"},  # text too long
        {"rid": 7, "status": "ok", "text": "ok", "rule": "r" * (p.ENVELOPE_BYTES + 1024)},
        {"rid": 7, "status": "cancelled", "code": 499, "message": "cancelled", "text": "x" * 2000},
    ],
    ids=["text", "other-fields", "error-with-long-partial-text"],
)
def test_a_final_that_does_not_fit_becomes_413_with_its_text_clipped(body: dict[str, Any]) -> None:
    limits = p.message_limits(p.MIN_BODY_BYTES)
    fitted = p.fit_final(body, limits)
    assert (fitted["rid"], fitted["status"], fitted["code"]) == (7, "error", 413)
    expected = "the most a reply may carry: 1024 bytes of text (broker.max_body_bytes)"
    assert expected in fitted["message"]
    assert len(fitted["text"].encode()) <= limits.text_bytes
    assert body["text"].startswith(fitted["text"])  # a prefix, cut at a character boundary
    assert len(p.pack(fitted)) <= limits.reply_bytes


def test_a_final_stopped_for_outgrowing_a_reply_is_413_even_if_its_text_fits() -> None:
    limits = p.message_limits(p.MIN_BODY_BYTES)
    body = {"rid": 3, "status": "cancelled", "code": 499, "message": "cancelled", "text": "ab"}
    fitted = p.fit_final(body, limits, outgrew=True)
    assert (fitted["code"], fitted["text"]) == (413, "ab")


def test_clip_text_cuts_at_a_character_boundary() -> None:
    assert p.clip_text("aé€", 10) == "aé€"
    assert p.clip_text("aé€", 5) == "aé"  # € needs 3 more bytes than the 2 left
    assert p.clip_text("aé€", 2) == "a"
