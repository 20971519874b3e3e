"""The broker-overhead baseline: a raw pyzmq ROUTER/ROUTER relay with echo workers.

The relay is the zguide's load-balancing broker and nothing more: a client's frames go to
a worker with a free slot, the worker's reply goes back to the client. No admission,
deadlines, liveness, routing or accounting: what is left of the node's broker loop once
everything the node adds is taken away. Its workers unpack each request (msgpack) and
pack a reply of the node's shape, as the node's workers do, so the difference measured
is the broker's.

Run as ``python -m node.bench.relay FRONTEND BACKEND --workers W --slots S``: the relay
in this process, its W workers as child processes (``... worker BACKEND --slots S``).
It prints ``ready`` once every worker has offered its slots, and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
from types import FrameType

import zmq

from broker import protocol as p
from node.interpreter import module_command
from node.testing import DIE_WITH_HARNESS


def serve_worker(backend: str, slots: int) -> None:
    """A worker: offers ``slots`` slots, then answers each ``[client, request]`` with
    ``[client, reply]`` (an ``ok`` reply with the request's id and ``"echo:"``)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend)
    for _ in range(slots):
        sock.send_multipart([b"", b"READY"])
    while True:
        client, request = sock.recv_multipart()
        body = p.unpack_map(request)
        reply = {"id": body.get("id"), "status": "ok", "text": "echo:", "finish_reason": "length"}
        sock.send_multipart([client, p.pack(reply)])


def relay(frontend: str, backend: str, workers: int, slots: int) -> None:
    """The relay loop; starts ``workers`` worker processes and stops them on SIGTERM."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    for s in (front, back):
        s.setsockopt(zmq.LINGER, 0)
    front.bind(frontend)
    back.bind(backend)
    # The workers end with the relay, even when it is killed (prctl in DIE_WITH_HARNESS).
    argv = [sys.executable, "-c", DIE_WITH_HARNESS, str(os.getpid())]
    argv += module_command("node.bench.relay", "worker", backend, "--slots", str(slots))
    children = [subprocess.Popen(argv) for _ in range(workers)]

    def stop(_signum: int, _frame: FrameType | None) -> None:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(10)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    free: collections.deque[bytes] = collections.deque()
    for _ in range(workers * slots):
        wid, _empty, _ready = back.recv_multipart()
        free.append(wid)
    print("ready", flush=True)
    poller = zmq.Poller()
    poller.register(back, zmq.POLLIN)
    poller.register(front, zmq.POLLIN)
    while True:
        # Clients are read only while a slot is free: the rest wait in zmq's queues.
        poller.modify(front, zmq.POLLIN if free else 0)
        events = dict(poller.poll())
        if back in events:
            wid, client, reply = back.recv_multipart()
            free.append(wid)
            front.send_multipart([client, b"", reply])
        if front in events and free:
            client, _empty, request = front.recv_multipart()
            back.send_multipart([free.popleft(), client, request])


def main() -> None:
    """The command line of the relay and of its workers (module docstring)."""
    parser = argparse.ArgumentParser(description="raw ROUTER/ROUTER relay (edgenode bench)")
    parser.add_argument("frontend")
    parser.add_argument("backend", nargs="?")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=1)
    args = parser.parse_args()
    if args.frontend == "worker":  # python -m node.bench.relay worker BACKEND --slots S
        serve_worker(args.backend, args.slots)
        return
    relay(args.frontend, args.backend, args.workers, args.slots)


if __name__ == "__main__":
    main()
