"""``edgenode bench --quick`` end to end on the cheap scenarios, with the test engine:
real nodes, the real raw relay, real signals; the report, its PNGs and its JSON, with
every figure beside its baseline.

Nothing here asserts a speed (the machine is shared): only that each figure and its
baseline were measured, that no reply was lost and that the report says so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from broker.records import BrokerSettings
from node.interpreter import module_command
from node.testing import REPO, with_default_sigint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


#: The scenarios of the one run the report tests share (a bench process and its report cost
#: seconds each), and the goals each scenario adds, in the report's order.
SHARED = "broker,faults,remote"
GOALS = {
    "broker": ["broker req/s at 8 in flight, share of the raw relay"],
    "faults": [
        "kill -9 detected (max)",
        "SIGSTOP detected (max)",
        "replies lost around faults",
        "false deaths",
        "deadline overshoot (max)",
        "worker free after deadline (max)",
    ],
    "remote": ["tokens/s, local + remote agent over local alone"],
}
#: For the shared run (about 70 s on a quiet machine), however loaded the machine is.
RUN_TIMEOUT_S = 280


def bench(out: Path, only: str) -> tuple[str, dict[str, Any]]:
    """Run ``edgenode bench --quick --only ONLY --engine test --json``; the report's
    Markdown and the JSON printed on stdout."""
    argv = module_command("node.cli", "bench", "--quick", "--only", only, "--engine", "test")
    argv += ["--out", str(out), "--json", "--no-progress"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    data: dict[str, Any] = json.loads(done.stdout)
    assert data == json.loads((out / "report.json").read_text())
    return (out / "report.md").read_text(), data


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, Any]]:
    """One ``bench --quick --only broker,faults,remote`` run: its out directory, report
    and JSON, read by each scenario's test below."""
    out = tmp_path_factory.mktemp("bench")
    report, data = bench(out, SHARED)
    return out, report, data


def goal(data: dict[str, Any], scenario: str) -> dict[str, Any]:
    """The one goal ``scenario`` reports (its name in ``GOALS``)."""
    [found] = [g for g in data["goals"] if g["name"] in GOALS[scenario]]
    return found


def table_header(report: str, first: str) -> list[str]:
    """The cells of the header row of the table whose first column is ``first``."""
    line = next(x for x in report.splitlines() if x.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_the_run_reports_each_scenario_and_its_goals_in_order(
    shared: tuple[Path, str, dict[str, Any]],
) -> None:
    _, report, data = shared
    assert list(data["scenarios"]) == SHARED.split(",")
    assert [g["name"] for g in data["goals"]] == [n for s in SHARED.split(",") for n in GOALS[s]]
    assert "interrupted" not in data["meta"]
    assert "## Broker overhead" in report and "## Faults" in report


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_broker_overhead_beside_the_raw_relay(shared: tuple[Path, str, dict[str, Any]]) -> None:
    out, report, data = shared
    assert table_header(report, "in flight")[:4] == [
        "in flight",
        "node req/s",
        "raw relay req/s",
        "node / relay",
    ]
    assert (out / "broker.png").read_bytes()[:8] == PNG_MAGIC
    assert "![broker overhead: node vs raw relay](broker.png)" in report
    broker = data["scenarios"]["broker"]
    for side in ("node", "relay"):
        for level in ("1", "8"):
            figures = broker[side][level]
            assert figures["req_per_s"] > 0, (side, level, figures)
            assert figures["rtt_p50_ms"] <= figures["rtt_p99_ms"]
            assert figures["lost"] == 0 and figures["not_ok"] == 0, figures
    share = broker["share"]["8"]
    assert share == broker["node"]["8"]["req_per_s"] / broker["relay"]["8"]["req_per_s"]
    found = goal(data, "broker")
    assert found["measured"] == 100 * share and found["target"] == 70
    assert f"| {found['name']} | >= 70 % |" in report


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_faults_detected_and_no_reply_lost(shared: tuple[Path, str, dict[str, Any]]) -> None:
    _, report, data = shared
    assert table_header(report, "measure") == [
        "measure",
        "n",
        "p50 ms",
        "p99 ms",
        "max ms",
        "budget ms",
    ]
    faults = data["scenarios"]["faults"]
    measures = faults["measures"]
    for name in ("detection, kill -9", "detection, SIGSTOP", "recovery, SIGSTOP (all ready again)"):
        assert len(measures[name]) == 1 and measures[name][0] > 0, (name, measures)
    # SIGSTOP is found by missed heartbeats (500 ms x 3 by default): never before 2 of them.
    beats = BrokerSettings()
    missed = beats.heartbeat_interval_ms * (beats.heartbeat_liveness - 1)
    assert measures["detection, SIGSTOP"][0] > missed
    assert faults["lost"] == 0
    assert faults["false_deaths"] == 0
    goals = {g["name"]: g for g in data["goals"]}
    assert goals["replies lost around faults"]["met"] is True
    assert goals["kill -9 detected (max)"]["measured"] == max(measures["detection, kill -9"])
    assert "| detection, SIGSTOP | 1 |" in report


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_remote_agent_beside_the_local_worker_alone(
    shared: tuple[Path, str, dict[str, Any]],
) -> None:
    """The ``remote`` scenario: a gateway and a host agent as separate processes, each
    on its half of the cores; both layouts measured, the agent served part of the load."""
    _, report, data = shared
    assert table_header(report, "layout")[:3] == ["layout", "rounds", "tokens/s (median)"]
    remote = data["scenarios"]["remote"]
    alone, both = remote["runs"]["local alone"][0], remote["runs"]["local + remote agent"][0]
    assert alone["tokens_per_s"] > 0 and both["tokens_per_s"] > 0
    assert alone["errors"] == 0 and both["errors"] == 0
    assert alone["remote_share_pct"] == 0 and both["remote_share_pct"] > 0
    assert remote["ratios"] == [both["tokens_per_s"] / alone["tokens_per_s"]]
    assert set(remote["local_cpus"]).isdisjoint(remote["remote_cpus"])
    assert goal(data, "remote")["measured"] == 100 * remote["ratios"][0]


def test_ctrl_c_writes_the_finished_scenarios_and_stops_every_node(tmp_path: Path) -> None:
    """A Ctrl-C (SIGINT to the foreground process group, as a terminal sends it) while the
    second scenario runs: exit 130, the first scenario's figures in the report marked
    interrupted, and no process of the run left behind."""
    argv = module_command("node.cli", "bench", "--quick", "--only", "broker,faults")
    argv += ["--engine", "test", "--out", str(tmp_path), "--json"]
    bench = subprocess.Popen(
        with_default_sigint(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        start_new_session=True,
    )
    assert bench.stderr is not None and bench.stdout is not None
    err = bench.stderr
    progress = bytearray()
    reached = threading.Event()

    def read_progress() -> None:  # the bar (on stderr) says which scenario runs
        while chunk := os.read(err.fileno(), 4096):
            progress.extend(chunk)
            if b"faults: " in progress:
                reached.set()

    stdout = bench.stdout
    printed: list[bytes] = []
    # Each pipe has one reader (communicate() would race read_progress for stderr).
    readers = [
        threading.Thread(target=read_progress, daemon=True),
        threading.Thread(target=lambda: printed.append(stdout.read()), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        assert reached.wait(45), progress.decode(errors="replace")[-3000:]
        # Into the scenario: its node and 2 workers run (their own session: a Ctrl-C
        # reaches only the bench, which must stop them).
        started: list[psutil.Process] = []
        give_up = time.monotonic() + 30
        while len(started) < 3 and time.monotonic() < give_up:
            time.sleep(0.05)
            started = psutil.Process(bench.pid).children(recursive=True)
        assert len(started) >= 3, started
        os.killpg(bench.pid, signal.SIGINT)
        bench.wait(timeout=30)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    for reader in readers:
        reader.join(10)
    stdout.close()
    err.close()
    assert bench.returncode == 130, progress.decode(errors="replace")[-3000:]
    assert b"interrupted during faults" in progress
    data = json.loads(b"".join(printed))
    assert data == json.loads((tmp_path / "report.json").read_text())
    assert list(data["scenarios"]) == ["broker"]
    assert data["scenarios"]["broker"]["node"]["8"]["req_per_s"] > 0
    assert data["meta"]["interrupted"] == "by Ctrl-C during faults; finished: broker"
    report = (tmp_path / "report.md").read_text()
    assert "- interrupted: by Ctrl-C during faults; finished: broker" in report
    assert "## Broker overhead" in report and "## Faults" not in report
    assert not (tmp_path / ".bench.lock").exists()
    assert [p.pid for p in started if not gone(p)] == []


def gone(proc: psutil.Process) -> bool:
    """Exited (a zombie counts: its parent, the bench, has exited too)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
