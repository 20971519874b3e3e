"""A real node's broker SIGSTOPped inside two requests must not learn the pause
as service time (break2 report, pollute.py): before the fix the decode rate went
22.6 -> 304 ms/token and every ``timeout_ms=300`` chat was refused with 503
``deadline_unmeetable`` on an idle node, for good.

The test engine, two workers x two slots, 20 ms per token; the broker's default
heartbeats (500 ms x 3), as the reporter ran, so that a 3 s pause costs no
worker (their link timeout is 10 livenesses).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from broker.errors import EdgeNodeError
from node.testing import Collector, NodeProcess

NodeFactory = Callable[..., NodeProcess]

CHAT = [{"role": "user", "content": "turn on the kitchen lights"}]
LONG_CHAT = [{"role": "user", "content": " ".join(f"lights{j}" for j in range(40))}]


def decode_ms(node: NodeProcess) -> float:
    rate = node.status()["service"]["llm"]["decode_ms_per_token"]
    assert isinstance(rate, float)
    return rate


def test_a_broker_pause_inside_requests_leaves_short_budgets_admitted(
    make_node: NodeFactory,
) -> None:
    node = make_node(
        workers={"count": 2, "slots": 2, "test_token_ms": 20},
        broker={"heartbeat_interval_ms": 500, "heartbeat_liveness": 3},
    )
    assert node.proc is not None
    with node.client(wait_ms=10_000) as c:
        # A prompt long enough to teach a prefill rate, then the chats to come.
        c.generate(" ".join(f"w{j}" for j in range(60)), max_tokens=20, timeout_ms=10_000)
        for _ in range(4):
            c.chat(CHAT, max_tokens=8, timeout_ms=5000)
    before = decode_ms(node)

    col = Collector(node.frontend)
    try:
        # Streamed, so that the broker is seen to have their first tokens before it
        # stops; the rest (about 0.5 s of decode) comes while it is stopped.
        for rid in ("paused-1", "paused-2"):
            col.send(id=rid, op="chat", messages=LONG_CHAT, max_tokens=24, stream=True)
        deadline = time.monotonic() + 10
        while not all(col.replies.get(rid) for rid in ("paused-1", "paused-2")):
            assert time.monotonic() < deadline, col.replies
            col.collect(until_all_final=False, timeout=0.01, linger=0)
        os.kill(node.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)
        finally:
            os.kill(node.proc.pid, signal.SIGCONT)
        col.collect(timeout=10)
        assert [col.final(rid)["status"] for rid in ("paused-1", "paused-2")] == ["ok", "ok"]
    finally:
        col.close()

    after = decode_ms(node)
    assert after <= 1.5 * before, (before, after)  # 106-110 ms/token before the fix
    refused = []
    with node.client(wait_ms=5000) as c:
        for _ in range(3):
            try:
                c.chat(CHAT, max_tokens=8, timeout_ms=300)
            except EdgeNodeError as exc:  # a 504 on a loaded machine is not the defect
                if exc.reason == "deadline_unmeetable":
                    refused.append(str(exc))
            time.sleep(0.2)
    assert not refused, (before, after, refused)
