"""node.bench.load's arithmetic: goodput over the window or until the backlog is served."""

from __future__ import annotations

import threading
import time

import zmq

from broker import protocol as p
from node.bench.load import Reply, Run, closed_loop


def reply(status: str, at_s: float) -> Reply:
    return Reply({"id": f"r{at_s}", "status": status}, rtt_ms=10.0, at_s=at_s)


def test_goodput_counts_only_ok_replies_over_the_window() -> None:
    replies = [reply("ok", t / 10) for t in range(1, 41)] + [reply("error", 1.0)] * 30
    run = Run(replies, sent=72, window_s=5.0, elapsed_s=5.2)
    assert run.served_per_s() == 40 / 5.0
    assert run.lost == 2
    assert [r.ok for r in replies[39:41]] == [True, False]


def test_a_backlog_served_after_the_window_counts_with_its_time() -> None:
    # 10 served in the 2 s window, 10 more from the queue until 4 s: 5 req/s, not 10.
    replies = [reply("ok", 0.2 * i) for i in range(1, 21)]
    run = Run(replies, sent=20, window_s=2.0, elapsed_s=4.0)
    assert run.served_per_s() == 20 / 4.0
    assert Run([], sent=3, window_s=2.0, elapsed_s=2.0).served_per_s() == 0.0


def test_the_drain_waits_for_requests_longer_than_ten_seconds_would_allow() -> None:
    """Regression (first full bench run, remote scenario): a 10 s drain counted 128-token
    requests still being served (~13 s each on one core) as lost. A real DEALER/ROUTER pair;
    the fake server answers each request 0.4 s after it came."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        due: list[tuple[float, list[bytes]]] = []
        while not stop.is_set():
            if server.poll(10):
                frames = server.recv_multipart()
                body = p.unpack_map(frames[-1])
                reply = p.pack({"id": body["id"], "status": "ok"})
                due.append((time.monotonic() + 0.4, [*frames[:-1], reply]))
            while due and due[0][0] <= time.monotonic():
                server.send_multipart(due.pop(0)[1])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        endpoint = f"tcp://127.0.0.1:{port}"
        short = closed_loop(endpoint, False, {"op": "ping"}, 2, 0.05, drain_s=0.1)
        assert short.lost == 2  # both still out when a too-short drain gives up
        time.sleep(0.5)  # the late replies go to the closed socket
        enough = closed_loop(endpoint, False, {"op": "ping"}, 2, 0.05, drain_s=2.0)
        assert enough.lost == 0 and len(enough.replies) == 2
    finally:
        stop.set()
        thread.join(5)
        server.close(0)
