"""CPU pressure: PSI parsing, where it is read, the hysteresis of the level, the
``[pressure]`` keys, and what the broker does with it (fake PSI files, fake clock).
The real /proc/pressure/cpu under a CPU hog: tests/system/test_cpu_pressure.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from broker.errors import ConfigError
from broker.protocol import WorkerCommand
from broker.routing import RoutingSettings
from brokerkit import FAST, RULES, W1, BrokerHarness, bodies, generate
from node.cli.status_view import render_status
from node.config import PressureSection, from_dict, validate
from node.pressure import CpuPressureMonitor, cpu_psi_file, parse_psi

#: What kernel 6.18 writes (/proc/pressure/cpu on this machine).
PSI = (
    "some avg10={:.2f} avg60=0.96 avg300=0.83 total=3487003738\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
)


def write_psi(path: Path, avg10: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PSI.format(avg10))
    return path


# ---------------------------------------------------------------- parsing and source


def test_a_psi_file_parses_to_its_some_and_full_lines() -> None:
    lines = parse_psi(PSI.format(1.84) + "\n")
    assert (lines["some"].avg10, lines["some"].avg300, lines["some"].total_us) == (
        1.84,
        0.83,
        3487003738,
    )
    assert lines["full"].avg10 == 0.0
    with pytest.raises(ValueError, match="no 'some' line"):
        parse_psi("full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    with pytest.raises(ValueError, match="not a PSI line"):
        parse_psi("some avg10=high avg60=0 avg300=0 total=0\n")


def test_the_node_cgroups_v2_file_is_read_first_then_the_hosts(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    node_cg = tmp_path / "cg" / "edgenode-1"
    write_psi(proc / "pressure" / "cpu", 3.0)
    write_psi(node_cg / "cpu.pressure", 7.0)
    assert cpu_psi_file(node_cg, proc) == (node_cg / "cpu.pressure", "")
    (node_cg / "cpu.pressure").unlink()  # e.g. cgroup.pressure = 0 on this cgroup
    assert cpu_psi_file(node_cg, proc) == (proc / "pressure" / "cpu", "")
    assert cpu_psi_file(None, proc) == (proc / "pressure" / "cpu", "")


def test_a_configured_psi_file_is_the_only_one_read(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    write_psi(proc / "pressure" / "cpu", 3.0)
    workload = write_psi(tmp_path / "robot.service" / "cpu.pressure", 70.0)
    assert cpu_psi_file(None, proc, str(workload)) == (workload, "")
    workload.unlink()
    path, why = cpu_psi_file(None, proc, str(workload))  # no silent fallback to the host's
    assert path is None and str(workload) in why


def test_without_any_psi_file_cpu_pressure_is_not_measured_and_status_says_why(
    tmp_path: Path,
) -> None:
    path, why = cpu_psi_file(None, tmp_path / "proc")
    assert path is None
    assert "pressure/cpu" in why and "CONFIG_PSI" in why and "psi=0" in why
    mon = CpuPressureMonitor(PressureSection(poll_ms=0), path, why)
    assert mon.poll(0.0) is None and mon.level == "ok"
    snap = mon.snapshot()
    assert (snap["level"], snap["source"], snap["reason"]) == ("ok", None, why)
    line = _gate_line({"cpu_pressure": "ok", "cpu": snap})
    assert "cpu pressure ok (not measured: " in line and "CONFIG_PSI" in line


# ---------------------------------------------------------------- levels


def test_the_cpu_level_follows_some_avg10_with_hysteresis(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "cpu", 0.0)
    mon = CpuPressureMonitor(PressureSection(cpu_warn_pct=50.0, cpu_clear_pct=25.0), psi)
    levels = []
    for t, avg10 in enumerate([10.0, 50.0, 30.0, 25.0, 24.99, 49.9]):
        write_psi(psi, avg10)
        mon.poll(float(t))
        levels.append(mon.level)
    # 50 % reaches the warning line; 30 and 25 stay high (not below the clear
    # line); below 25 clears; 49.9 is under the warning line again.
    assert levels == ["ok", "high", "high", "high", "ok", "ok"]


def test_the_file_is_read_at_most_every_poll_ms(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "cpu", 80.0)
    mon = CpuPressureMonitor(PressureSection(poll_ms=250), psi)
    assert mon.poll(10.0) == "high"
    write_psi(psi, 0.0)
    assert mon.poll(10.1) is None and mon.level == "high"  # not due yet
    assert mon.poll(10.25) == "ok"


def test_a_file_that_stops_being_readable_ends_the_measuring_at_ok(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "cpu", 90.0)
    mon = CpuPressureMonitor(PressureSection(poll_ms=0), psi)
    assert mon.poll(0.0) == "high"
    psi.write_text("garbage\n")
    assert mon.poll(1.0) == "ok"  # never held in degrade by a broken source
    snap = mon.snapshot()
    assert snap["source"] is None and "stopped being readable" in snap["reason"]
    assert mon.poll(2.0) is None


def test_cpu_warn_pct_zero_ignores_cpu_pressure(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "cpu", 100.0)
    mon = CpuPressureMonitor(PressureSection(cpu_warn_pct=0.0), psi)
    assert mon.poll(0.0) is None and mon.level == "ok"
    assert mon.snapshot()["reason"] == "pressure.cpu_warn_pct = 0"


def test_status_shows_the_cpu_level_beside_the_memory_level(tmp_path: Path) -> None:
    psi = write_psi(tmp_path / "cpu", 63.2)
    mon = CpuPressureMonitor(PressureSection(poll_ms=0), psi)
    mon.poll(0.0)
    line = _gate_line({"cpu_pressure": mon.level, "cpu": mon.snapshot()})
    assert line.endswith(
        f"memory pressure ok  cpu pressure high (some avg10 63.2% of {psi}; "
        "high at 50%, ok below 25%)"
    )


def _gate_line(extra: dict[str, object]) -> str:
    status = {"queue_depth": 0, "queue_bound": 8, "in_flight": 0, "credit": 1, **extra}
    return next(line for line in render_status(status).splitlines() if line.startswith("gate:"))


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"cpu_warn_pct": 101.0}, "pressure.cpu_warn_pct must be 0 (off) or in (0, 100]"),
        ({"cpu_warn_pct": -5.0}, "pressure.cpu_warn_pct must be 0 (off) or in (0, 100]"),
        ({"cpu_warn_pct": 40.0, "cpu_clear_pct": 40.0}, "pressure.cpu_clear_pct must be in"),
        ({"cpu_warn_pct": 40.0, "cpu_clear_pct": 0.0}, "pressure.cpu_clear_pct must be in"),
        ({"cpu_psi": "proc/pressure/cpu"}, 'pressure.cpu_psi must be "" or an absolute path'),
    ],
)
def test_the_cpu_thresholds_are_range_checked(values: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(from_dict({"pressure": values}))


def test_cpu_pressure_can_be_turned_off() -> None:
    cfg = validate(from_dict({"pressure": {"cpu_warn_pct": 0, "cpu_clear_pct": 0}}))
    assert cfg.pressure.cpu_warn_pct == 0


# ---------------------------------------------------------------- the broker


def degrade() -> BrokerHarness:
    h = BrokerHarness(replace(FAST, max_queue=8), RoutingSettings("degrade", 0))
    h.ready(W1, 0.0, worker_id="llm-0")
    h.ready(RULES, 0.0, worker_id="rules-0", engine="rules")
    return h


def test_under_cpu_pressure_auto_requests_go_to_the_rules_and_back_to_the_model() -> None:
    h = degrade()
    h.broker.set_cpu_pressure("high", 1.0)
    h.send(generate("hot"), 1.0)
    (req,) = bodies(h.drain_workers(), RULES, WorkerCommand.REQUEST)
    h.final(RULES, req["rid"], 1.1, text="rule answer", confidence=1.0)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degraded"], reply["degrade_reason"]) == (
        "rules",
        True,
        "cpu_pressure",
    )
    status = h.broker.status(1.2)
    assert (status["cpu_pressure"], status["pressure"]) == ("high", "ok")

    h.broker.set_cpu_pressure("ok", 2.0)
    h.send(generate("cool"), 2.0)
    (req,) = bodies(h.drain_workers(), W1, WorkerCommand.REQUEST)
    h.final(W1, req["rid"], 2.1)
    (reply,) = h.replies()
    assert (reply["served_by"], reply["degraded"]) == ("llm", False)
    assert "degrade_reason" not in reply
    h.assert_each_answered_once()


def test_under_cpu_pressure_sheddable_model_work_is_shed() -> None:
    h = degrade()
    h.send(generate("run", route="llm"), 0.0)  # takes the one slot
    h.send(generate("wait", route="llm", priority="sheddable"), 0.0)  # queued
    h.send(generate("norm", route="llm"), 0.0)  # queued, normal
    h.drain_workers()
    h.broker.set_cpu_pressure("high", 1.0)
    errors = [(r["id"], r["code"], r["reason"]) for r in h.replies() if r["status"] == "error"]
    assert errors == [("wait", 503, "cpu_pressure")]
    h.send(generate("new", route="llm", priority="sheddable"), 1.0)
    (shed,) = h.replies()
    assert (shed["code"], shed["reason"]) == (503, "cpu_pressure")
    assert shed["retry_after_ms"] > 0
    # Normal and critical work is still served by the model when asked for it.
    h.broker.set_cpu_pressure("ok", 2.0)
    h.send(generate("later", route="llm", priority="sheddable"), 2.0)
    assert h.replies() == []  # admitted (queued behind "run" and "norm")
    assert h.broker.status(2.0)["counters"]["shed_cpu_pressure"] == 2
