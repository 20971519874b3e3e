"""Memory pressure on a real cgroup: a hog inside the node's cgroup makes the
broker shed, without any OOM kill, and admission recovers when the hog leaves."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from broker.errors import Unavailable
from node.testing import NodeProcess, wait_for

pytestmark = pytest.mark.system

NodeFactory = Callable[..., NodeProcess]

#: Joins the cgroup.procs file given as argv[1], touches argv[2] MiB, then waits.
HOG = """
import sys, time
open(sys.argv[1], "w").write("0")  # "0" = the writing process itself
block = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(block), 4096):
    block[i] = 1
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def node(make_node: NodeFactory) -> NodeProcess:
    if os.geteuid() != 0:
        pytest.skip("needs root to create cgroups")
    return make_node(
        workers={"sandbox": "required"},
        pressure={
            "budget": "400M",
            "high_pct": 50.0,
            "critical_pct": 95.0,
            "clear_pct": 40.0,
            "poll_ms": 100,
        },
    )


def test_hog_in_the_node_cgroup_sheds_sheddable_work_and_admission_recovers(
    node: NodeProcess,
) -> None:
    status = node.status()
    assert status["pressure"] == "ok", status["memory"]
    leaf = Path(status["sandbox"]["cgroup"]) / "node" / "cgroup.procs"
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG, str(leaf), "260"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        high = wait_for(lambda: (s := node.status())["pressure"] != "ok" and s)
        assert high["memory"]["used_pct"] >= 50.0
        with node.client() as c:
            with pytest.raises(Unavailable) as shed:
                c.generate("lights on", priority="sheddable")
            assert shed.value.retry_after_ms is not None and shed.value.retry_after_ms >= 50
            # High pressure sheds sheddable work only: normal work is still served.
            assert c.generate("lights on").text == "echo: lights on"
        status = node.status()
        assert status["counters"]["shed_memory_pressure"] >= 1
        assert (status["credit_limit"], status["queue_bound"]) == (1, 32)  # halved
    finally:
        hog.kill()
        hog.wait()
        if hog.stdout is not None:
            hog.stdout.close()  # an unclosed pipe would warn in whichever test runs next
    assert hog.returncode == -9  # killed by the test, not by the OOM killer
    wait_for(lambda: node.status()["pressure"] == "ok")
    status = node.status()
    assert (status["credit_limit"], status["queue_bound"]) == (2, 64)  # restored
    with node.client() as c:
        assert c.generate("lights off", priority="sheddable").text == "echo: lights off"
    assert all(p["oom_kills"] == 0 and p["restarts"] == 0 for p in status["processes"])
