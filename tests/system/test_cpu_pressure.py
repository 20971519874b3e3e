"""CPU pressure from REAL PSI files, under a real CPU hog.

With a hog at nice 0 on every core (``HOGS_PER_CORE`` busy loops per allowed
core), degrade mode's ``auto`` requests are answered by the rules
(``degrade_reason: "cpu_pressure"``) and sheddable model work is shed; after
the hog stops the model answers again.

Determinism. /proc/pressure/cpu counts every task on the machine, and this
machine is shared with other test runs: measured at 90 % ``some avg10`` with
no hog of ours, so a threshold there could neither rise nor clear on our cue.
The hog therefore runs in a cgroup v2 of its own (the empty v2 mount of a
hybrid host works: PSI is accounted per v2 cgroup without any controller), the
way a device's main workload runs in its service's cgroup, and the node reads
that cgroup's real ``cpu.pressure`` (``pressure.cpu_psi``). Only the hog's own
stalls count there: ~100 % while it runs (more busy loops than cores), 0 once
it is gone, whatever else the machine does. ``some avg10`` moves ~18 % of the
way to the current stall share every 2 s (psi.rst), so each level turns within
a few PSI periods; every wait polls a condition with a generous timeout.
The default source (/proc/pressure/cpu on this hybrid host) is read for real
in the first test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker.client import Reply
from broker.errors import Unavailable
from node.sandbox.cgroupfs import Host
from node.sandbox.layout import read_layout
from node.testing import NodeProcess, wait_for

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]

NodeFactory = Callable[..., NodeProcess]
PSI = Path("/proc/pressure/cpu")
#: Busy loops per allowed core: more runnable tasks than cores, so one of them
#: always waits ("some" near 100 % in their cgroup).
HOGS_PER_CORE = 2
#: Generous: avg10 needs a few 2 s periods to cross a line, more on a loaded host.
LEVEL_TIMEOUT_S = 120.0
#: A busy loop that first joins the cgroup.procs file given as argv[1].
BUSY = 'import sys; open(sys.argv[1], "w").write("0")\nwhile True: pass'


def _psi_readable(path: Path) -> bool:
    try:
        return path.read_text().startswith("some ")
    except OSError:
        return False


class Hog:
    """``HOGS_PER_CORE`` busy loops per allowed core at nice 0, in the cgroup ``home``."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        for _ in range(HOGS_PER_CORE * len(os.sched_getaffinity(0))):
            cmd = [sys.executable, "-c", BUSY, str(self.home / "cgroup.procs")]
            self.procs.append(subprocess.Popen(cmd))

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()


@pytest.fixture
def hog() -> Iterator[Hog]:
    """A hog with a v2 cgroup of its own (removed afterwards, the hog killed first)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup")
    layout = read_layout(Host())
    if layout.v2 is None or layout.own_v2 is None:
        pytest.skip("no cgroup v2 mount")
    home = layout.v2.dir_of(layout.own_v2) / f"edgenode-test-hog-{os.getpid()}"
    home.mkdir()
    h = Hog(home)
    try:
        if not _psi_readable(home / "cpu.pressure"):
            pytest.skip(f"{home}/cpu.pressure is not readable (kernel without PSI)")
        yield h
    finally:
        h.stop()
        wait_for(lambda: not (home / "cgroup.procs").read_text().split(), timeout=30)
        home.rmdir()


def ask(node: NodeProcess, **fields: str) -> Reply:
    with node.client(wait_ms=30_000) as c:
        return c.generate("lights on", **fields)


def test_the_node_reads_the_hosts_real_psi_file_by_default(make_node: NodeFactory) -> None:
    if not _psi_readable(PSI):
        pytest.skip(f"{PSI} is not readable (kernel without PSI)")
    node = make_node(workers={"count": 1}, pressure={"cpu_warn_pct": 50.0, "poll_ms": 100})
    status = wait_for(lambda: (s := node.status())["cpu"]["some_avg10"] is not None and s)
    cpu = status["cpu"]
    # A hybrid host (this one): the node has no v2 cgroup of its own, so the host's file.
    assert (cpu["source"], cpu["warn_pct"], cpu["clear_pct"]) == (str(PSI), 50.0, 25.0)
    assert 0.0 <= cpu["some_avg10"] <= 100.0
    assert status["cpu_pressure"] in ("ok", "high")
    assert f"cpu pressure {status['cpu_pressure']} (some avg10" in node.cli("status").stdout


def test_cpu_pressure_hands_auto_requests_to_the_rules_until_it_clears(
    make_node: NodeFactory, hog: Hog
) -> None:
    assert os.nice(0) == 0, "the hog must run at nice 0, as the host's own work does"
    psi = hog.home / "cpu.pressure"
    node = make_node(
        workers={"count": 1},
        routing={"mode": "degrade", "ttft_budget_ms": 0},  # no hedges: only pressure routes
        fallback={"rules": "default"},
        pressure={"cpu_warn_pct": 30.0, "cpu_clear_pct": 15.0, "poll_ms": 100, "cpu_psi": str(psi)},
    )
    assert node.status()["cpu"]["source"] == str(psi)
    assert ask(node).served_by == "llm"

    hog.start()
    high = wait_for(
        lambda: (s := node.status())["cpu_pressure"] == "high" and s,
        timeout=LEVEL_TIMEOUT_S,
        every=0.2,
    )
    assert high["cpu"]["some_avg10"] >= 30.0
    assert high["pressure"] == "ok"  # memory is fine: this is the CPU's doing
    reply = ask(node)
    assert (reply.served_by, reply.degraded, reply.raw["degrade_reason"]) == (
        "rules",
        True,
        "cpu_pressure",
    )
    with pytest.raises(Unavailable) as shed:
        ask(node, route="llm", priority="sheddable")
    assert shed.value.retry_after_ms is not None
    assert node.status()["counters"]["shed_cpu_pressure"] == 1
    assert "cpu pressure high (some avg10" in node.cli("status").stdout

    hog.stop()
    wait_for(lambda: node.status()["cpu_pressure"] == "ok", timeout=LEVEL_TIMEOUT_S, every=0.2)
    back = ask(node)
    assert (back.served_by, back.degraded) == ("llm", False)
    assert "degrade_reason" not in back.raw
    assert ask(node, route="llm", priority="sheddable").served_by == "llm"
