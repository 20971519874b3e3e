"""Scenario ``host``: does the host notice the node? A control loop's p99 with the node
idle and with every slot of its workers generating.

The probe (``node.bench.probe``) stands in for the host's own control loop: pinned to the
first allowed core (the one the default ``workers.cpus = "auto"`` leaves to the host), at
nice 0, every 1 ms it wakes and computes for half the period (calibrated on the idle core
before the node starts). Its response p99 (release to end
of work, µs) and missed deadlines are measured with the node idle (the baseline) and
busy (one ``Generator`` per slot streaming long generations back to back), in rounds
that alternate the two, so the host's other load falls on both alike. The node runs its
built-in layout with ``ctx.engine`` and the default sandbox (``scripts/bench_isolation.py``
compares reserved and unreserved cores with ``sandbox = "required"``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import zmq

from broker import protocol as p
from node.bench.context import BenchContext
from node.bench.probe import calibrate, probe, summarize
from node.bench.report import Plot, Section, Series, Table, share
from node.bench.stats import ratio
from node.config import WorkersSection
from node.testing import NodeProcess

#: A base model keeps going on a story; EOS ends one early now and then, and the
#: generator sends the next at once.
STORY = "Chapter one. The old lighthouse keeper climbed the stairs and"
DUTY = 0.5


class Generator(threading.Thread):
    """Streams long generations back to back while ``run_now`` is set; when it is
    cleared the current one is cancelled, and ``idle`` is set once it has ended."""

    def __init__(self, frontend: str, max_tokens: int, index: int) -> None:
        super().__init__(daemon=True)
        self.frontend, self.max_tokens, self.index = frontend, max_tokens, index
        self.run_now = threading.Event()
        self.idle = threading.Event()
        self.idle.set()
        self.halt = threading.Event()
        self.spans: list[tuple[float, float]] = []  # (start, end) of each generation
        self.current_start: float | None = None
        self.token_times: list[float] = []
        self.errors: list[str] = []
        self.error_count = 0

    def run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.frontend)
        n = 0
        try:
            while not self.halt.is_set():
                if not self.run_now.wait(0.05):
                    continue
                self.idle.clear()
                n += 1
                self._one(sock, f"g{self.index}-{n}")
                self.idle.set()
        finally:
            sock.close(0)

    def _one(self, sock: zmq.Socket[bytes], rid: str) -> None:
        body = {
            "id": rid,
            "op": "generate",
            "prompt": STORY,
            "max_tokens": self.max_tokens,
            "temperature": 0.8,
            "route": "llm",
            "stream": True,
            # Long enough for max_tokens on a shared core: admission refuses, up
            # front, what its size says cannot finish by the deadline.
            "timeout_ms": 600_000,
        }
        sock.send_multipart([b"", p.CLIENT_TAG, p.pack(body)])
        self.current_start = start = time.monotonic()
        cancelled = False
        while True:
            if not cancelled and (not self.run_now.is_set() or self.halt.is_set()):
                cancel = {"id": f"{rid}-cancel", "op": "cancel", "target": rid}
                sock.send_multipart([b"", p.CLIENT_TAG, p.pack(cancel)])
                cancelled = True
            if not sock.poll(50):
                continue
            reply = p.unpack_map(sock.recv_multipart()[-1])
            if reply.get("id") != rid:
                continue  # the cancel's own answer
            if reply["status"] == "partial":
                self.token_times.append(time.monotonic())
                continue
            if reply["status"] == "error" and reply.get("code") != 499:
                if len(self.errors) < 5:  # the first few say why; the rest would only repeat
                    self.errors.append(f"{reply.get('code')} {reply.get('message')}")
                self.error_count += 1
                time.sleep(0.5)  # a refused request must not become a busy loop
            break
        self.spans.append((start, time.monotonic()))
        self.current_start = None

    def covered(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which a generation was in flight."""
        spans = list(self.spans)
        if self.current_start is not None:
            spans.append((self.current_start, end))
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans)

    def tokens_in(self, start: float, end: float) -> int:
        return sum(1 for t in list(self.token_times) if start <= t <= end)


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``."""
    return 1 + 2 * ctx.pick(1, 3)


def node_sections(ctx: BenchContext) -> dict[str, dict[str, Any]]:
    """The node: built-in layout, ``ctx.engine``; long generations allowed."""
    workers: dict[str, Any] = {"engine": ctx.engine}
    if ctx.engine == "test":
        workers["test_token_ms"] = 5
    return {"workers": workers, "broker": {"stall_timeout_ms": 60_000}}


def run(ctx: BenchContext) -> Section:
    """Alternate idle and busy probes, ``rounds`` of each; see the module."""
    rounds = ctx.pick(1, 3)
    iterations = ctx.pick(1500, 3000)
    core = min(os.sched_getaffinity(0))
    ctx.step("host: calibrating the probe, starting the node")
    work = calibrate(core, DUTY)
    node = NodeProcess(node_sections(ctx))
    w = WorkersSection()
    sequences = w.count * (w.slots if isinstance(w.slots, int) else 4)
    gens = [Generator(node.frontend, 1024, i) for i in range(sequences)]
    idle: list[dict[str, Any]] = []
    busy: list[dict[str, Any]] = []
    try:
        node.start(timeout=180)
        assert node.proc is not None
        pids = [node.proc.pid]
        for g in gens:
            g.start()
        for r in range(rounds):
            ctx.step(f"host: probe, node idle {r + 1}/{rounds}")
            idle.append(probe(core, iterations, work, pids))
            ctx.step(f"host: probe, node busy {r + 1}/{rounds}")
            for g in gens:
                g.run_now.set()
            time.sleep(1.0)  # past the first prompt evaluation
            busy.append(probe(core, iterations, work, pids))
            for g in gens:
                g.run_now.clear()
            for g in gens:
                g.idle.wait(60)
    finally:
        for g in gens:
            g.halt.set()
        for g in gens:
            if g.is_alive():
                g.join(timeout=30)
        node.cleanup()
    errors = sum(g.error_count for g in gens)
    return section(ctx, summarize(idle), summarize(busy), iterations, errors)


def section(
    ctx: BenchContext, idle: dict[str, Any], busy: dict[str, Any], iterations: int, errors: int
) -> Section:
    """The report of ``run``'s measurements."""
    rows = [
        (
            name,
            s["resp_p50_us"],
            s["resp_p99_us"],
            s["p99_us"],
            f"{s['missed_pct']:.2f} %",
            ratio(s["resp_p99_us"], idle["resp_p99_us"]),
        )
        for name, s in (("node idle (baseline)", idle), ("node busy", busy))
    ]
    table = Table(
        (
            "case",
            "response p50 µs",
            "response p99 µs",
            "wake-up lateness p99 µs",
            "missed 1 ms deadlines",
            "p99 / idle p99",
        ),
        rows,
    )
    text = (
        f"A 1 ms control loop at {share(DUTY)} duty on core {min(os.sched_getaffinity(0))}, "
        f"{iterations} cycles per probe; node engine `{ctx.engine}`, built-in layout, "
        f"default sandbox. Load errors while busy: {errors}. Other load on the host "
        f"(cores' worth, neither the probe nor the node): idle {idle['other_cores']}, "
        f"busy {busy['other_cores']}."
    )
    plot = Plot(
        "host",
        "control loop response by percentile",
        "percentile",
        "response (µs)",
        [
            Series("node idle", [50, 99], [idle["resp_p50_us"], idle["resp_p99_us"]]),
            Series("node busy", [50, 99], [busy["resp_p50_us"], busy["resp_p99_us"]]),
        ],
    )
    data = {"engine": ctx.engine, "idle": idle, "busy": busy, "errors": errors}
    return Section("host", "Host protection", text, [table], [], [plot], data)
