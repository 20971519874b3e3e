#!/usr/bin/env python3
"""Instructions per request of the sans-I/O broker core, counted by callgrind (a benchmark).

CPU times on a shared machine move with the load; an instruction count does not.
This drives ``broker.core.Broker`` alone (no sockets, no node) through ``n``
requests as the overhead bench sends them (``scripts/bench_overhead.py``: one
``generate`` of one token, not streamed): the client's message, the REQUEST taken
from the outbox, the worker's reply, a ``tick``, the outbox taken as the loop
takes it. The worker's reply is a PARTIAL then a FINAL (``--reply split``, the
worker before PROTOCOL §13.3) or one FINAL carrying its text's last piece
(``--reply merged``).

Run under callgrind twice, with ``n`` and ``2n`` requests, and take the difference:
start-up (imports, the first request's warm-up) cancels out. ``--callgrind`` does
both runs and prints instructions per request::

    python scripts/callgrind_core.py --callgrind [--requests 200] [--reply merged]

Needs ``valgrind`` on PATH. ``--consume`` says which of the outbox's optional
records the loop consumes (``broker.outbox.Consumed``): ``none`` (the default
node: JSON logs at INFO, metrics off) or ``all``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

from broker import protocol as p
from broker.core import Broker
from broker.outbox import Consumed
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings

WORKER = b"worker-1"
CLIENT = b"client-1"


def drive(requests: int, merged: bool, consume: Consumed) -> None:
    """``requests`` requests through a fresh core, one at a time (1 in flight)."""
    broker = Broker(BrokerSettings(max_in_flight_per_client=10_000))
    broker.outbox.consume(consume)
    now = 1.0
    ready = {"worker_id": "w1", "engine": "test", "slots": 8, "pid": 1, "n_ctx": 2048}
    broker.handle_worker([WORKER, *p.worker_frames(WorkerCommand.READY, ready)], now)
    broker.outbox.take()
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    for i in range(requests):
        now += 0.001
        body = {"id": i, "op": "generate", "prompt": "hi", "max_tokens": 1}
        broker.handle_client(p.client_frames(CLIENT, body), now)
        out = broker.outbox.take()
        command, sent = p.parse_worker_frames(out.workers[0][1:])
        assert command is WorkerCommand.REQUEST, command
        rid = sent["rid"]
        final = {"rid": rid, "status": "ok", "finish_reason": "length", "usage": usage}
        if merged:
            final["parts"] = [[rid, "echo:"]]
            final["progress"] = i + 1
        else:
            partial = {"rid": rid, "text": "echo:", "progress": i + 1}
            broker.handle_worker([WORKER, *p.worker_frames(WorkerCommand.PARTIAL, partial)], now)
        broker.handle_worker([WORKER, *p.worker_frames(WorkerCommand.FINAL, final)], now)
        broker.tick(now)
        out = broker.outbox.take()
        assert out.clients[-1].body["status"] == "ok", out.clients[-1].body


def count(requests: int, argv: list[str]) -> int:
    """Instructions callgrind collects for one run of ``requests`` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/cg.out",
            sys.executable,
            __file__,
            "--requests",
            str(requests),
            *argv,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in callgrind's output: {done.stderr[-500:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reply", choices=("split", "merged"), default="split")
    parser.add_argument("--consume", choices=("none", "all"), default="none")
    parser.add_argument("--callgrind", action="store_true", help="count under callgrind")
    args = parser.parse_args()
    consume = Consumed(traces=args.consume == "all", observations=args.consume == "all")
    if not args.callgrind:
        drive(args.requests, args.reply == "merged", consume)
        return
    argv = ["--reply", args.reply, "--consume", args.consume]
    n = args.requests
    per_request = (count(2 * n, argv) - count(n, argv)) / n
    print(f"reply {args.reply}, consume {args.consume}: {per_request:,.0f} instructions/request")


if __name__ == "__main__":
    main()
