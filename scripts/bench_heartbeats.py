"""Heartbeat defaults: silence gaps under load, and what a shorter interval costs idle.

Two measurements of a real node (embedded, ``node.app.Node``, the built-in layout:
one model worker of 4 slots and the rule worker, cgroups as the host allows):

* ``--seconds`` (default 60) of every slot busy with the real model (back-to-back
  non-streamed requests of 48 tokens; the replies are counted by outcome),
  while ``--hogs`` CPU hogs (busy loops at nice 0, default 2: one per core here)
  load the host. The broker's view of each worker's silence is recorded: every
  gap between two messages it heard from a worker (``broker.liveness.Liveness.heard_from``,
  what the dead verdict reads). Reported: the gaps' p50/p99/max per worker, against
  the dead-after bound (interval x liveness), and every worker the node declared
  dead, stalled or hung, or restarted (must be 0: no false deaths).
  Verdicts before the load began (a READY timeout at start) are listed apart.
* ``--idle-seconds`` (default 15) of the same node idle, after the load: the broker
  process's CPU (user + sys, this process: the broker loop runs here; the load's
  client threads have ended) and its loop turns per second.

Run it once per candidate setting, e.g. ``--interval-ms 1000``, ``600``, ``500``;
docs/bench/figures.md ("Heartbeat defaults") has the figures behind the defaults.

    python scripts/bench_heartbeats.py --interval-ms 600 --liveness 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from broker.client import Client
from broker.errors import EdgeNodeError
from broker.liveness import Liveness
from broker.loop import BrokerLoop
from broker.workers import WorkerState
from node.app import Node
from node.bench.stats import percentile
from node.config import from_dict

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


#: A CPU hog: one core's worth of busy loop at nice 0, until killed.
HOG = [sys.executable, "-c", "while True: pass"]


class Verdicts(logging.Handler):
    """The node's lines saying it kills a worker (dead, stalled, hung, not ready)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("killing"):
            self.lines.append(message)


class Recorder:
    """Every time the broker heard from a worker, per worker id (monotonic seconds)."""

    def __init__(self) -> None:
        self.heard: dict[str, list[float]] = {}
        #: HEARTBEATs alone (``Liveness.note_progress`` runs for those only).
        self.beats: dict[str, list[float]] = {}
        self.turns = 0

    def install(self) -> None:
        """Wrap ``Liveness.heard_from`` and ``BrokerLoop.turn`` (this process only)."""
        heard_from = Liveness.heard_from
        note_progress = Liveness.note_progress
        turn = BrokerLoop.turn
        recorder = self

        def recording_heard(worker: WorkerState, now: float) -> None:
            recorder.heard.setdefault(worker.worker_id, []).append(now)
            heard_from(worker, now)

        def recording_beat(worker: WorkerState, progress: object, now: float) -> None:
            recorder.beats.setdefault(worker.worker_id, []).append(now)
            note_progress(worker, progress, now)

        def counting_turn(loop: BrokerLoop, *args: Any, **kwargs: Any) -> Any:
            recorder.turns += 1
            return turn(loop, *args, **kwargs)

        Liveness.heard_from = staticmethod(recording_heard)  # type: ignore[method-assign]
        Liveness.note_progress = staticmethod(recording_beat)  # type: ignore[method-assign]
        BrokerLoop.turn = counting_turn  # type: ignore[method-assign]

    def gaps_ms(self, since: float, until: float, beats: bool = False) -> dict[str, list[float]]:
        """Per worker, the silences between messages heard within [since, until] (ms);
        ``beats``: between HEARTBEATs alone."""
        out = {}
        for wid, times in (self.beats if beats else self.heard).items():
            inside = [t for t in times if since <= t <= until]
            out[wid] = [1000 * (b - a) for a, b in itertools.pairwise(inside)]
        return out


def load(
    endpoint: str, stop: threading.Event, counts: dict[str, int], lock: threading.Lock
) -> None:
    """One client thread: non-streamed generate requests back to back until ``stop``."""
    with Client(endpoint, timeout_ms=120_000) as client:
        while not stop.is_set():
            try:
                client.generate(PROMPT, max_tokens=48)
                key = "ok"
            except EdgeNodeError as exc:
                key = type(exc).__name__
            with lock:
                counts[key] = counts.get(key, 0) + 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-ms", type=int, default=None, help="default: the built-in one")
    parser.add_argument("--liveness", type=int, default=None, help="default: the built-in one")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--idle-seconds", type=float, default=15.0)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument(
        "--concurrency", type=int, default=4, help="client threads (4 = every slot)"
    )
    parser.add_argument("--engine", default="llama", choices=["llama", "test"])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    broker: dict[str, Any] = {}
    if args.interval_ms is not None:
        broker["heartbeat_interval_ms"] = args.interval_ms
    if args.liveness is not None:
        broker["heartbeat_liveness"] = args.liveness
    run_dir = Path(tempfile.mkdtemp(prefix="hb-"))
    config = from_dict(
        {
            "node": {"run_dir": str(run_dir)},
            "workers": {"engine": args.engine},
            "broker": broker,
            "routing": {"mode": "full"},
            "pressure": {"cpu_warn_pct": 0.0},
        }
    )
    b = config.broker
    dead_after_ms = b.heartbeat_interval_ms * b.heartbeat_liveness
    recorder = Recorder()
    recorder.install()
    verdicts = Verdicts()
    logging.getLogger("edgenode").addHandler(verdicts)
    result: dict[str, Any] = {
        "interval_ms": b.heartbeat_interval_ms,
        "liveness": b.heartbeat_liveness,
        "dead_after_ms": dead_after_ms,
        "hogs": args.hogs,
        "concurrency": args.concurrency,
    }
    with Node(config) as node:
        loads_before = os.getloadavg()
        stop = threading.Event()
        counts: dict[str, int] = {}
        lock = threading.Lock()
        threads = [
            threading.Thread(target=load, args=(node.frontend, stop, counts, lock))
            for _ in range(args.concurrency)
        ]
        start = time.monotonic()
        before_load = len(verdicts.lines)  # a READY timeout at start is no heartbeat verdict
        hogs = [subprocess.Popen(HOG) for _ in range(args.hogs)]
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        end = time.monotonic()
        stop.set()
        for t in threads:
            t.join()
        loads_after = os.getloadavg()
        for p in hogs:
            p.kill()
            p.wait()
        with Client(node.frontend) as client:
            status = client.status()
        gaps = recorder.gaps_ms(start, end)
        beat_gaps = recorder.gaps_ms(start, end, beats=True)
        result["load"] = {
            "seconds": round(end - start, 1),
            "replies": counts,
            "loadavg_1m_before_after": [loads_before[0], loads_after[0]],
            "gaps_ms": _summary(gaps),
            "heartbeat_gaps_ms": _summary(beat_gaps),
            "restarts": {p["worker_id"]: p["restarts"] for p in status["processes"]},
            "states": {p["worker_id"]: p["state"] for p in status["processes"]},
        }
        # Must be empty: no false deaths. Verdicts before the load (at start) apart.
        result["load"]["verdicts"] = verdicts.lines[before_load:]
        result["verdicts_at_start"] = verdicts.lines[:before_load]
        # Idle: the broker loop alone in this process (the client threads have ended).
        time.sleep(1.0)
        turns0, cpu0, t0 = recorder.turns, _cpu_s(), time.monotonic()
        time.sleep(args.idle_seconds)
        turns1, cpu1, t1 = recorder.turns, _cpu_s(), time.monotonic()
        result["idle"] = {
            "seconds": round(t1 - t0, 1),
            "turns_per_s": round((turns1 - turns0) / (t1 - t0), 2),
            "cpu_ms_per_s": round(1000 * (cpu1 - cpu0) / (t1 - t0), 3),
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)


def _summary(gaps: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        wid: {
            "n": len(g),
            "p50": round(percentile(g, 50), 1),
            "p99": round(percentile(g, 99), 1),
            "max": round(max(g), 1),
        }
        for wid, g in sorted(gaps.items())
        if g
    }


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if __name__ == "__main__":
    main()
