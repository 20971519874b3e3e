#!/usr/bin/env python3
"""Does the host notice the model? A control loop beside busy workers (not a test).

A probe process stands in for the host's own control loop: at nice 0, pinned to
core ``--probe-core`` (0), every 1 ms period it wakes at the period's release
time and computes for ``--duty`` of the period (50 %, calibrated on the idle
core before the nodes start), ``--iterations`` times. Per cycle it records how
late it woke and when its work ended (its response); a cycle that ends after
1 ms missed its deadline. A sleep-only probe was dropped: on a VM an idle
core's wake-up latency (the hypervisor's halt exit) dwarfs everything else, so
a busy core looked better than an idle one. Two real nodes run side by side
(engine llama, default model, ``sandbox = "required"``, each in its own run dir
and cgroup):

* ``reserved``: ``workers.cpus = "auto"``, the node's default (``--reserve``;
  on a 2-core host core 1, as ``[1]``): the workers (all sharing core 1) may
  not run on the probe's core, and neither may the broker and the rule worker
  (``node.cpus = []`` follows the reservation);
* ``unreserved``: ``workers.cpus = []`` (the baseline): no reservation; the
  plan gives each worker a core of its own when there are enough, else they
  share all of them: a worker runs on the probe's core (at nice 10, its
  autogroup too).

* ``busy loop`` (the control, unless ``--no-control``): no model at all, one process
  per reserved core spinning ``while True: pass`` at the workers' nice level, pinned
  there. What the host's probe shows beside it is what this machine does to the
  probe's core when the reserved core is merely busy (a VM's vCPUs may share a
  physical core, caches, memory bandwidth and the host's clock): the part of a
  reserved node's deviation that no placement of the node can remove.

* with ``--slice-baseline``, a third: ``unreserved-s0``, the unreserved node with
  ``workers.slice_us = 0`` (the kernel's default scheduler slice, as before that
  key): what the short slice buys the host (node.sandbox.niceness).

Each of ``--rounds`` rounds probes the cases in a rotating order: both nodes
idle; the reserved node's workers all generating flat out; the unreserved
node's likewise (one client per slot, each streaming long generations back to
back for the whole probe window; they are cancelled after it). Interleaving
matters on a shared machine: the host's other load, which the benchmark cannot
stop, then falls on every case alike. The clients (this process's threads) run
off the probe's core: they stand in for apps elsewhere.

Before the first round each worker evaluates one context-filling prompt, so the
KV cache and the attention scratch are touched (the steady state the capacity
plan estimates).

Printed: wake-up lateness and response p50/p99 over all rounds of a case, the
median of the rounds' response p99, missed deadlines; busy/idle ratios; the
share of the probe windows during which every worker had a generation in
flight; tokens per second; the busy share of each core and the CPU used by
processes that are neither the nodes nor the probe (``other``: the benchmark
cannot stop other work on a shared machine, it can only show it). Then per
worker the capacity plan's estimate (``status['capacity']['per_worker']`` less its
grammar term: these requests carry no ``json_schema``)
against the measured memory: the worker's cgroup (usage and peak) and its
private memory from ``/proc/<pid>/smaps`` (``scripts/bench_memory.py``'s
reading: private bytes minus the model file's).

A node whose generators saw errors (a worker lost, say) leaves a copy of its run
directory, logs included, in a temporary directory the run prints.

This file runs the nodes and the load; the probe is ``node.bench.probe``,
the printed report ``scripts/isolation_report.py``.

The layout is the built-in default unless ``--workers``, ``--slots`` or
``--threads`` say otherwise.

Usage: ``python scripts/bench_isolation.py [--iterations 3000] [--rounds 3] [--duty 0.5]
[--workers W] [--slots S] [--threads T] [--slice-baseline] [--no-control] [--json]``.
Needs root (cgroups and cpusets) and at least 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench_memory import smaps
from broker.client import Client
from isolation_report import report
from node.bench.host import Generator
from node.bench.probe import calibrate, probe, summarize
from node.config import AUTO_CORES, WorkersSection
from node.model import resolve_model
from node.sandbox.cores import allowed_cores, reserved_cores
from node.testing import NodeProcess

N_CTX = 2048  # the default model.n_ctx


def pin_threads_off(core: int) -> list[int]:
    """Move every thread of this process (the load generator's clients) off ``core``:
    they stand in for apps elsewhere, not for the host's control loop. Threads
    created later inherit it. Returns the cores they may use."""
    cores = sorted(os.sched_getaffinity(0) - {core})
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            continue  # a thread that just ended
    return cores


# --------------------------------------------------------------------------- load


def llm_active(node: NodeProcess) -> int:
    """Requests the model workers run now (busy slots)."""
    return sum(w["active"] for w in node.status()["workers"] if w["kind"] == "llm")


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def fill_contexts(frontend: str, workers: int, n_ctx: int) -> None:
    """One context-filling prompt per worker at once, so the KV cache and the
    attention scratch are touched: the steady-state peak the plan estimates."""
    prompt = "robot " * (n_ctx - 64)  # one token per word with the default model

    def one() -> None:
        with Client(frontend, wait_ms=600_000) as client:
            client.generate(prompt, max_tokens=16, route="llm", timeout_ms=300_000)

    threads = [threading.Thread(target=one) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --------------------------------------------------------------------------- the run


def layout(args: argparse.Namespace) -> dict[str, int]:
    """The ``[workers]`` keys of the layout asked for (the built-in default's otherwise)."""
    keys = {"count": args.workers, "slots": args.slots, "threads": args.threads}
    return {k: v for k, v in keys.items() if v is not None}


def sequences(args: argparse.Namespace) -> int:
    """Sequences the layout runs at once: workers x slots."""
    w = WorkersSection()
    count = w.count if args.workers is None else args.workers
    slots = w.slots if args.slots is None else args.slots
    assert isinstance(slots, int), "give --slots with workers.slots = auto"
    return count * slots


class Config:
    """One node of the comparison, its generators and what was measured with it busy."""

    def __init__(
        self, name: str, cpus: list[int] | str, args: argparse.Namespace, **workers: Any
    ) -> None:
        self.name, self.cpus = name, cpus
        self.node = NodeProcess(
            {
                # "required": the table needs real cgroups and cpusets, or it would mislead.
                "workers": {
                    "engine": "llama",
                    "cpus": cpus,
                    "sandbox": "required",
                    **layout(args),
                    **workers,
                },
                "broker": {"stall_timeout_ms": 60_000},
            }
        )
        # One client per slot: every sequence of every worker generating.
        self.gens = [
            Generator(self.node.frontend, args.max_tokens, i) for i in range(sequences(args))
        ]
        self.busy: list[dict[str, Any]] = []
        self.coverage: list[float] = []
        self.rates: list[float] = []
        self.memory: list[dict[str, Any]] = []
        self.placement: dict[str, list[int]] = {}
        self.capacity: dict[str, Any] = {}

    def start(self, args: argparse.Namespace) -> None:
        self.node.start(timeout=args.timeout)
        status = self.node.status()
        self.placement = {p["worker_id"]: p["cpus"] for p in status["processes"]}
        self.capacity = status["capacity"]
        fill_contexts(self.node.frontend, sequences(args), N_CTX)
        for g in self.gens:
            g.start()

    def busy_probe(self, args: argparse.Namespace, pids: list[int], last: bool) -> None:
        """Every worker of this node generating for the whole probe window."""
        for g in self.gens:
            g.run_now.set()
        wait_until(lambda: llm_active(self.node) == sequences(args), 60)
        time.sleep(1.0)  # past the prompt evaluation: decoding from here on
        b = probe(args.probe_core, args.iterations, args.work, pids)
        self.busy.append(b)
        window = b["end"] - b["start"]
        self.coverage.append(min(g.covered(b["start"], b["end"]) for g in self.gens) / window)
        self.rates.append(sum(g.tokens_in(b["start"], b["end"]) for g in self.gens) / window)
        if last:
            self.memory = read_memory(self.node)  # still generating: the steady state
        for g in self.gens:
            g.run_now.clear()
        for g in self.gens:
            g.idle.wait(60)
        wait_until(lambda: llm_active(self.node) == 0, 30)

    def stop(self) -> None:
        for g in self.gens:
            g.halt.set()
        for g in self.gens:
            if g.is_alive():
                g.join(timeout=30)
        if any(g.error_count for g in self.gens):  # keep the node's logs to say why
            kept = Path(tempfile.mkdtemp(prefix=f"isolation-{self.name}-"))
            files = shutil.ignore_patterns("*.sock", "workers")  # not sockets, not cgroups
            shutil.copytree(self.node.run_dir, kept, ignore=files, dirs_exist_ok=True)
            print(f"{self.name}: generator errors; the node's logs are kept in {kept}")
        self.node.cleanup()

    def result(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workers_cpus": self.cpus,
            "placement": self.placement,
            "busy": summarize(self.busy),
            "busy_coverage": round(min(self.coverage), 4),
            "tok_per_s": round(sum(self.rates) / len(self.rates), 1),
            "errors": [e for g in self.gens for e in g.errors],
            "error_count": sum(g.error_count for g in self.gens),
            "capacity": self.capacity,
            "memory": self.memory,
        }


#: The control's load: a loop with no memory traffic at the workers' nice level.
SPIN = "import os, sys\nos.nice(int(sys.argv[1]))\nwhile True:\n    pass\n"


class Control:
    """The control case: the reserved cores busy without a node (``SPIN``, one
    process per core, pinned to it), so the report can tell what any busy process
    there costs the probe from what the model adds."""

    name = "busy loop"

    def __init__(self, cores: list[int]) -> None:
        self.cores = cores
        self.busy: list[dict[str, Any]] = []

    def busy_probe(self, args: argparse.Namespace, pids: list[int], last: bool) -> None:
        """Probe once with every reserved core spinning; the spinners end with it."""
        nice = str(WorkersSection().nice)
        spinners = [
            subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", SPIN, nice])
            for core in self.cores
        ]
        try:
            time.sleep(1.0)  # as a node's case waits past its prompts
            # The spinners' CPU is the case's load, not the host's "other" work.
            own = [*pids, *(p.pid for p in spinners)]
            self.busy.append(probe(args.probe_core, args.iterations, args.work, own))
        finally:
            for p in spinners:
                p.kill()
                p.wait()

    def result(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "workers_cpus": self.cores,
            "placement": {},
            "busy": summarize(self.busy),
            "busy_coverage": None,
            "tok_per_s": None,
            "errors": [],
            "error_count": 0,
        }


def run(args: argparse.Namespace, reserved: list[int] | str, cores: list[int]) -> dict[str, Any]:
    """Both nodes up at once; per round the probe runs idle, beside the reserved
    node's workers busy, beside the unreserved node's and beside the control's busy
    loop on the reserved ``cores``, in a rotating order, so the host's other load
    (which the benchmark cannot stop) hits every case alike."""
    configs = [Config("reserved", reserved, args), Config("unreserved", [], args)]
    if args.slice_baseline:
        configs.append(Config("unreserved-s0", [], args, slice_us=0))
    control = Control(cores) if args.control else None
    idle: list[dict[str, Any]] = []
    try:
        for c in configs:
            c.start(args)
        pin_threads_off(args.probe_core)
        pids = [c.node.proc.pid for c in configs if c.node.proc is not None]
        cases: list[Config | Control | None] = [None, *configs]
        if control is not None:
            cases.append(control)
        for r in range(args.rounds):
            turn = r % len(cases)
            for case in cases[turn:] + cases[:turn]:
                if case is None:
                    idle.append(probe(args.probe_core, args.iterations, args.work, pids))
                else:
                    case.busy_probe(args, pids, last=r == args.rounds - 1)
    finally:
        for c in configs:
            c.stop()
    return {
        "idle": summarize(idle),
        "configs": [c.result() for c in configs],
        "control": control.result() if control is not None else None,
    }


def read_memory(node: NodeProcess) -> list[dict[str, Any]]:
    """Per model worker: its cgroup's usage, peak and limit, and its smaps private bytes."""
    model = str(resolve_model("default"))
    out = []
    for proc in node.status()["processes"]:
        if proc["engine"] != "llama" or not proc["pid"]:
            continue
        m = smaps(proc["pid"], model)
        out.append(
            {
                "worker": proc["worker_id"],
                "cgroup_current": proc["memory"]["current"],
                "cgroup_peak": proc["memory"]["peak"],
                "cgroup_limit": proc["memory"]["limit"],
                "private": m["Private"] - m["model_private"],
                "pss": m["Pss"],
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3000, help="sleeps per probe")
    parser.add_argument("--rounds", type=int, default=3, help="idle/busy probe pairs per config")
    parser.add_argument("--workers", type=int, help="workers.count (default: the built-in one)")
    parser.add_argument("--slots", type=int, help="workers.slots (default: the built-in one)")
    parser.add_argument("--threads", type=int, help="workers.threads (default: the built-in one)")
    parser.add_argument("--probe-core", type=int, default=0)
    parser.add_argument(
        "--reserve",
        default="auto",
        help='workers.cpus of the reserved config: cores (e.g. 1) or "auto", the default '
        "(every allowed core but the first)",
    )
    parser.add_argument(
        "--duty", type=float, default=0.5, help="probe work per 1 ms period on an idle core (0..1)"
    )
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=240.0, help="node start timeout (s)")
    parser.add_argument(
        "--slice-baseline",
        action="store_true",
        help="also an unreserved node with workers.slice_us = 0 (the kernel's default slice)",
    )
    parser.add_argument(
        "--no-control",
        dest="control",
        action="store_false",
        help="leave out the control case (a busy loop on the reserved cores, no model)",
    )
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root: the node creates cgroups and cpusets")
    reserved: list[int] | str = (
        "auto" if args.reserve == "auto" else [int(c) for c in args.reserve.split(",")]
    )
    cores = reserved_cores(AUTO_CORES, allowed_cores()) if isinstance(reserved, str) else reserved
    if args.probe_core in cores or args.probe_core not in os.sched_getaffinity(0):
        sys.exit(f"--probe-core {args.probe_core} must be an allowed core outside {list(cores)}")
    load = os.getloadavg()
    print(
        f"host: {os.cpu_count()} CPUs, allowed {sorted(os.sched_getaffinity(0))}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} before the run"
    )
    args.work = calibrate(args.probe_core, args.duty)
    result = run(args, reserved, list(cores))
    report(result, args)
    if args.json:
        print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
