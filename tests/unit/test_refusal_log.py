"""The bound on refused-key log lines (``broker.refusal_log``), alone with a fake
clock, and in the loop's ZAP handler (``broker.loop.ZapHandler``) answering real
ZAP requests over inproc, with a fake clock and the log captured."""

from __future__ import annotations

import logging
import os

import pytest
import zmq
from zmq.utils import z85

from broker.loop import ZapHandler, zap_domain
from broker.refusal_log import FIRST_KEYS, WINDOW_S, RefusalLog
from broker.security import CurveServer


def test_a_key_is_named_once_a_window_and_the_rest_is_summed_up() -> None:
    refusals = RefusalLog()
    assert refusals.refused(b"k1", 0.0)
    assert not refusals.refused(b"k1", 1.0)  # again within the window: counted only
    assert refusals.refused(b"k2", 2.0)
    assert refusals.summary(59.0) is None  # the window is not over
    assert refusals.summary(60.0) == (1, 3)
    assert refusals.summary(200.0) is None  # nothing since
    assert refusals.refused(b"k1", 200.0)  # a new window names it again
    assert refusals.summary(260.0) is None  # every refusal got its line


def test_a_flood_of_distinct_keys_writes_a_bounded_number_of_lines() -> None:
    """The reported flood: ~4,100 bad connections in 8 s, each with a new key."""
    refusals = RefusalLog()
    lines = 0
    for i in range(4100):
        now = i * 8.0 / 4100
        summary = refusals.summary(now)
        lines += summary is not None
        lines += refusals.refused(f"key{i}".encode(), now)
    assert lines == FIRST_KEYS
    assert refusals.summary(WINDOW_S) == (4100 - FIRST_KEYS, 4100)


def test_a_sustained_flood_writes_at_most_a_window_s_bound_per_window() -> None:
    refusals = RefusalLog()
    lines_per_window: dict[int, int] = {}
    total = 0
    for i in range(30 * 600):  # 30 refusals a second for 10 minutes
        now = i / 30
        window = int(now // WINDOW_S)
        if (summary := refusals.summary(now)) is not None:
            total += summary[1]
            lines_per_window[window] = lines_per_window.get(window, 0) + 1
        if refusals.refused(os.urandom(8), now):
            lines_per_window[window] = lines_per_window.get(window, 0) + 1
    total += (refusals.summary(1e9) or (0, 0))[1]
    assert total == 30 * 600  # the summaries count every refusal
    assert max(lines_per_window.values()) <= FIRST_KEYS + 1
    assert len(lines_per_window) == 10


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def zap_request(dealer: zmq.Socket[bytes], n: int, key: bytes) -> None:
    """A ZAP request (RFC 27) for a CURVE peer with public ``key`` (32 bytes)."""
    domain = zap_domain("frontend").encode()
    request = [b"1.0", str(n).encode(), domain, b"10.0.0.9", b"", b"CURVE", key]
    dealer.send_multipart([b"", *request])


def test_the_zap_handler_logs_a_flood_within_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    public, secret = zmq.curve_keypair()
    allowed_public, _ = zmq.curve_keypair()
    server = CurveServer(public, secret, frozenset({allowed_public}))
    clock = FakeClock()
    zap = ZapHandler(ctx, {"frontend": server}, clock)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("inproc://zeromq.zap.01")
    codes: list[bytes] = []
    try:
        with caplog.at_level(logging.WARNING, logger="broker.loop"):
            for i in range(500):
                zap_request(dealer, i, os.urandom(32))  # a new stranger each time
            zap_request(dealer, 500, z85.decode(allowed_public))
            while len(codes) < 501:
                assert zap.socket.poll(5000) or dealer.poll(0)
                zap.handle()
                while dealer.poll(0):
                    codes.append(dealer.recv_multipart()[3])  # ["", version, id, code, ...]
            assert codes.count(b"400") == 500 and codes.count(b"200") == 1
            named = [r for r in caplog.records if "refused a CURVE key" in r.getMessage()]
            assert len(named) == FIRST_KEYS
            assert len(caplog.records) == FIRST_KEYS
            clock.now += WINDOW_S
            zap.tick(clock())
            summaries = [r.getMessage() for r in caplog.records[FIRST_KEYS:]]
            assert summaries == [
                f"{500 - FIRST_KEYS} CURVE key refusal(s) in the last 60 s not logged"
                " (500 in all; status counts every one)"
            ]
            zap.tick(clock.now + 1000)  # nothing new: no line
            assert len(caplog.records) == FIRST_KEYS + 1
    finally:
        dealer.close(0)
        zap.close()
        ctx.term()
