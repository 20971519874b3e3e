#!/usr/bin/env python3
"""The broker's overhead against a raw pyzmq ROUTER/ROUTER relay (a benchmark, not a test).

Both sides carry the same conversation: a client DEALER sends
``["", "EDGE/C1", body]`` with ``k`` requests in flight (closed loop), a router
passes it to a worker DEALER and the worker's answer back. The node side is a
real node (``edgenode start``) with one test-engine worker of ``k`` slots and
``test_token_ms = 0``, asked for one token (``max_tokens = 1``), so its time is
the broker's and the worker's own I/O; the relay side is a process whose ROUTER
pair only forwards frames, with a worker process that answers each request at
once with a FINAL of the same shape.

Rounds are interleaved (relay, node, relay, node, ...) so both see the same
load from the machine's other users. Per round: requests/s, and the CPU time
(user + sys, from /proc) per request of the router process (the node's broker
process, or the relay) and of the worker process, less what each process spends
idle in the same time (measured before the rounds: the node's heartbeats and
pressure readings): the marginal CPU cost of a request. It is the robust figure
on a shared machine: it does not count the time a process waited for a core.
``--profile`` runs py-spy on the node's process during the node rounds (needs
py-spy on PATH or in the venv). ``--before TREE`` also runs a
node from another source tree (e.g. a worktree of ``main``), as side ``before``,
in the same interleaved rounds: the A/B of a change.

``--stream K,...`` adds the per-token cost (issue 10): ``K`` streamed requests
in flight of ``STREAM_TOKENS`` tokens each, with per streamed token the CPU time
of the broker's process and of the worker's I/O thread (its main thread; the
engine threads are not counted), from ``/proc/<pid>/task/<tid>/schedstat`` (ns).

Usage: ``python scripts/bench_overhead.py [--seconds 3] [--rounds 3] [--inflight 1,8]
[--stream 1,4] [--profile DIR] [--before TREE] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from node.bench.context import list_type
from node.testing import NodeProcess

#: The relay and its worker, run as separate processes (``python -c``).
RELAY = textwrap.dedent(
    """
    import sys, zmq
    ctx = zmq.Context()
    front = ctx.socket(zmq.ROUTER); front.bind(sys.argv[1])
    back = ctx.socket(zmq.ROUTER); back.bind(sys.argv[2])
    # The worker says hello first, so the relay knows its routing id.
    worker = back.recv_multipart()[0]
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if front in ready:
            while True:
                try:
                    frames = front.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                # [client, "", tag, body] -> [worker, client, "", tag, body]
                back.send_multipart([worker, *frames])
        if back in ready:
            while True:
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                front.send_multipart(frames[1:])
    """
)
RELAY_WORKER = textwrap.dedent(
    """
    import sys, msgpack, zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER); sock.connect(sys.argv[1])
    sock.send_multipart([b"hello"])
    while True:
        client, empty, tag, body = sock.recv_multipart()
        req = msgpack.unpackb(body)
        reply = {"id": req["id"], "status": "ok", "text": "echo:", "finish_reason": "length",
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        sock.send_multipart([client, empty, tag, msgpack.packb(reply)])
    """
)

NODE_SECTIONS: dict[str, dict[str, Any]] = {
    # nice 0 and every core (cpus = []), as the relay's worker: on a busy machine a nice-10
    # worker's wait for a core, not the broker, would set the node's req/s.
    "workers": {
        "engine": "test",
        "count": 1,
        "threads": 1,
        "test_token_ms": 0,
        "nice": 0,
        "cpus": [],
    },
    "fallback": {"rules": ""},
    "pressure": {"cpu_warn_pct": 0.0},
    "broker": {"max_in_flight_per_client": 10_000},
}


@dataclass
class Round:
    """One measured round: ``side`` is ``relay`` or ``node``."""

    side: str  # relay, node, or before (the node of --before TREE)
    inflight: int
    requests: int
    seconds: float
    router_cpu_s: float
    worker_cpu_s: float

    @property
    def rate(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds

    @property
    def router_us(self) -> float:
        """The router process's CPU µs per request."""
        return 1e6 * self.router_cpu_s / self.requests

    @property
    def worker_us(self) -> float:
        """The worker process's CPU µs per request."""
        return 1e6 * self.worker_cpu_s / self.requests


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU seconds of ``proc`` (all its threads)."""
    times = proc.cpu_times()
    return float(times.user + times.system)


#: Tokens of one streamed request (the test engine answers one per prompt word).
STREAM_TOKENS = 64


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds of ``pid``'s thread ``tid`` (None: all its threads), from schedstat (ns)."""
    tids = [tid] if tid is not None else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    total = 0
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as fh:
                total += int(fh.read().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def stream_drive(endpoint: str, inflight: int, seconds: float) -> tuple[int, float]:
    """Closed loop of ``inflight`` streamed requests; returns (partials, elapsed s)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    prompt = " ".join(["w"] * (STREAM_TOKENS - 1))  # "echo:" and one token per word
    n = tokens = 0

    def send() -> None:
        nonlocal n
        body = {"id": n, "op": "generate", "prompt": prompt, "max_tokens": STREAM_TOKENS}
        sock.send_multipart([b"", b"EDGE/C1", msgpack.packb({**body, "stream": True})])
        n += 1

    done = 0
    try:
        for _ in range(inflight):
            send()
        start = time.monotonic()
        while time.monotonic() < start + seconds:
            if not sock.poll(2000):
                raise RuntimeError("no reply in 2 s")
            reply = msgpack.unpackb(sock.recv_multipart()[-1])
            if reply["status"] == "partial":
                tokens += 1
                continue
            if reply["status"] != "ok":
                raise RuntimeError(f"not ok: {reply}")
            done += 1
            send()
        elapsed = time.monotonic() - start
        while n - done and sock.poll(3000):
            if msgpack.unpackb(sock.recv_multipart()[-1])["status"] != "partial":
                done += 1
    finally:
        sock.close(0)
    return tokens, elapsed


def measure_stream(side: str, node: NodeProcess, inflight: int, seconds: float) -> dict[str, Any]:
    """Per streamed token: CPU µs of the broker's process and of the worker's I/O thread."""
    broker = node.status()["pid"]
    worker = node.worker_pids()[0]
    stream_drive(node.frontend, inflight, 0.3)
    b0, w0 = thread_cpu_s(broker), thread_cpu_s(worker, worker)
    tokens, elapsed = stream_drive(node.frontend, inflight, seconds)
    return {
        "side": side,
        "inflight": inflight,
        "tokens_s": tokens / elapsed,
        "broker_us_per_token": 1e6 * (thread_cpu_s(broker) - b0) / tokens,
        "worker_io_us_per_token": 1e6 * (thread_cpu_s(worker, worker) - w0) / tokens,
    }


def drive(endpoint: str, inflight: int, seconds: float) -> tuple[int, float]:
    """Closed loop of ``inflight`` requests for ``seconds``; returns (finals, elapsed s)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    body = {"op": "generate", "prompt": "hi", "max_tokens": 1}
    n = 0

    def send() -> None:
        nonlocal n
        sock.send_multipart([b"", b"EDGE/C1", msgpack.packb({"id": n, **body})])
        n += 1

    done = 0
    try:
        for _ in range(inflight):
            send()
        start = time.monotonic()
        end = start + seconds
        while time.monotonic() < end:
            if not sock.poll(1000):
                raise RuntimeError("no reply in 1 s")
            reply = msgpack.unpackb(sock.recv_multipart()[-1])
            if reply["status"] == "partial":
                continue
            if reply["status"] != "ok":
                raise RuntimeError(f"not ok: {reply}")
            done += 1
            send()
        elapsed = time.monotonic() - start
        # Let the last requests finish, unmeasured, so the next round starts clean.
        outstanding = n - done
        while outstanding and sock.poll(2000):
            if msgpack.unpackb(sock.recv_multipart()[-1])["status"] != "partial":
                outstanding -= 1
    finally:
        sock.close(0)
    return done, elapsed


Pair = tuple[psutil.Process, psutil.Process]


def idle_rates(pair: Pair, seconds: float) -> tuple[float, float]:
    """CPU seconds per second the router and the worker spend with nothing in flight."""
    r0, w0 = cpu_s(pair[0]), cpu_s(pair[1])
    time.sleep(seconds)
    return (cpu_s(pair[0]) - r0) / seconds, (cpu_s(pair[1]) - w0) / seconds


def measure(
    side: str, endpoint: str, pair: Pair, idle: tuple[float, float], inflight: int, seconds: float
) -> Round:
    """One round against an already running router/worker ``pair``; ``idle`` is
    their ``idle_rates``, taken off."""
    router, worker = pair
    drive(endpoint, inflight, 0.3)  # warm-up: connections, caches
    r0, w0 = cpu_s(router), cpu_s(worker)
    done, elapsed = drive(endpoint, inflight, seconds)
    router_s = max(0.0, cpu_s(router) - r0 - idle[0] * elapsed)
    worker_s = max(0.0, cpu_s(worker) - w0 - idle[1] * elapsed)
    return Round(side, inflight, done, elapsed, router_s, worker_s)


def start_relay(run_dir: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    """The relay and its worker; returns their processes and the client endpoint."""
    front, back = f"ipc://{run_dir}/relay-front.sock", f"ipc://{run_dir}/relay-back.sock"
    relay = subprocess.Popen([sys.executable, "-c", RELAY, front, back])
    time.sleep(0.3)
    worker = subprocess.Popen([sys.executable, "-c", RELAY_WORKER, back])
    time.sleep(0.3)
    return [relay, worker], front


def summary(rounds: list[Round]) -> dict[str, Any]:
    """Medians per (side, in flight), and the node/relay ratios."""
    out: dict[str, Any] = {}
    for k in sorted({r.inflight for r in rounds}):
        row: dict[str, Any] = {}
        for side in ("relay", "node", "before"):
            mine = [r for r in rounds if r.side == side and r.inflight == k]
            if not mine:
                continue
            row[side] = {
                "req_s": statistics.median(r.rate for r in mine),
                "router_cpu_us_per_req": statistics.median(r.router_us for r in mine),
                "worker_cpu_us_per_req": statistics.median(r.worker_us for r in mine),
            }
        # The ratio of each interleaved pair, then their median: a pair shares the load.
        relay = [r for r in rounds if r.side == "relay" and r.inflight == k]
        for side in ("node", "before"):
            mine = [r for r in rounds if r.side == side and r.inflight == k]
            if mine:
                pairs = zip(relay, mine, strict=True)
                row[f"{side}_req_s_ratio"] = statistics.median(n.rate / r.rate for r, n in pairs)
        out[str(k)] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--inflight", type=list_type("level", int), default=[1, 8])
    parser.add_argument("--profile", type=Path, help="py-spy the node's process into DIR")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--before", type=Path, help="also run a node from this source tree")
    parser.add_argument(
        "--stream",
        type=list_type("level", int),
        default=[],
        help="streamed requests in flight, e.g. 1,4 (default none)",
    )
    args = parser.parse_args()
    levels: list[int] = args.inflight
    run_dir = Path(tempfile.mkdtemp(prefix="ov-"))
    relay_procs, relay_front = start_relay(run_dir)
    sections = {name: dict(values) for name, values in NODE_SECTIONS.items()}
    streams: list[int] = args.stream
    sections["workers"]["slots"] = max(levels + streams)
    nodes = {"node": NodeProcess(sections).start()}
    if args.before is not None:
        # The node and its workers import from PYTHONPATH (they run with -P).
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = str(args.before.resolve())
        try:
            nodes["before"] = NodeProcess(sections).start()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    rounds: list[Round] = []
    token_rounds: list[dict[str, Any]] = []
    try:
        procs = {
            side: (psutil.Process(n.status()["pid"]), psutil.Process(n.worker_pids()[0]))
            for side, n in nodes.items()
        }
        node_proc = procs["node"][0]
        procs["relay"] = (psutil.Process(relay_procs[0].pid), psutil.Process(relay_procs[1].pid))
        time.sleep(1.0)  # the nodes' start-up is over
        idle = {side: idle_rates(pair, 2.0) for side, pair in procs.items()}
        shown = {side: [round(1e3 * x, 1) for x in rates] for side, rates in idle.items()}
        print("idle CPU, ms/s (router, worker):", shown, flush=True)
        spy = None
        for i in range(args.rounds):
            for k in levels:
                rounds.append(
                    measure("relay", relay_front, procs["relay"], idle["relay"], k, args.seconds)
                )
                if args.profile is not None and spy is None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    spy = subprocess.Popen(
                        [_py_spy(), "record", "--pid", str(node_proc.pid), "--format", "raw",
                         "-o", str(args.profile / "node.txt"), "--rate", "200", "--nonblocking"]
                    )  # fmt: skip
                for side, n in nodes.items():
                    rounds.append(
                        measure(side, n.frontend, procs[side], idle[side], k, args.seconds)
                    )
                for r in rounds[-1 - len(nodes) :]:
                    print(
                        f"round {i} {r.side:5} k={k}: {r.rate:8.0f} req/s"
                        f"  router {r.router_us:6.0f} µs/req  worker {r.worker_us:6.0f} µs/req",
                        flush=True,
                    )
            for k in streams:
                for side, n in nodes.items():
                    token_rounds.append(measure_stream(side, n, k, args.seconds))
                    t = token_rounds[-1]
                    print(
                        f"round {i} {side:5} stream k={k}: {t['tokens_s']:7.0f} tokens/s"
                        f"  broker {t['broker_us_per_token']:5.0f} µs/token"
                        f"  worker I/O {t['worker_io_us_per_token']:5.0f} µs/token",
                        flush=True,
                    )
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
    finally:
        for n in nodes.values():
            n.cleanup()
        for proc in relay_procs:
            proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    figures = summary(rounds) if rounds else {}
    for k in streams:
        for side in nodes:
            mine = [t for t in token_rounds if t["side"] == side and t["inflight"] == k]
            figures.setdefault(f"stream {k}", {})[side] = {
                key: statistics.median(t[key] for t in mine)
                for key in ("tokens_s", "broker_us_per_token", "worker_io_us_per_token")
            }
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def _py_spy() -> str:
    found = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return found


if __name__ == "__main__":
    main()
