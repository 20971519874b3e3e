"""Multi-slot workers keep their books: credit = free slots, and it balances after
a thousand mixed requests with cancels, deadlines and json_schema requests (test
engine, four slots per worker process, real sockets and processes)."""

from __future__ import annotations

import random
from collections.abc import Callable

from fallback.intents import INTENT_SCHEMA
from node.testing import Collector, NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]

SLOTS = 4
N = 1000


def test_credit_balances_after_a_thousand_mixed_requests(make_node: NodeFactory) -> None:
    node = make_node(
        workers={"count": 2, "slots": SLOTS, "test_token_ms": 2},
        # Credit, not liveness, is tested: with the tests' 300 ms of liveness a worker
        # starved by a loaded CI machine was declared dead and its request answered 503
        # (reproduced beside two busy loops: 2 restarts in 6 runs; none in 8 with 2 s).
        broker={"max_queue": 2000, "max_in_flight_per_client": 2000, "heartbeat_liveness": 20},
        routing={"mode": "full"},
    )
    workers = node.status()["workers"]
    assert [(w["slots"], w["credit"]) for w in workers] == [(SLOTS, SLOTS)] * 2
    rng = random.Random(10)
    col = Collector(node.frontend)
    kinds: dict[str, str] = {}
    try:
        for i in range(N):
            rid, kind = f"r{i}", rng.choice(["plain", "cancel", "deadline", "schema", "stream"])
            kinds[rid] = kind
            body = {"id": rid, "op": "generate", "prompt": f"request {i} of many", "max_tokens": 6}
            if kind == "deadline":
                body |= {"prompt": "!slow 50 will not finish in time", "timeout_ms": 60}
            elif kind == "schema":
                body |= {"prompt": '!json {"intent": "lights_on"}', "json_schema": INTENT_SCHEMA}
            elif kind == "stream":
                body |= {"stream": True}
            elif kind == "cancel":
                body |= {"prompt": "!slow 40 a long one"}
            col.send(**body)
            if kind == "cancel":
                col.send(id=f"c{i}", op="cancel", target=rid)
            if i % 50 == 49:
                col.collect(timeout=0.05, until_all_final=False, linger=0)
        col.collect(timeout=60, linger=0.5)
        col.assert_exactly_one_final_each()
        codes = {rid: col.final(rid).get("code", 200) for rid in kinds}
        served = [r for r, k in kinds.items() if k in ("plain", "schema", "stream")]
        assert all(codes[r] == 200 for r in served), [
            str(col.final(r)) for r in served if codes[r] != 200
        ]
        assert all(codes[r] in (200, 499) for r, k in kinds.items() if k == "cancel")
        assert sum(codes[r] == 499 for r, k in kinds.items() if k == "cancel") > 100
        assert all(codes[r] in (503, 504) for r, k in kinds.items() if k == "deadline")

        def balanced() -> bool:
            status = node.status()
            return all(w["credit"] == w["slots"] == SLOTS for w in status["workers"])

        assert wait_for(balanced, timeout=10)  # every slot came back, none twice
        status = node.status()
        assert status["in_flight"] == 0 and status["queue_depth"] == 0
        assert [p["restarts"] for p in status["processes"]] == [0, 0]
    finally:
        col.close()
