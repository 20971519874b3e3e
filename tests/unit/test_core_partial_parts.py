"""A PARTIAL carrying several pieces of text (``parts``, PROTOCOL §13.2): one
message per decode step of a multi-slot worker, relayed exactly as the same
pieces sent one per message would be."""

from __future__ import annotations

from typing import Any

from broker.protocol import WorkerCommand
from brokerkit import W1, W2, BrokerHarness, generate

PARTIAL = WorkerCommand.PARTIAL


def two_running(h: BrokerHarness, *, stream: bool = True) -> tuple[int, int]:
    """Requests ``a`` and ``b`` running on one two-slot worker; their rids."""
    h.ready(W1, 0.0, slots=2)
    h.send(generate("a", stream=stream), 0.0)
    h.send(generate("b", stream=stream), 0.0)
    rids = [body["rid"] for body in h.requests(W1)]
    assert len(rids) == 2
    return rids[0], rids[1]


def parts(h: BrokerHarness, body: dict[str, Any], now: float) -> None:
    h.worker_send(W1, PARTIAL, body, now)


def test_one_partial_of_two_slots_reaches_both_clients_in_order(h: BrokerHarness) -> None:
    a, b = two_running(h)
    parts(h, {"parts": [[a, "Hel"], [b, "Wor"], [a, "lo"]], "progress": 3}, 0.5)
    assert h.replies() == [
        {"id": "a", "status": "partial", "text": "Hel", "index": 0},
        {"id": "b", "status": "partial", "text": "Wor", "index": 0},
        {"id": "a", "status": "partial", "text": "lo", "index": 1},
    ]
    h.final(W1, a, 1.0, text=None)
    h.final(W1, b, 1.0, text=None)
    finals = {r["id"]: r for r in h.replies()}
    assert finals["a"]["text"] == "Hello" and finals["b"]["text"] == "Wor"
    # The first piece marks the first token, as a PARTIAL of its own does.
    assert finals["a"]["ttft_ms"] == 500 and finals["b"]["ttft_ms"] == 500
    h.assert_each_answered_once()


def test_the_same_pieces_one_per_message_give_the_same_replies() -> None:
    batched, single = BrokerHarness(), BrokerHarness()
    pieces = [("a", "x"), ("b", "y"), ("b", "z")]
    for h, one_each in ((batched, False), (single, True)):
        rid = dict(zip("ab", two_running(h), strict=True))
        if one_each:
            for n, (name, text) in enumerate(pieces):
                parts(h, {"rid": rid[name], "text": text, "progress": n + 1}, 0.2)
        else:
            parts(h, {"parts": [[rid[n], t] for n, t in pieces], "progress": 3}, 0.2)
        for name in "ab":
            h.final(W1, rid[name], 0.4, text=None)
    assert batched.replies() == single.replies()


def test_bad_pieces_are_skipped_and_the_good_ones_kept(h: BrokerHarness) -> None:
    a, b = two_running(h)
    h.ready(W2, 0.0)
    bad: list[Any] = [[a, 7], [a], "x", [b + 100, "not its"], [str(a), "str rid"], [b, "ok"]]
    parts(h, {"parts": bad, "progress": 1}, 0.1)
    assert h.replies() == [{"id": "b", "status": "partial", "text": "ok", "index": 0}]
    parts(h, {"parts": "not a list", "progress": 2}, 0.2)  # ignored, as a text that is no str
    assert h.replies() == []
    h.final(W1, a, 0.3)
    h.final(W1, b, 0.3)
    h.replies()
    h.assert_each_answered_once()
    assert h.broker.workers.get(W1) is not None  # a bad piece is no protocol error


def test_parts_count_as_progress(h: BrokerHarness) -> None:
    a, _ = two_running(h, stream=False)
    worker = h.broker.workers.get(W1)
    assert worker is not None
    before = worker.progress_at
    parts(h, {"parts": [[a, "t"]], "progress": 5}, 0.7)
    assert worker.progress_at == 0.7 and worker.progress_at != before
    assert h.replies() == []  # not streamed: held for the final
