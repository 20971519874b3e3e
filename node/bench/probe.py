"""The host's stand-in of ``edgenode bench``'s ``host`` scenario and of
``scripts/bench_isolation.py``: a periodic control loop pinned to one core, run as a
fresh process per case, its calibration, the CPU accounting around it, and the summary
of its rounds (wake-up lateness, response, missed deadlines).

Owns the probe's subprocesses and /proc/stat readings; knows nothing of nodes or load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from node.bench.stats import median, percentile

#: The probe, a periodic control loop: pin, then every 1 ms period wake at the
#: period's release time and run ``work`` iterations of arithmetic (--duty of the
#: period on an idle core). Per cycle: how late it woke and when its work ended
#: (ns after the release time), the window (CLOCK_MONOTONIC, comparable with this
#: process's clock) and its CPU time. A cycle that overruns its period is a missed
#: deadline; the next release is then the next period boundary after "now", as a
#: control loop that drops a cycle does.
PROBE = """
import json, os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
n, work, period = int(sys.argv[2]), int(sys.argv[3]), 1_000_000
def spin(k):
    x = 0
    for i in range(k):
        x += i
    return x
late, resp = [], []
start = time.monotonic()
release = time.monotonic_ns() + period
for _ in range(n):
    now = time.monotonic_ns()
    if release > now:
        time.sleep((release - now) / 1e9)
    late.append(time.monotonic_ns() - release)
    spin(work)
    done = time.monotonic_ns()
    resp.append(done - release)
    release += period
    if release < done:
        release += (done - release) // period * period + period
end = time.monotonic()
print(json.dumps({"late_ns": late, "resp_ns": resp, "start": start, "end": end,
                  "cpu_s": time.process_time()}))
"""

#: Calibration, on the probe's core with the nodes not yet started: iterations per ms.
CALIBRATE = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
def spin(k):
    x = 0
    for i in range(k):
        x += i
    return x
k, runs = 20_000, []
for _ in range(40):
    t = time.perf_counter(); spin(k); runs.append(time.perf_counter() - t)
runs.sort()
print(int(k / (runs[len(runs) // 2] * 1000)))
"""


def idle_by_core(stat: Path = Path("/proc/stat")) -> dict[int, float]:
    """Seconds each core spent idle since boot (idle + iowait of its ``cpuN`` line), by
    core number.

    The idle columns are the precise ones: under NO_HZ the kernel counts idle time
    from idle entry and exit, while user and system are samples taken at its tick,
    which missed the probe's 1 ms loop (phase-locked to the tick: its core showed
    1-4 % busy while the loop computed half of every period; docs/bench/figures.md,
    "Isolation: the host's cores"). So a core's busy time is wall - idle."""
    hz = os.sysconf("SC_CLK_TCK")
    out = {}
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu":
            out[int(name[3:])] = (int(fields[3]) + int(fields[4])) / hz
    return out


def core_idle(stat: Path = Path("/proc/stat")) -> list[float]:
    """``idle_by_core`` as a list in core order (the probe's per-core columns)."""
    return [idle for _, idle in sorted(idle_by_core(stat).items())]


def tree_cpu(pid: int) -> float:
    """CPU seconds used so far by ``pid`` and its live descendants."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def probe(core: int, iterations: int, work: int, node_pids: list[int]) -> dict[str, Any]:
    """Run the probe on ``core`` (nice 0, a fresh process) for ``iterations`` 1 ms cycles
    of ``work`` iterations each (``calibrate``); its output (``late_ns``, ``resp_ns``:
    per cycle, ns after the release time; ``start``, ``end``, ``cpu_s``) plus CPU
    accounting (``core_busy``: share per core; ``other_cores``: cores' worth used by
    neither the probe nor ``node_pids``' trees).

    Raises:
        subprocess.CalledProcessError: the probe failed (e.g. ``core`` not allowed).
    """
    idle, began, node_cpu = core_idle(), time.monotonic(), sum(map(tree_cpu, node_pids))
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(core), str(iterations), str(work)],
        capture_output=True,
        text=True,
        check=True,
        timeout=iterations / 100 + 60,
    )
    after, wall, node_after = core_idle(), time.monotonic() - began, sum(map(tree_cpu, node_pids))
    result: dict[str, Any] = json.loads(out.stdout)
    busy = [max(0.0, wall - (i1 - i0)) for i0, i1 in zip(idle, after, strict=True)]
    result["core_busy"] = [min(1.0, b / wall) if wall > 0 else 0.0 for b in busy]
    # Cores' worth of CPU used by everything else: the host's other work.
    spent = sum(busy) - (node_after - node_cpu) - result["cpu_s"]
    result["other_cores"] = max(0.0, spent / wall) if wall > 0 else 0.0
    return result


def calibrate(core: int, duty: float) -> int:
    """Probe iterations per cycle for ``duty`` (0..1) of a 1 ms period on an idle ``core``."""
    out = subprocess.run(
        [sys.executable, "-c", CALIBRATE, str(core)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return max(1, int(int(out.stdout) * duty))


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Wake-up lateness and response (µs) over all rounds and per round, missed
    deadlines (%, over all rounds and per round), CPU shares."""

    def us(key: str) -> tuple[list[float], list[list[float]]]:
        per_round = [[ns / 1000 for ns in r[key]] for r in rounds]
        return [x for r in per_round for x in r], per_round

    late, late_rounds = us("late_ns")
    resp, resp_rounds = us("resp_ns")
    return {
        "p50_us": round(median(late), 1),
        "p99_us": round(percentile(late, 99), 1),
        "max_us": round(max(late), 1),
        "p99_rounds_us": [round(percentile(r, 99), 1) for r in late_rounds],
        "p99_median_us": round(median(percentile(r, 99) for r in late_rounds), 1),
        "resp_p50_us": round(median(resp), 1),
        "resp_p99_us": round(percentile(resp, 99), 1),
        "resp_p99_rounds_us": [round(percentile(r, 99), 1) for r in resp_rounds],
        "resp_p99_median_us": round(median(percentile(r, 99) for r in resp_rounds), 1),
        "missed_pct": round(100 * sum(x > 1000 for x in resp) / len(resp), 2),
        "missed_rounds_pct": [
            round(100 * sum(x > 1000 for x in r) / len(r), 2) for r in resp_rounds
        ],
        "core_busy": [
            round(statistics.mean(c), 3)
            for c in zip(*(r["core_busy"] for r in rounds), strict=True)
        ],
        "other_cores": round(statistics.mean(r["other_cores"] for r in rounds), 2),
    }
