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


FINAL = WorkerCommand.FINAL


def test_a_final_carrying_its_last_pieces_streams_them_before_the_final(
    h: BrokerHarness,
) -> None:
    """A FINAL with ``parts`` (the worker had its request's last text and its end
    at once): the pieces reach the client as partials, then the final, as a
    PARTIAL and a FINAL of their own would."""
    a, _ = two_running(h)
    body = {"rid": a, "status": "ok", "parts": [[a, "Hel"], [a, "lo"]], "progress": 2}
    h.worker_send(W1, FINAL, body, 0.25)
    replies = h.replies()
    assert [(r["status"], r["text"]) for r in replies] == [
        ("partial", "Hel"),
        ("partial", "lo"),
        ("ok", "Hello"),
    ]
    assert [r.get("index") for r in replies[:2]] == [0, 1]
    assert replies[2]["ttft_ms"] == 250  # the pieces mark the first token
    worker = h.broker.workers.get(W1)
    assert worker is not None and a not in worker.active  # its slot is free again


def test_merged_and_split_replies_give_the_same_answers() -> None:
    merged, split = BrokerHarness(), BrokerHarness()
    for h, together in ((merged, True), (split, False)):
        h.ready(W1, 0.0, slots=1)
        for stream in (True, False):
            h.send(generate(f"s{stream}", stream=stream), 0.0)
            rid = h.requests(W1)[0]["rid"]
            final = {"rid": rid, "status": "ok", "finish_reason": "length"}
            if together:
                h.worker_send(W1, FINAL, {**final, "parts": [[rid, "echo:"]], "progress": 1}, 0.1)
            else:
                h.worker_send(W1, PARTIAL, {"rid": rid, "text": "echo:", "progress": 1}, 0.1)
                h.worker_send(W1, FINAL, final, 0.1)
    assert merged.replies() == split.replies()
    merged.assert_each_answered_once()
    split.assert_each_answered_once()
    assert merged.broker.stats.counters == split.broker.stats.counters
