"""JSON lines a user greps and filters: non-ASCII ids as UTF-8 (one line, valid
UTF-8 whatever they hold), the levels of events, ``worker_verdict``'s boolean
``at_limit`` and what a ``replied`` line says (the real node's logs:
tests/integration/test_json_logs_node.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from broker.breaker import BreakerSettings, BreakerState, Transition
from broker.exits import ExitCause
from broker.protocol import WorkerCommand
from broker.routing import RoutingSettings
from brokerkit import FAST, RULES, W1, BrokerHarness, bodies, generate
from node.app import (
    REPLIED_MESSAGE_MAX_CHARS,
    log_breaker_transition,
    log_paths,
    log_pressure_change,
    replied_fields,
)
from node.config import PressureSection
from node.observe.logs import JsonFormatter, about_request
from node.pressure import CpuPressureMonitor
from node.supervisor import exit_level, verdict_event
from node.worker import EXIT_MODEL_LOAD

ROOT = Path(__file__).resolve().parents[2]


def line_of(request_id: object) -> str:
    rec = logging.LogRecord("edgenode.node", logging.INFO, __file__, 1, "x", None, None)
    rec.__dict__.update(about_request(request_id, step="replied"))
    return JsonFormatter("broker").format(rec)


def json_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(JsonFormatter("broker").format(r)) for r in caplog.records]


# ---------------------------------------------------------------- D4: UTF-8


def test_a_non_ascii_id_is_written_as_is_so_the_readme_grep_finds_it() -> None:
    line = line_of("ünï-ドア")
    assert '"request_id":"ünï-ドア"' in line
    assert json.loads(line)["request_id"] == "ünï-ドア"


@pytest.mark.parametrize(
    "odd",
    ["a\u2028b", "a\u2029b", "a\x85b", "a\x7fb", "a\x1cb\x1db\x1eb", "a\nb\rc", "a\ud800b", 'q"\\'],
)
def test_whatever_an_id_holds_its_line_stays_one_line_of_valid_utf8(odd: str) -> None:
    line = line_of(odd)
    assert line.splitlines() == [line]  # str.splitlines breaks at U+2028/9, NEL, \x1c-\x1e too
    line.encode("utf-8")  # a lone surrogate would raise here
    assert json.loads(line)["request_id"] == odd


def test_json_lines_are_utf8_even_when_the_locale_says_ascii(tmp_path: Path) -> None:
    code = (
        "import logging\n"
        "from node.observe.logs import about_request, configure\n"
        "configure('info', 'json', 'broker')\n"
        "logging.getLogger('edgenode.t').info('x', extra=about_request('ünï'))\n"
    )
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, timeout=30, check=True
    )
    assert '"request_id":"ünï"'.encode() in done.stderr


# ---------------------------------------------------------------- D7: levels


def test_a_clean_exit_at_stop_is_info_an_unasked_one_a_warning_a_load_failure_an_error() -> None:
    sigterm, zero = ExitCause(signal="SIGTERM"), ExitCause(code=0)
    assert exit_level(zero, stopping=True) == logging.INFO
    assert exit_level(sigterm, stopping=True) == logging.INFO
    assert exit_level(zero, stopping=False) == logging.WARNING  # nobody asked it to go
    assert exit_level(sigterm, stopping=False) == logging.WARNING
    assert exit_level(ExitCause(signal="SIGKILL"), stopping=True) == logging.WARNING  # past grace
    assert exit_level(ExitCause(signal="SIGSEGV"), stopping=True) == logging.WARNING
    killed = ExitCause(verdict="hung", signal="SIGTERM")
    assert exit_level(killed, stopping=True) == logging.WARNING
    load = ExitCause(code=EXIT_MODEL_LOAD, deterministic=True, meaning="model failed to load")
    assert exit_level(load, stopping=False) == logging.ERROR
    assert exit_level(load, stopping=True) == logging.ERROR


def test_the_breaker_opening_is_a_warning_and_recovering_is_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed, open_, half = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
    with caplog.at_level(logging.INFO, logger="edgenode.node"):
        for old, new in [(closed, open_), (open_, half), (half, open_), (half, closed)]:
            log_breaker_transition(Transition(1.0, old, new, "why"))
    got = [(o["event"], o["from"], o["to"], o["level"]) for o in json_lines(caplog)]
    assert got == [
        ("breaker_transition", "closed", "open", "warning"),
        ("breaker_transition", "open", "half_open", "info"),
        ("breaker_transition", "half_open", "open", "warning"),
        ("breaker_transition", "half_open", "closed", "info"),
    ]


def test_memory_pressure_rising_is_a_warning_and_falling_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="edgenode.node"):
        for old, new in [
            ("ok", "high"),
            ("high", "critical"),
            ("critical", "high"),
            ("high", "ok"),
        ]:
            log_pressure_change("memory", old, new, {"used_pct": 90.0})
    assert [(o["to"], o["level"]) for o in json_lines(caplog)] == [
        ("high", "warning"),
        ("critical", "warning"),
        ("high", "info"),  # falling, though still shedding
        ("ok", "info"),
    ]


def test_cpu_pressure_rising_to_high_is_a_warning_and_clearing_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    psi = tmp_path / "cpu"
    mon = CpuPressureMonitor(PressureSection(cpu_warn_pct=50.0, cpu_clear_pct=25.0), psi)
    with caplog.at_level(logging.INFO, logger="edgenode.pressure"):
        for t, avg10 in enumerate([60.0, 10.0]):
            psi.write_text(f"some avg10={avg10:.2f} avg60=0 avg300=0 total=1\n")
            mon.poll(float(t))
    got = [(o["event"], o["resource"], o["to"], o["level"]) for o in json_lines(caplog)]
    assert got == [
        ("pressure_change", "cpu", "high", "warning"),
        ("pressure_change", "cpu", "ok", "info"),
    ]


# ---------------------------------------------------------------- D8: at_limit


def test_worker_verdict_at_limit_is_a_boolean() -> None:
    near = ExitCause(verdict="hung", at_limit="working set 61 MiB of memory.max 64 MiB")
    for cause, expected in [(ExitCause(verdict="dead"), False), (near, True)]:
        rec = logging.LogRecord(
            "edgenode.supervisor", logging.WARNING, __file__, 1, "x", None, None
        )
        rec.__dict__.update(verdict_event("llm-0", 1234, cause))
        obj = json.loads(JsonFormatter("broker").format(rec))
        assert obj["at_limit"] is expected
    assert "working set 61 MiB" in near.describe()  # the words stay in reason


# ---------------------------------------------------------------- D10: replied


def replied(h: BrokerHarness, caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The ``replied`` lines of what ``h``'s outbox holds, as JSON."""
    with caplog.at_level(logging.DEBUG, logger="edgenode.node"):
        log_paths(h.broker.outbox)
    return [o for o in json_lines(caplog) if o.get("step") == "replied"]


def test_a_degraded_reply_says_so_and_why_on_its_replied_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    routing = RoutingSettings("degrade", 200)
    h = BrokerHarness(FAST, routing, BreakerSettings(minimum_calls=2, open_wait_ms=1000))
    h.ready(W1, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    h.send(generate("q", prompt="turn on the kitchen lights"), 0.0)
    h.drain_workers()
    h.tick(0.25, keepalive=(W1, RULES))
    (asked,) = bodies(h.drain_workers(), RULES, WorkerCommand.REQUEST)
    h.final(RULES, asked["rid"], 0.26, text='{"intent":"on"}', confidence=0.9, rule="on")
    (line,) = replied(h, caplog)
    assert (line["request_id"], line["status"]) == ("q", "ok")
    assert (line["degraded"], line["degrade_reason"]) == (True, "latency_budget")
    assert "code" not in line and "message" not in line
    assert "kitchen" not in json.dumps(line) and "intent" not in json.dumps(line)


def test_an_error_reply_gives_its_code_reason_and_message_cut_short(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = BrokerHarness(FAST)
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("x", prompt="a secret prompt"), 0.0)
    h.drain_workers()
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGSEGV"), 0.3)
    (line,) = replied(h, caplog)
    assert (line["status"], line["code"], line["reason"]) == ("error", 503, "worker_lost")
    assert line["message"].startswith("worker lost: killed by SIGSEGV")
    assert "secret" not in json.dumps(line) and "degraded" not in line
    long = {"status": "error", "code": 500, "reason": "x", "message": "m" * 1000}
    cut = replied_fields(long)["message"]
    assert (
        cut.startswith("m" * REPLIED_MESSAGE_MAX_CHARS)
        and len(cut) == REPLIED_MESSAGE_MAX_CHARS + 1
    )
