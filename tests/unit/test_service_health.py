"""``node.service.health.judge`` (the rule behind ``status --ready`` and systemd's
STATUS= line), the notify protocol's environment (``node.service.notify``) and
the watch view's rates (``node.cli.watch``)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

from broker.kinds import REGISTERED_STATES
from broker.workers import WorkerState
from node.cli.watch import Sample, rates
from node.service.health import judge
from node.service.notify import Notifier, socket_address, watchdog_interval_s


def status(
    mode: str = "degrade",
    model: int = 1,
    rules: bool = True,
    breaker: str = "closed",
    draining: bool = False,
    processes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A status map with ``model`` registered model workers of 2 and a rule worker."""
    workers = [{"kind": "llm", "state": "ready"} for _ in range(model)]
    if rules:
        workers.append({"kind": "rules", "state": "busy"})
    procs = processes or [
        {"worker_id": "llm-0", "state": "ready", "restarts": 0},
        {"worker_id": "llm-1", "state": "ready", "restarts": 0},
        {"worker_id": "rules-0", "state": "ready", "restarts": 0},
    ]
    return {
        "draining": draining,
        "routing": {"mode": mode, "breaker": {"state": breaker}},
        "workers": workers,
        "processes": procs,
        "pressure": "ok",
        "cpu_pressure": "ok",
    }


@pytest.mark.parametrize(
    ("mode", "model", "rules", "breaker", "expected"),
    [
        ("degrade", 1, False, "closed", "serving"),
        ("degrade", 0, True, "closed", "serving"),  # the rules take over
        ("degrade", 1, True, "open", "serving"),  # breaker open: the rules take over
        ("degrade", 1, False, "open", "unavailable"),
        ("degrade", 0, False, "closed", "unavailable"),
        ("full", 1, False, "half_open", "serving"),
        ("full", 1, True, "open", "unavailable"),  # the model only, and it refuses
        ("full", 0, True, "closed", "unavailable"),
        ("shadow", 0, True, "closed", "serving"),  # the rules answer
        ("shadow", 2, False, "closed", "unavailable"),
        ("dual", 2, False, "closed", "unavailable"),
        ("dual", 0, True, "open", "serving"),
    ],
)
def test_serving_follows_the_routing_mode(
    mode: str, model: int, rules: bool, breaker: str, expected: str
) -> None:
    health = judge(status(mode, model, rules, breaker))
    assert health.state == expected, health
    assert health.ready == (expected == "serving")
    assert health.line.startswith(expected)
    assert f"model {model}/2 ready" in health.line


@pytest.mark.parametrize("active", [set(), {7}], ids=["idle", "busy"])
def test_a_worker_the_broker_registered_counts_ready_or_busy(active: set[int]) -> None:
    # The broker's own status entry (broker.kinds.RegisteredState), not a hand-made one.
    entry = WorkerState(b"w", "llm-0", "llm", slots=2, last_seen=0.0, active=active).snapshot(0.0)
    assert entry["state"] in REGISTERED_STATES
    serving = status("full", model=0, rules=False)
    serving["workers"] = [entry]
    assert judge(serving).state == "serving"
    serving["workers"] = [{**entry, "state": "gone"}]
    assert judge(serving).state == "unavailable"


def test_stopping_beats_serving() -> None:
    health = judge(status(draining=True))
    assert (health.state, health.ready) == ("stopping", False)


def test_starting_until_a_worker_was_ever_ready() -> None:
    first = [
        {"worker_id": "llm-0", "state": "starting", "restarts": 0},
        {"worker_id": "rules-0", "state": "starting", "restarts": 0},
    ]
    assert judge(status(model=0, rules=False, processes=first)).state == "starting"
    again = [{**first[0], "restarts": 1}, first[1]]  # a restart is no start
    assert judge(status(model=0, rules=False, processes=again)).state == "unavailable"


def test_rules_only_is_said() -> None:
    line = judge(status(model=0)).line
    assert line.startswith("serving (rules only): model 0/2 ready, rules ready"), line


def test_an_empty_map_is_not_ready() -> None:
    assert not judge({}).ready


def test_socket_addresses() -> None:
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@abstract/name") == "\0abstract/name"
    assert socket_address("vsock:2:1234") is None
    assert socket_address("") is None


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "20000000"}, 20.0),
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "4242"}, 20.0),  # ours
        ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}, None),  # another process's
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval_s(dict(env), pid=4242) == expected


def test_from_environ_unsets_the_variables(tmp_path: Path) -> None:
    env = {"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "2000000", "PATH": "/bin"}
    notifier = Notifier.from_environ(env)
    try:
        assert env == {"PATH": "/bin"}  # children cannot notify in the node's name
        assert notifier.enabled and notifier.watchdog_s == 2.0
    finally:
        notifier.close()


def test_messages_on_change_and_a_vanished_manager(tmp_path: Path) -> None:
    path = tmp_path / "n.sock"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(path))
    manager.settimeout(1)
    notifier = Notifier(str(path), watchdog_s=2.0)
    try:
        notifier.ready("serving: a")
        notifier.ready("serving: a")  # READY once; the same line is not sent again
        notifier.status("serving: b")
        notifier.watchdog(10.0)
        notifier.watchdog(10.5)  # not due: pings every watchdog_s / 2 = 1 s
        notifier.watchdog(11.0)
        notifier.stopping("stopping: c")
        got = []
        manager.settimeout(0.2)
        while True:
            try:
                got.append(manager.recv(4096).decode())
            except TimeoutError:
                break
        assert got == [
            "READY=1\nSTATUS=serving: a",
            "STATUS=serving: b",
            "WATCHDOG=1",
            "WATCHDOG=1",
            "STOPPING=1\nSTATUS=stopping: c",
        ]
        manager.close()
        path.unlink()
        notifier.status("serving: d")  # nobody listens: logged once, never raised
    finally:
        notifier.close()


def test_rates_from_counter_deltas() -> None:
    a = Sample(
        7, {"admitted": 10, "ok": 8, "shed_queue_full": 1, "fallback_cpu_pressure": 0}, 100.0
    )
    b = Sample(
        7,
        {
            "admitted": 30,
            "ok": 24,
            "shed_queue_full": 3,
            "shed_draining": 2,
            "deadline_exceeded": 4,
        },
        102.0,
    )
    r = rates(a, b)
    assert r == {"admitted": 10.0, "ok": 8.0, "shed": 2.0, "errors": 2.0, "fallback": 0.0}
    assert rates(None, b) is None  # the first refresh
    assert rates(a, Sample(8, b.counters, 102.0)) is None  # another node (restarted)
    assert rates(b, Sample(7, {"admitted": 1}, 104.0)) is None  # counters went down
