"""``[logging] format = "json"`` with real processes (test engine): one request is
followed by its id through the broker's and the worker's logs (a non-ASCII id as
UTF-8, as the README's grep looks for it), and breaker transitions, worker verdicts
and exits, and pressure changes are event lines at their levels."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from broker.errors import ProtocolError
from node.engine import EngineSpec
from node.observe.logs import LOG_EVENTS, JsonFormatter
from node.supervisor import Supervisor
from node.testing import NodeProcess, grep_json, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]

JSON_DEBUG = {"logging": {"format": "json"}, "node": {"log_level": "debug"}}


@pytest.fixture(scope="module")
def json_debug(make_module_node: NodeFactory) -> NodeProcess:
    """One node logging JSON at debug for the tests that send it requests and grep its
    logs for their own (unique) request ids."""
    return make_module_node(**JSON_DEBUG)


def broker_log(node: NodeProcess) -> Path:
    """The foreground node's stderr (``NodeProcess.log``): the broker's log."""
    return node.log


def worker_log(node: NodeProcess, worker_id: str) -> Path:
    return node.run_dir / "logs" / f"{worker_id}.log"


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` as JSON; fails on a line that is not a JSON object."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    parsed = [json.loads(line) for line in lines]
    assert all(isinstance(obj, dict) for obj in parsed)
    return parsed


def events(path: Path, name: str) -> list[dict[str, Any]]:
    return [line for line in json_lines(path) if line.get("event") == name]


def assert_base_fields(line: dict[str, Any], role: str, pid: int) -> None:
    assert {"ts", "level", "logger", "msg", "pid", "role"} <= set(line), line
    assert line["ts"].endswith("Z")
    ts = datetime.fromisoformat(line["ts"].replace("Z", "+00:00"))
    assert ts.tzinfo == timezone.utc
    assert (line["role"], line["pid"]) == (role, pid), line
    assert line["level"] in ("debug", "info", "warning", "error", "critical")


def test_one_request_is_followed_by_its_id_across_the_broker_and_worker_logs(
    json_debug: NodeProcess,
) -> None:
    node = json_debug
    request_id = f"follow-{uuid.uuid4().hex}"
    prompt = f"secret-prompt-{uuid.uuid4().hex}"
    with node.client(wait_ms=10_000) as c:
        reply = c.generate(prompt, id=request_id, max_tokens=4)
    assert reply.id == request_id
    assert node.proc is not None
    broker_pid = node.proc.pid
    workers = {p["worker_id"]: p["pid"] for p in node.status()["processes"]}

    def broker_steps() -> list[dict[str, Any]] | None:
        lines = grep_json(broker_log(node), request_id)
        return lines if "replied" in {line.get("step") for line in lines} else None

    in_broker: list[dict[str, Any]] = wait_for(broker_steps, timeout=10)
    dispatched = [line for line in in_broker if line.get("step") == "dispatched"]
    assert len(dispatched) == 1, in_broker
    worker_id = dispatched[0]["worker"]
    in_worker = grep_json(worker_log(node, worker_id), request_id)

    for line in in_broker:
        assert_base_fields(line, "broker", broker_pid)
        assert line["request_id"] == request_id
        assert line["logger"] == "edgenode.node"
        assert isinstance(line["client"], str) and int(line["client"], 16) >= 0
    for line in in_worker:
        assert_base_fields(line, worker_id, workers[worker_id])
        assert line["request_id"] == request_id
        assert line["logger"] == "edgenode.worker"
    # Its path, in order: received and admitted, dispatched, started and ended on
    # its worker, the worker's final back at the broker, the reply sent.
    assert [line["step"] for line in in_broker] == [
        "admitted",
        "dispatched",
        "worker_final",
        "replied",
    ]
    assert [line["step"] for line in in_worker] == ["started", "final"]
    assert in_worker[-1]["status"] == "ok"
    assert in_broker[-1]["status"] == "ok"
    # Only one client sent it; the prompt is in no log line.
    assert len({line["client"] for line in in_broker}) == 1
    for path in (broker_log(node), worker_log(node, worker_id)):
        assert prompt not in path.read_text()
        json_lines(path)  # every line of both logs is JSON, not only the request's


def test_a_refused_request_is_logged_with_its_id_and_reason(json_debug: NodeProcess) -> None:
    node = json_debug
    request_id = f"too-big-{uuid.uuid4().hex}"
    with node.client(wait_ms=10_000) as c, pytest.raises(ProtocolError):
        c.generate("x", id=request_id, max_tokens=10**9)
    lines = wait_for(lambda: grep_json(broker_log(node), request_id), timeout=10)
    assert [line["step"] for line in lines] == ["replied"]
    assert (lines[0]["request_id"], lines[0]["status"], lines[0]["code"]) == (
        request_id,
        "error",
        400,
    )


def test_breaker_transitions_worker_verdicts_and_exits_are_typed_events(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    psi = tmp_path / "cpu.pressure"
    psi.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    node = make_node(
        logging={"format": "json"},
        breaker={"minimum_calls": 2, "open_wait_ms": 60_000},
        pressure={"cpu_warn_pct": 50.0, "cpu_clear_pct": 25.0, "cpu_psi": str(psi)},
    )
    with node.client(wait_ms=10_000) as c:
        c.generate("one success", max_tokens=2)
    pids = {p["worker_id"]: p["pid"] for p in node.status()["processes"]}
    # llm-0 stops answering: the broker's liveness verdict, then the node kills it;
    # llm-1 is killed from outside. Two failures after one success open the breaker.
    os.kill(pids["llm-0"], signal.SIGSTOP)
    wait_for(lambda: events(broker_log(node), "worker_verdict"), timeout=10)
    os.kill(pids["llm-1"], signal.SIGKILL)
    wait_for(lambda: len(events(broker_log(node), "worker_exit")) >= 2, timeout=10)
    wait_for(lambda: events(broker_log(node), "breaker_transition"), timeout=10)
    psi.write_text("some avg10=90.00 avg60=10.00 avg300=5.00 total=1\n")
    wait_for(lambda: events(broker_log(node), "pressure_change"), timeout=10)

    lines = json_lines(broker_log(node))
    named = {line["event"] for line in lines if "event" in line}
    assert named <= set(LOG_EVENTS), named
    (verdict,) = events(broker_log(node), "worker_verdict")
    assert (verdict["worker"], verdict["worker_pid"], verdict["verdict"]) == (
        "llm-0",
        pids["llm-0"],
        "dead",
    )
    assert verdict["level"] == "warning" and verdict["role"] == "broker"
    assert verdict["at_limit"] is False  # a boolean, not ""
    exits = {e["worker"]: e for e in events(broker_log(node), "worker_exit")}
    assert (exits["llm-0"]["signal"], exits["llm-0"]["verdict"]) == ("SIGKILL", "dead")
    assert (exits["llm-1"]["signal"], exits["llm-1"]["verdict"]) == ("SIGKILL", None)
    assert exits["llm-1"]["worker_pid"] == pids["llm-1"]
    assert {e["level"] for e in exits.values()} == {"warning"}  # nobody asked them to go
    opened = events(broker_log(node), "breaker_transition")[0]
    assert (opened["from"], opened["to"], opened["level"]) == ("closed", "open", "warning")
    assert opened["reason"]
    (cpu,) = events(broker_log(node), "pressure_change")
    assert (cpu["resource"], cpu["from"], cpu["to"]) == ("cpu", "ok", "high")
    assert cpu["level"] == "warning"  # high sheds sheddable work


def test_a_worker_not_ready_in_time_is_a_verdict_event_logged_once_per_process(
    make_node: NodeFactory,
) -> None:
    node = make_node(
        start=False,
        logging={"format": "json"},
        workers={"count": 1, "test_load_ms": 60_000, "ready_timeout_ms": 1000},
    )
    node.start(ready=False)
    wait_for(lambda: events(broker_log(node), "worker_exit"), timeout=15)
    verdicts = events(broker_log(node), "worker_verdict")
    exits = events(broker_log(node), "worker_exit")
    assert verdicts and {v["verdict"] for v in verdicts} == {"not_ready"}
    # One line per process killed, though it is signalled at every tick until reaped.
    killed = [v["worker_pid"] for v in verdicts]
    assert len(killed) == len(set(killed))
    first = exits[0]
    assert (first["worker"], first["verdict"], first["signal"]) == ("llm-0", "not_ready", "SIGKILL")
    assert first["worker_pid"] == killed[0]


def test_a_non_ascii_id_is_found_by_the_readme_grep_in_the_broker_and_worker_logs(
    json_debug: NodeProcess,
) -> None:
    node = json_debug
    request_id = f"ünï-ドア-{uuid.uuid4().hex}"
    with node.client(wait_ms=10_000) as c:
        assert c.generate("hello", id=request_id, max_tokens=2).id == request_id
    needle = f'"request_id":"{request_id}"'.encode()  # README: grep '"request_id":"ünï"'

    def replied() -> bool:
        return b'"step":"replied"' in b"".join(
            line for line in broker_log(node).read_bytes().splitlines() if needle in line
        )

    wait_for(replied, timeout=10)
    in_workers = [
        path for path in (node.run_dir / "logs").glob("*.log") if needle in path.read_bytes()
    ]
    assert len(in_workers) == 1, in_workers  # the worker that ran it
    for path in (broker_log(node), in_workers[0]):
        path.read_bytes().decode("utf-8")  # the whole log is valid UTF-8
        json_lines(path)


def test_a_clean_stop_logs_the_worker_exits_at_info(make_node: NodeFactory) -> None:
    node = make_node(logging={"format": "json"})
    pids = {p["worker_id"]: p["pid"] for p in node.status()["processes"]}
    assert node.stop() == 0
    exits = {e["worker"]: e for e in events(broker_log(node), "worker_exit")}
    assert set(exits) == set(pids), exits
    for worker_id, line in exits.items():
        assert line["worker_pid"] == pids[worker_id]
        assert line["level"] == "info", line
        assert line["code"] == 0 or line["signal"] == "SIGTERM", line


def test_a_worker_that_cannot_load_is_an_error_event(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "rules.toml"
    bad.write_text("garbage [[[\n")
    spec = WorkerSpec(
        worker_id="rules-0",
        backend="tcp://127.0.0.1:1",  # never reached: the load fails first
        engine=EngineSpec(kind="rules", model_path=str(bad), n_ctx=0, n_batch=0, threads=1),
    )
    sup = Supervisor([spec], tmp_path / "logs", ready_timeout_s=60, backoff_s=0, backoff_max_s=0)
    try:
        with caplog.at_level(logging.INFO, logger="edgenode.supervisor"):
            sup.start()
            handle = sup.handles["rules-0"]

            def failed() -> bool:
                sup.tick(time.monotonic())
                return handle.state == "failed"

            wait_for(failed, timeout=30)
        (line,) = [
            json.loads(JsonFormatter("broker").format(r))
            for r in caplog.records
            if getattr(r, "fields", {}).get("event") == "worker_exit"
        ]
        assert (line["level"], line["code"], line["worker"]) == ("error", 66, "rules-0")
    finally:
        sup.stop(grace_s=5)
