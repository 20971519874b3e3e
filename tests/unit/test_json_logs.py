"""Structured logs: the broker core's path records (``RequestTrace``) and the JSON
lines of ``node.observe.logs`` (the real node's logs: tests/integration/test_json_logs_node.py)."""

from __future__ import annotations

import io
import json
import logging
import sys
from datetime import datetime, timezone

import pytest

from broker.exits import ExitCause
from brokerkit import CLIENT, W1, W2, BrokerHarness, generate
from node.app import log_pressure_change
from node.observe.logs import (
    TEXT_FORMAT,
    JsonFormatter,
    about_request,
    configure,
    event_extra,
    rfc3339,
)


def steps(h: BrokerHarness) -> list[tuple[str, str | int, bytes, str, str]]:
    return [(t.step, t.request_id, t.client, t.worker, t.detail) for t in h.broker.outbox.traces]


def test_a_request_leaves_its_path_in_the_outbox_and_its_id_in_the_request(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("a", prompt="why?"), 1.0)
    (req,) = h.requests(W1)
    assert req["request_id"] == "a"  # for the worker's log lines
    h.final(W1, req["rid"], 1.5)
    assert steps(h) == [
        ("admitted", "a", CLIENT, "", "llm normal"),
        ("dispatched", "a", CLIENT, "llm-0", "attempt 1"),
        ("worker_final", "a", CLIENT, "llm-0", "ok"),
    ]
    assert {t.rid for t in h.broker.outbox.traces} == {req["rid"]}
    h.assert_each_answered_once()


def test_a_lost_workers_request_is_traced_requeued_and_dispatched_again(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate(7), 0.1)
    h.drain_workers()
    h.ready(W2, 0.2, worker_id="llm-1")
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.3)
    assert [(s, w, d) for s, rid, _, w, d in steps(h) if rid == 7] == [
        ("admitted", "", "llm normal"),
        ("dispatched", "llm-0", "attempt 1"),
        ("requeued", "", "its worker was lost"),
        ("dispatched", "llm-1", "attempt 2"),
    ]


def test_a_deadline_traces_the_cancel_sent_to_the_worker(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("late", timeout_ms=100), 0.0)
    h.broker.tick(0.2)
    assert steps(h)[-1] == ("cancelling", "late", CLIENT, "llm-0", "")
    assert h.replies()[0]["code"] == 504


def record(msg: str = "hello %s", *args: object, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("edgenode.node", logging.WARNING, __file__, 1, msg, args or None, None)
    rec.__dict__.update(extra)
    return rec


def test_a_json_line_has_the_base_fields_and_its_own() -> None:
    line = JsonFormatter("broker").format(
        record("request %r dispatched", "x", **about_request("x", b"\x00\xab", step="dispatched"))
    )
    obj = json.loads(line)
    assert list(obj)[:6] == ["ts", "level", "logger", "msg", "pid", "role"]
    assert obj["msg"] == "request 'x' dispatched" and obj["level"] == "warning"
    assert (obj["role"], obj["logger"]) == ("broker", "edgenode.node")
    assert (obj["request_id"], obj["client"], obj["step"]) == ("x", "00ab", "dispatched")
    ts = datetime.fromisoformat(obj["ts"].replace("Z", "+00:00"))
    assert ts.tzinfo == timezone.utc and obj["ts"].endswith("Z")


def test_own_fields_never_replace_the_base_ones_and_odd_values_become_text() -> None:
    extra = event_extra("worker_exit", {"pid": 1, "msg": "forged", "path": b"\xff", "to": None})
    obj = json.loads(JsonFormatter("llm-0").format(record("line\nbreak", **extra)))
    assert obj["pid"] != 1 and obj["msg"] == "line\nbreak"
    assert (obj["event"], obj["path"], obj["to"]) == ("worker_exit", "b'\\xff'", None)


def test_a_traceback_is_one_field_of_one_line() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        rec = record("failed", exc_info=sys.exc_info())
    line = JsonFormatter("broker").format(rec)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_rfc3339_is_utc_with_milliseconds() -> None:
    assert rfc3339(0.25) == "1970-01-01T00:00:00.250Z"
    assert rfc3339(1_796_000_000.9999) == "2026-11-30T00:53:20.999Z"  # truncated: never .1000


def test_configure_switches_the_format_without_doubling_lines() -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        text, lines = io.StringIO(), io.StringIO()
        configure("info", "text", "broker", stream=text)
        logging.getLogger("edgenode.t").info("plain")
        configure("debug", "json", "llm-0", stream=lines)
        logging.getLogger("edgenode.t").debug("structured")
        assert text.getvalue().rstrip().endswith(" INFO edgenode.t plain")
        assert TEXT_FORMAT == "%(asctime)s %(levelname)s %(name)s %(message)s"  # as before
        (one,) = lines.getvalue().splitlines()
        assert json.loads(one)["msg"] == "structured" and json.loads(one)["role"] == "llm-0"
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])


def test_a_memory_pressure_change_is_a_pressure_change_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="edgenode.node"):
        log_pressure_change("memory", "ok", "high", {"level": "high", "used_pct": 87.5})
        log_pressure_change("memory", "high", "ok", {"level": "ok", "used_pct": 60.0})
    rising, clear = (json.loads(JsonFormatter("broker").format(r)) for r in caplog.records)
    assert (rising["event"], rising["resource"], rising["from"], rising["to"]) == (
        "pressure_change",
        "memory",
        "ok",
        "high",
    )
    assert (rising["level"], rising["used_pct"]) == ("warning", 87.5)
    assert (clear["level"], clear["to"]) == ("info", "ok")
