"""The sans-I/O broker core driven with hand-built frames and a fake clock.

Every scenario ends with ``h.assert_each_answered_once()``: each request a
client sent got exactly one final reply and nothing is left pending.
"""

from __future__ import annotations

from typing import Any

import pytest

from broker import protocol as p
from broker.exits import ExitCause
from broker.protocol import WorkerCommand
from broker.service_time import RETRY_AFTER_MAX_MS, RETRY_AFTER_MIN_MS
from brokerkit import (
    CLIENT,
    FAST,
    OTHER_CLIENT,
    W1,
    W2,
    BrokerHarness,
    bodies,
    generate,
)

REQUEST = WorkerCommand.REQUEST
CANCEL = WorkerCommand.CANCEL
DISCONNECT = WorkerCommand.DISCONNECT


def only_reply(h: BrokerHarness) -> dict[str, Any]:
    """The single reply sent since the last drain."""
    replies = h.replies()
    assert len(replies) == 1, replies
    return replies[0]


def one_request(h: BrokerHarness, identity: bytes) -> int:
    """Drain the backend, expect exactly one REQUEST to ``identity``; return its rid."""
    reqs = h.requests(identity)
    assert len(reqs) == 1, reqs
    rid = reqs[0]["rid"]
    assert isinstance(rid, int)
    return rid


# --------------------------------------------------------------------------- credit


def test_ready_grants_credit_equal_to_slots(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=3, worker_id="llm-0")
    assert h.credit(W1) == 3
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id, event.pid) == ("ready", "llm-0", 4242)
    assert h.broker.status(0.0)["credit"] == 3
    h.assert_each_answered_once()


def test_dispatch_consumes_one_credit_and_sends_the_request(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=2)
    h.send(generate("a", prompt="why?", temperature=0.5, timeout_ms=4000), 1.0)
    (req,) = h.requests(W1)
    assert req["prompt"] == "why?" and req["op"] == "generate" and req["temperature"] == 0.5
    assert req["max_tokens"] == FAST.default_max_tokens  # the broker fills the default
    assert req["timeout_ms"] == 4000  # what is left of the budget at dispatch
    assert h.credit(W1) == 1
    assert h.replies() == []
    h.final(W1, req["rid"], 1.5)
    assert only_reply(h)["status"] == "ok"
    assert h.credit(W1) == 2
    h.assert_each_answered_once()


def test_worker_without_credit_never_receives_a_request(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=1)
    for i in range(3):
        h.send(generate(f"r{i}", prompt=f"p{i}"), 0.0)
    first = h.requests(W1)
    assert [r["prompt"] for r in first] == ["p0"]
    h.tick(0.05, keepalive=(W1,))
    assert h.requests(W1) == []
    # FINAL frees the credit: the next one goes, oldest first, one at a time.
    served = ["p0"]
    rid = first[0]["rid"]
    for t in (0.1, 0.2):
        h.final(W1, rid, t)
        (nxt,) = h.requests(W1)
        served.append(nxt["prompt"])
        rid = nxt["rid"]
    h.final(W1, rid, 0.3)
    assert served == ["p0", "p1", "p2"]
    assert [r["id"] for r in h.replies()] == ["r0", "r1", "r2"]
    h.assert_each_answered_once()


def test_heartbeat_or_duplicate_ready_of_a_busy_worker_grants_no_credit(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0, slots=1)
    h.send(generate("a"), 0.0)
    rid = one_request(h, W1)
    h.send(generate("b"), 0.01)
    for i in range(1, 5):
        h.heartbeat(W1, i * 0.05, advance=1)  # alive and making progress, but busy
        h.broker.tick(i * 0.05)
    h.ready(W1, 0.25, slots=1)  # a repeated READY must not reset the ledger either
    assert h.requests(W1) == []
    assert h.credit(W1) == 0
    assert h.broker.status(0.25)["queue_depth"] == 1
    h.final(W1, rid, 0.3)
    rid_b = one_request(h, W1)
    h.final(W1, rid_b, 0.4)
    h.assert_each_answered_once()


def test_two_workers_take_one_each_and_a_third_waits_for_a_final(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.ready(W2, 0.0)
    for rid in ("a", "b", "c"):
        h.send(generate(rid, prompt=rid), 0.1)
    out = h.drain_workers()
    to_w1, to_w2 = bodies(out, W1, REQUEST), bodies(out, W2, REQUEST)
    assert len(to_w1) == 1 and len(to_w2) == 1 and len(out) == 2
    assert {to_w1[0]["prompt"], to_w2[0]["prompt"]} == {"a", "b"}
    assert h.broker.status(0.1)["queue_depth"] == 1
    h.tick(0.15, keepalive=(W1, W2))
    assert h.drain_workers() == []  # still nobody with credit
    h.final(W2, to_w2[0]["rid"], 0.2)
    (third,) = h.requests(W2)  # the freed worker, not the busy one
    assert third["prompt"] == "c"
    h.final(W1, to_w1[0]["rid"], 0.25)
    h.final(W2, third["rid"], 0.3)
    assert h.drain_workers() == []
    h.assert_each_answered_once()


def test_credit_message_resizes_the_worker(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=1)
    h.send(generate("a"), 0.0)
    h.send(generate("b"), 0.0)
    rid_a = one_request(h, W1)
    h.worker_send(W1, WorkerCommand.CREDIT, {"slots": 2}, 0.1)
    rid_b = one_request(h, W1)
    h.worker_send(W1, WorkerCommand.CREDIT, {"slots": 1}, 0.2)
    h.send(generate("c"), 0.2)
    h.final(W1, rid_a, 0.3)  # one free slot of two, but the limit is now 1
    assert h.requests(W1) == []
    h.final(W1, rid_b, 0.4)
    rid_c = one_request(h, W1)
    h.final(W1, rid_c, 0.5)
    h.assert_each_answered_once()


def test_the_io_loop_may_take_the_outbox_at_any_time(h: BrokerHarness) -> None:
    # broker/loop.py takes what is queued with ``Outbox.take``: every part of the broker
    # must append to the live outbox afterwards, never to a list taken away from it.
    h.ready(W1, 0.0, worker_id="llm-0")
    h.broker.outbox.take()
    h.send(generate("a"), 0.1)
    h.tick(0.1)
    commands = [p.parse_worker_frames(f[1:])[0] for f in h.broker.outbox.workers]
    assert commands == [REQUEST, WorkerCommand.HEARTBEAT]
    h.broker.outbox.take()
    h.broker.worker_exited("llm-0", ExitCause(signal="SIGKILL"), 0.2)
    h.broker.tick(0.2)  # the re-queued request has no worker left: its deadline answers
    assert [p.parse_worker_frames(f[1:])[0] for f in h.broker.outbox.workers] == [DISCONNECT]
    h.broker.outbox.workers.clear()
    h.tick(10.2)
    assert only_reply(h)["code"] == 504
    h.ready(W2, 10.3, worker_id="llm-0")
    assert [e.kind for e in h.drain_events()] == ["ready"]
    h.assert_each_answered_once()


def test_breaker_transitions_reach_the_outbox_after_a_take(h: BrokerHarness) -> None:
    # The circuit breaker appends to the outbox's ``transitions`` list itself: taking
    # the outbox must empty that list in place, never leave the breaker a stale one.
    breaker = h.broker.router.breaker
    h.broker.outbox.take()
    for _ in range(breaker.settings.minimum_calls):
        breaker.note_failure(0.0, "llm-0 died")
    (opened,) = h.broker.outbox.take().transitions
    assert (opened.old.value, opened.new.value) == ("closed", "open")
    breaker.state(breaker.settings.open_wait_ms / 1000)
    (half,) = h.broker.outbox.take().transitions
    assert (half.old.value, half.new.value) == ("open", "half_open")


# --------------------------------------------------------------------------- replies


def test_stream_relays_partials_then_a_timed_final(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("first"), 0.0)
    rid_first = one_request(h, W1)
    h.send(generate("s", stream=True), 1.0)  # waits one second in the queue
    h.final(W1, rid_first, 2.0)
    h.replies()
    rid = one_request(h, W1)
    h.partial(W1, rid, "Hel", 2.25)
    h.partial(W1, rid, "lo", 2.5)
    assert h.replies() == [
        {"id": "s", "status": "partial", "text": "Hel", "index": 0},
        {"id": "s", "status": "partial", "text": "lo", "index": 1},
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    h.final(W1, rid, 3.0, text="Hello", usage=usage, finish_reason="length")
    final = only_reply(h)
    assert final["status"] == "ok" and final["id"] == "s"
    assert final["text"] == "Hello" and final["usage"] == usage
    assert final["finish_reason"] == "length"
    assert final["served_by"] == "llm" and final["degraded"] is False
    assert (final["queue_ms"], final["ttft_ms"], final["total_ms"]) == (
        1000,
        1250,
        2000,
    )  # ttft counts from acceptance
    h.assert_each_answered_once()


def test_partials_are_not_relayed_without_stream(h: BrokerHarness) -> None:
    h.ready(W1, 5.0)
    h.send(generate("n"), 5.0)
    rid = one_request(h, W1)
    h.partial(W1, rid, "Hel", 5.1)
    h.partial(W1, rid, "lo", 5.2)
    assert h.replies() == []
    h.final(W1, rid, 5.3, text=None)  # no text in FINAL: the chunks are the answer
    final = only_reply(h)
    assert final["status"] == "ok" and final["text"] == "Hello"
    assert (final["queue_ms"], final["ttft_ms"], final["total_ms"]) == (0, 100, 300)
    h.assert_each_answered_once()


def test_timings_when_the_clock_reads_zero(h: BrokerHarness) -> None:
    # 0.0 is a valid monotonic reading (and the natural start of a fake clock).
    h.ready(W1, 0.0)
    h.send(generate("z"), 0.0)
    rid = one_request(h, W1)
    h.partial(W1, rid, "tok", 0.1)
    h.final(W1, rid, 0.3)
    final = only_reply(h)
    assert (final["queue_ms"], final["ttft_ms"], final["total_ms"]) == (0, 100, 300)
    h.assert_each_answered_once()


def test_worker_error_final_becomes_a_typed_error(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("e"), 0.0)
    rid = one_request(h, W1)
    h.final(W1, rid, 0.1, status="error", code=500, message="engine error: boom")
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["error"]) == ("error", 500, "INTERNAL")
    assert "boom" in reply["message"]
    assert h.credit(W1) == 1
    h.assert_each_answered_once()


@pytest.mark.parametrize("code", [418, "503", None, [503], {"c": 1}])
def test_worker_error_with_a_bad_code_becomes_500(h: BrokerHarness, code: Any) -> None:
    h.ready(W1, 0.0)
    h.send(generate("e"), 0.0)
    rid = one_request(h, W1)
    h.final(W1, rid, 0.1, status="error", code=code, message="odd")
    reply = only_reply(h)
    assert (reply["status"], reply["code"]) == ("error", 500)
    assert h.credit(W1) == 1
    h.assert_each_answered_once()


def test_ping_and_status(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=2)
    h.send({"id": "p", "op": "ping"}, 0.0)
    assert only_reply(h) == {"id": "p", "status": "ok", "pong": True, "version": p.PROTOCOL_VERSION}
    h.send({"id": "s", "op": "status"}, 0.5)
    node = only_reply(h)["node"]
    assert node["queue_bound"] == FAST.max_queue and node["credit"] == 2
    assert [w["worker_id"] for w in node["workers"]] == [W1.decode()]
    assert node["workers"][0]["last_seen_ms"] == 500
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- workers' protocol


@pytest.mark.parametrize(
    ("command", "body"),
    [
        (WorkerCommand.HEARTBEAT, {"progress": 1}),
        (WorkerCommand.PARTIAL, {"rid": 1, "text": "x"}),
        (WorkerCommand.FINAL, {"rid": 1, "status": "ok", "text": "x"}),
        (WorkerCommand.CREDIT, {"slots": 4}),
    ],
)
def test_unknown_worker_is_told_to_disconnect(
    h: BrokerHarness, command: WorkerCommand, body: dict[str, Any]
) -> None:
    h.worker_send(W1, command, body, 0.0)
    out = h.drain_workers()
    assert [(m.identity, m.command) for m in out] == [(W1, DISCONNECT)]
    assert list(h.broker.workers) == [] and h.broker.outbox.events == []
    h.send(generate("a"), 0.1)  # and it did not become a worker with credit
    assert h.drain_workers() == []
    h.broker.abort_all("test over", 0.0)
    h.assert_each_answered_once()


@pytest.mark.parametrize(
    "body",
    [
        {"engine": "llm", "slots": 1},
        {"worker_id": "w", "engine": "gpu", "slots": 1},
        {"worker_id": "w", "engine": "llm", "slots": 0},
        {"worker_id": "w", "engine": "llm", "slots": True},
    ],
    ids=["no-worker-id", "bad-engine", "zero-slots", "bool-slots"],
)
def test_invalid_ready_is_refused(h: BrokerHarness, body: dict[str, Any]) -> None:
    h.worker_send(W1, WorkerCommand.READY, body, 0.0)
    assert [m.command for m in h.drain_workers()] == [DISCONNECT]
    assert list(h.broker.workers) == []


@pytest.mark.parametrize(
    "frames",
    [
        [p.WORKER_TAG + b" HELLO", p.pack({})],
        [p.WORKER_TAG + b" FINAL", b"\xc1"],
        [p.CLIENT_TAG + b" FINAL", p.pack({})],
    ],
    ids=["unknown-command", "bad-body", "wrong-tag"],
)
def test_malformed_worker_message_gets_disconnect(h: BrokerHarness, frames: list[bytes]) -> None:
    h.ready(W1, 0.0)
    h.broker.handle_worker([W1, *frames], 0.1)
    assert [(m.identity, m.command) for m in h.drain_workers()] == [(W1, DISCONNECT)]


def test_worker_told_to_disconnect_gets_no_more_requests(h: BrokerHarness) -> None:
    # A worker that receives DISCONNECT drops its socket and re-registers under a
    # fresh identity (node/worker.py _reconnect), so the old identity is gone.
    h.ready(W1, 0.0)
    h.broker.handle_worker([W1, p.WORKER_TAG + b" HELLO", p.pack({})], 0.1)
    h.drain_workers()
    h.send(generate("a"), 0.2)
    assert bodies(h.drain_workers(), W1, REQUEST) == []
    assert h.broker.workers.get(W1) is None
    h.ready(b"worker-ident-1b", 0.3, worker_id=W1.decode())
    h.final(b"worker-ident-1b", one_request(h, b"worker-ident-1b"), 0.4)
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- malformed clients


def _frames(body: bytes) -> list[bytes]:
    return [CLIENT, b"", p.CLIENT_TAG, body]


MALFORMED: list[tuple[str, list[bytes], int, str | int | None, str]] = [
    # (case, frames, code, id in the reply, word the message must contain)
    ("three-frames", [CLIENT, b"", p.CLIENT_TAG], 400, None, "frame"),
    ("five-frames", [CLIENT, b"", p.CLIENT_TAG, p.pack(generate("x")), b"!"], 400, None, "frame"),
    ("no-delimiter", [CLIENT, b"?", p.CLIENT_TAG, p.pack(generate("x"))], 400, None, "delimiter"),
    ("wrong-tag", [CLIENT, b"", b"EDGE/C9", p.pack(generate("x"))], 400, None, "EDGE/C1"),
    ("not-msgpack", _frames(b"\xc1\xc1\xc1"), 400, None, "msgpack"),
    ("truncated", _frames(p.pack(generate("x"))[:-3]), 400, None, "msgpack"),
    ("not-a-map", _frames(p.pack([1, 2])), 400, None, "map"),  # type: ignore[arg-type]
    ("missing-id", _frames(p.pack({"op": "generate", "prompt": "x"})), 400, None, "'id'"),
    ("bool-id", _frames(p.pack(generate(True))), 400, None, "'id'"),
    ("unknown-op", _frames(p.pack({"id": "m1", "op": "eval"})), 400, "m1", "'op'"),
    ("unknown-field", _frames(p.pack(generate("m2", colour="red"))), 400, "m2", "'colour'"),
    ("no-prompt", _frames(p.pack({"id": "m3", "op": "generate"})), 400, "m3", "'prompt'"),
    ("max-tokens", _frames(p.pack(generate("m4", max_tokens=0))), 400, "m4", "'max_tokens'"),
    (
        "bad-messages",
        _frames(p.pack({"id": "m5", "op": "chat", "messages": [1]})),
        400,
        "m5",
        "messages[0]",
    ),
    (
        "mixed-key-types",
        _frames(p.pack({"id": "m6", "op": "ping", b"zz": 1, "yy": 2})),  # type: ignore[dict-item]
        400,
        "m6",
        "field",
    ),
    ("oversized", _frames(p.pack(generate("big", prompt="x" * 5000))), 413, "big", "limit"),
]


@pytest.mark.parametrize(
    ("frames", "code", "rid", "word"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_message_gets_one_error_and_the_broker_keeps_serving(
    h: BrokerHarness, frames: list[bytes], code: int, rid: str | int | None, word: str
) -> None:
    h.ready(W1, 0.0)
    h.send_frames(frames, 0.1, rid)
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["id"]) == ("error", code, rid)
    assert word in reply["message"], reply["message"]
    assert h.drain_workers() == [] and h.broker.pending_jobs() == 0
    h.send(generate("ok"), 0.2)
    rid_ok = one_request(h, W1)
    h.final(W1, rid_ok, 0.3)
    assert only_reply(h)["status"] == "ok"
    h.assert_each_answered_once()


def test_duplicate_in_flight_id_is_refused_per_client(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=2)
    h.send(generate("same"), 0.0)
    rid = one_request(h, W1)
    h.send(generate("same"), 0.1)
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["id"]) == ("error", 400, "same")
    assert "'same'" in reply["message"]
    assert h.drain_workers() == []
    h.send(generate("same"), 0.1, client=OTHER_CLIENT)  # ids are unique per client only
    rid_other = one_request(h, W1)
    h.final(W1, rid, 0.2)
    (done,) = h.drain_replies()
    assert done[0] == CLIENT and done[1]["status"] == "ok"
    h.final(W1, rid_other, 0.2)
    h.send(generate("same"), 0.3)  # answered, so the id is free again
    h.final(W1, one_request(h, W1), 0.4)
    h.assert_each_answered_once()


def test_full_queue_sheds_with_503_and_retry_after(h: BrokerHarness) -> None:
    for i in range(FAST.max_queue):
        h.send(generate(f"q{i}"), 0.0)
    assert h.replies() == []
    h.send(generate("over"), 0.1)
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["id"]) == ("error", 503, "over")
    assert RETRY_AFTER_MIN_MS <= reply["retry_after_ms"] <= RETRY_AFTER_MAX_MS
    assert h.broker.status(0.1)["queue_depth"] == FAST.max_queue
    h.ready(W1, 0.2, slots=FAST.max_queue)  # capacity arrives: the queue drains in order
    reqs = h.requests(W1)
    assert len(reqs) == FAST.max_queue
    for r in reqs:
        h.final(W1, r["rid"], 0.3)
    assert [r["id"] for r in h.replies()] == [f"q{i}" for i in range(FAST.max_queue)]
    h.assert_each_answered_once()


def test_draining_node_refuses_new_work_with_503(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.broker.draining = True
    h.send(generate("late"), 0.1)
    reply = only_reply(h)
    assert reply["code"] == 503 and reply["retry_after_ms"] > 0
    assert h.drain_workers() == []
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- deadlines


def test_queued_request_expires_with_504_and_is_never_dispatched(h: BrokerHarness) -> None:
    h.send(generate("slow", timeout_ms=500), 0.0)
    h.tick(0.499)
    assert h.replies() == []
    h.tick(0.5)
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["id"]) == ("error", 504, "slow")
    assert "text" not in reply
    h.ready(W1, 0.6)
    assert h.drain_workers() == []
    h.tick(0.7, keepalive=(W1,))
    assert h.drain_workers() == [] and h.replies() == []
    h.assert_each_answered_once()


def test_running_request_expires_at_once_and_credit_waits_for_the_ack(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("run", timeout_ms=500), 0.0)
    rid = one_request(h, W1)
    h.partial(W1, rid, "half an ans", 0.2)
    h.send(generate("next"), 0.3)
    h.tick(0.4, keepalive=(W1,))
    assert h.replies() == [] and h.drain_workers() == []
    h.tick(0.5, keepalive=(W1,))
    reply = only_reply(h)
    assert (reply["code"], reply["id"], reply["text"]) == (504, "run", "half an ans")
    out = h.drain_workers()
    assert [(m.identity, m.command, m.body) for m in out] == [(W1, CANCEL, {"rid": rid})]
    assert h.credit(W1) == 0  # not before the worker acks
    h.tick(0.6, keepalive=(W1,))
    assert h.drain_workers() == []
    h.final(W1, rid, 0.65, status="cancelled", code=499, message="cancelled", text="half an")
    assert h.replies() == []  # the ack produces no second reply
    rid_next = one_request(h, W1)  # ...but frees the credit for the queued one
    h.final(W1, rid_next, 0.7)
    assert only_reply(h)["id"] == "next"
    assert [e.kind for e in h.drain_events()] == ["ready"]  # nobody was lost
    h.assert_each_answered_once()


def test_no_ack_within_the_cancel_grace_loses_the_worker(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.drain_events()
    h.send(generate("run", timeout_ms=500), 0.0)
    rid = one_request(h, W1)
    h.tick(0.5, keepalive=(W1,))
    assert only_reply(h)["code"] == 504
    assert [m.command for m in h.drain_workers()] == [CANCEL]
    h.tick(0.6, keepalive=(W1,))
    h.tick(0.69, keepalive=(W1,))
    assert h.drain_events() == [] and h.drain_workers() == []
    h.tick(0.7, keepalive=(W1,))  # grace (200 ms) is over: the worker is hung
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id) == ("lost", "llm-0")
    assert "CANCEL" in event.cause.describe()
    assert [(m.identity, m.command) for m in h.drain_workers()] == [(W1, DISCONNECT)]
    assert h.broker.workers.get(W1) is None
    h.final(W1, rid, 0.8, status="cancelled")  # a late ack from the lost incarnation
    assert [m.command for m in h.drain_workers()] == [DISCONNECT]
    h.assert_each_answered_once()


def _one_of_two_slots_cancelled(h: BrokerHarness) -> tuple[int, int]:
    """A two-slot worker runs "short" and "long"; "short" reaches its deadline at
    0.5 s and is cancelled. Returns both rids."""
    h.ready(W1, 0.0, worker_id="llm-0", slots=2)
    h.drain_events()
    h.send(generate("short", timeout_ms=500), 0.0)
    h.send(generate("long", timeout_ms=600_000), 0.0)
    first, second = (body["rid"] for body in h.requests(W1))
    h.tick(0.5, keepalive=(W1,))
    assert only_reply(h)["code"] == 504
    assert [m.command for m in h.drain_workers()] == [CANCEL]
    return first, second


def test_a_late_ack_from_a_worker_still_producing_tokens_is_waited_for(h: BrokerHarness) -> None:
    """A two-slot worker acks a cancel after its step; starved by host load, that can
    outlast the grace while its other slot streams: that worker is not hung (the
    break-it session saw one killed twice, with all its slots)."""
    first, second = _one_of_two_slots_cancelled(h)
    now = 0.5
    while now < 1.5:  # the grace (200 ms) runs out four times; tokens keep coming
        now = round(now + 0.1, 1)
        h.partial(W1, second, "tok", now)
        h.tick(now, keepalive=(W1,))
    assert h.drain_events() == [] and h.broker.workers.get(W1) is not None
    h.final(W1, first, now, status="cancelled")  # the ack, late
    assert h.credit(W1) == 1
    h.final(W1, second, now)
    # Progress stops: the next grace that runs out is a hung verdict after all.
    h.send(generate("again", timeout_ms=100), now)
    (third,) = (body["rid"] for body in h.requests(W1))
    h.tick(now + 0.1, keepalive=(W1,))
    h.drain_workers()
    h.tick(now + 0.3, keepalive=(W1,))
    h.tick(now + 0.35, keepalive=(W1,))
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id) == ("lost", "llm-0") and "CANCEL" in event.cause.describe()
    assert third > second
    h.assert_each_answered_once()


def test_a_late_ack_is_waited_for_at_most_the_stall_timeout(h: BrokerHarness) -> None:
    stall = h.broker.settings.stall_timeout_ms / 1000
    _, second = _one_of_two_slots_cancelled(h)
    now = 0.5
    while not h.drain_events():  # its other slot streams; this one never acks
        now = round(now + 0.1, 1)
        assert now < 0.7 + stall + 0.5, "never given up on"
        h.partial(W1, second, "tok", now)
        h.tick(now, keepalive=(W1,))
    assert now >= 0.7 + stall  # the first grace, then up to the stall timeout more


# --------------------------------------------------------------------------- liveness


def test_the_brokers_own_pause_is_not_held_against_its_workers(h: BrokerHarness) -> None:
    """A broker SIGSTOPped for 5 s used to declare every healthy worker dead (and
    have it killed) on its first tick after SIGCONT; the workers had re-registered
    under new identities whose READYs it had not read yet (break-it session)."""
    h.ready(W1, 0.0, worker_id="llm-0")
    h.ready(W2, 0.0, worker_id="llm-1")
    h.drain_events()
    h.tick(0.1, keepalive=(W1, W2))
    h.tick(5.1)  # nothing ran for 5 s: no verdict
    assert h.drain_events() == []
    h.ready(b"llm-0-again", 5.15, worker_id="llm-0")  # the new incarnation's READY
    events = h.drain_events()
    assert [(e.kind, e.worker_id) for e in events] == [("ready", "llm-0")]  # not "lost"
    # One normal interval of the gap counts: W2 is silent from 5.0 on the broker's clock.
    for t in (5.2, 5.29):
        h.tick(t, keepalive=(b"llm-0-again",))
    assert h.drain_events() == []
    h.tick(5.31, keepalive=(b"llm-0-again",))
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id, event.cause.describe()) == (
        "lost",
        "llm-1",
        "dead: missed heartbeats",
    )
    assert h.broker.stats.counters["workers_lost"] == 2  # W1 replaced, W2 dead


def test_a_broker_pause_shorter_than_the_window_is_not_held_against_its_workers(
    h: BrokerHarness,
) -> None:
    """A pause of the broker's loop shorter than the liveness window (a vCPU stolen
    by the hypervisor, the broker starved on a core it shares with the worker) froze
    the worker too, and its silence before the pause plus the pause made it dead at
    the broker's first tick after, before the worker had run again: an isolation
    benchmark's reserved worker (broker and worker on one core) was declared dead
    while generating. Only the silence the broker saw itself counts."""
    h.ready(W1, 0.0, worker_id="llm-0")
    h.drain_events()
    for t in (0.05, 0.1, 0.15):  # W1 silent from 0.0: 0.15 s, half the window
        h.tick(t)
    h.tick(0.4)  # the broker ran nothing for 0.25 s (< the 0.3 s window)
    assert h.drain_events() == []
    # The pause beyond one normal interval (0.15 s) was forgiven, not the rest:
    # W1 is silent from 0.15 on the broker's clock.
    h.tick(0.44)
    assert h.drain_events() == []
    h.tick(0.46)
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id, event.cause.describe()) == (
        "lost",
        "llm-0",
        "dead: missed heartbeats",
    )


def test_silent_workers_are_dead_even_behind_a_live_one(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="alive")
    h.ready(W2, 0.0, worker_id="silent")
    h.drain_events()
    for t in (0.1, 0.2, 0.29):
        h.tick(t, keepalive=(W1,))
    assert h.drain_events() == []
    h.tick(0.31, keepalive=(W1,))
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id) == ("lost", "silent")
    assert event.cause.describe().startswith("dead")
    assert DISCONNECT in [m.command for m in h.drain_workers() if m.identity == W2]
    assert h.broker.workers.get(W2) is None and h.broker.workers.get(W1) is not None
    h.assert_each_answered_once()


def test_busy_worker_without_progress_is_stalled(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.drain_events()
    h.send(generate("a"), 0.0)
    one_request(h, W1)
    for i in range(1, 11):  # alive (heartbeats) but the counter does not move
        h.tick(i / 10, keepalive=(W1,))
    assert h.drain_events() == []
    h.tick(1.1, keepalive=(W1,))
    (event,) = h.drain_events()
    assert (event.kind, event.worker_id) == ("lost", "llm-0")
    assert event.cause.describe().startswith("stalled")
    assert DISCONNECT in [m.command for m in h.drain_workers()]
    # Nothing was streamed: the request waits for the restarted incarnation.
    h.ready(b"worker-ident-1b", 1.2, worker_id="llm-0")
    rid = one_request(h, b"worker-ident-1b")
    h.final(b"worker-ident-1b", rid, 1.3)
    assert only_reply(h)["status"] == "ok"
    h.assert_each_answered_once()


def test_idle_worker_is_never_stalled(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    for i in range(1, 31):
        h.tick(i / 10, keepalive=(W1,))
    assert [e.kind for e in h.drain_events()] == ["ready"]


def test_stall_clock_starts_when_work_starts(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.drain_events()
    for i in range(1, 21):  # idle (no progress) for two stall timeouts
        h.tick(i / 10, keepalive=(W1,))
    h.send(generate("a"), 2.0)
    rid = one_request(h, W1)
    h.tick(2.1, keepalive=(W1,))
    h.tick(3.0, keepalive=(W1,))
    assert h.drain_events() == []
    h.final(W1, rid, 3.05)
    h.assert_each_answered_once()


def test_worker_making_progress_is_not_stalled(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.drain_events()
    h.send(generate("long", stream=True), 0.0)
    rid = one_request(h, W1)
    partials = 0
    for i in range(1, 31):  # three seconds, three stall timeouts, tokens keep coming
        now = i / 10
        if i % 2:
            h.heartbeat(W1, now, advance=1)
        else:
            h.partial(W1, rid, "t", now)
            partials += len(h.replies())
        h.broker.tick(now)
    assert h.drain_events() == [] and partials == 15
    for i in range(31, 41):  # then the counter freezes at t=3.0
        h.tick(i / 10, keepalive=(W1,))
    assert h.drain_events() == []
    h.tick(4.05, keepalive=(W1,))
    (event,) = h.drain_events()
    assert event.cause.describe().startswith("stalled")
    reply = only_reply(h)  # it had streamed: no re-dispatch, a typed error with the text
    assert (reply["code"], reply["reason"]) == (503, "worker_lost")
    assert reply["text"] == "t" * 15
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- lost workers


def test_lost_workers_request_is_redispatched_once(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("a", prompt="same prompt"), 0.0)
    rid = one_request(h, W1)
    h.ready(W2, 0.05)
    h.drain_events()
    for t in (0.1, 0.2, 0.3):
        h.tick(t, keepalive=(W2,))
    h.tick(0.35, keepalive=(W2,))  # W1 silent since 0.0: dead
    assert [e.worker_id for e in h.drain_events()] == [W1.decode()]
    out = h.drain_workers()
    (again,) = bodies(out, W2, REQUEST)
    assert again["rid"] == rid and again["prompt"] == "same prompt"
    assert 9600 <= again["timeout_ms"] <= 9650  # what is left of the 10 s budget
    assert h.replies() == []
    for t in (0.4, 0.5, 0.6):  # now W2 goes silent too: no second chance
        h.tick(t)
    h.tick(0.7)
    assert [e.worker_id for e in h.drain_events()] == [W2.decode()]
    reply = only_reply(h)
    assert (reply["status"], reply["code"], reply["reason"]) == ("error", 503, "worker_lost")
    assert reply["retry_after_ms"] > 0
    h.assert_each_answered_once()


def test_lost_worker_after_streaming_answers_503_with_the_partial_text(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0)
    h.ready(W2, 0.0)
    h.send(generate("s", stream=True), 0.0)
    out = h.drain_workers()
    (req,) = bodies(out, W1, REQUEST) or bodies(out, W2, REQUEST)
    busy, idle = (W1, W2) if bodies(out, W1, REQUEST) else (W2, W1)
    h.partial(busy, req["rid"], "Once upon", 0.1)
    h.worker_send(busy, DISCONNECT, {}, 0.2)
    replies = h.replies()
    assert [r["status"] for r in replies] == ["partial", "error"]
    assert (replies[1]["code"], replies[1]["reason"], replies[1]["text"]) == (
        503,
        "worker_lost",
        "Once upon",
    )
    assert bodies(h.drain_workers(), idle, REQUEST) == []  # not re-run on the idle worker
    h.assert_each_answered_once()


def test_unstreamed_output_of_a_lost_worker_is_discarded_and_made_again(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0)
    h.ready(W2, 0.0)
    h.send(generate("u"), 0.0)  # not streamed: the client has seen nothing yet
    out = h.drain_workers()
    busy, idle = (W1, W2) if bodies(out, W1, REQUEST) else (W2, W1)
    (req,) = bodies(out, busy, REQUEST)
    h.partial(busy, req["rid"], "half an ans", 0.1)
    h.worker_send(busy, DISCONNECT, {}, 0.2)
    assert h.replies() == []
    (again,) = bodies(h.drain_workers(), idle, REQUEST)
    assert again["rid"] == req["rid"]
    h.partial(idle, again["rid"], "whole", 0.3)
    h.final(idle, again["rid"], 0.4, text="whole answer")
    reply = only_reply(h)
    assert (reply["status"], reply["text"]) == ("ok", "whole answer")
    assert reply["ttft_ms"] == 300  # the first token of the run that counted
    # An operator sees the re-run in status's counters (a new user saw it nowhere).
    assert h.broker.stats.counters["requeued"] == 1
    assert "worker_lost" not in h.broker.stats.counters
    h.assert_each_answered_once()


def test_lost_worker_after_the_deadline_is_not_redispatched(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.ready(W2, 0.0, worker_id="llm-1")
    h.send(generate("d", timeout_ms=200), 0.0)
    out = h.drain_workers()
    busy = W1 if bodies(out, W1, REQUEST) else W2
    idle = W2 if busy == W1 else W1
    busy_id = "llm-0" if busy == W1 else "llm-1"
    h.broker.worker_exited(busy_id, ExitCause(signal="SIGKILL"), 0.25)  # reaped; no tick in between
    reply = only_reply(h)
    assert (reply["code"], reply["reason"]) == (503, "worker_lost")
    assert bodies(h.drain_workers(), idle, REQUEST) == []
    h.broker.tick(0.3)
    assert h.replies() == []
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- client cancel


def test_cancel_of_a_queued_request(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("a"), 0.0)
    rid_a = one_request(h, W1)
    h.send(generate("b"), 0.1)
    h.send({"id": "c1", "op": "cancel", "target": "b"}, 0.2)
    cancelled, ok = h.replies()
    assert (cancelled["id"], cancelled["status"], cancelled["code"]) == ("b", "error", 499)
    assert ok == {"id": "c1", "status": "ok", "cancelled": "b"}
    h.final(W1, rid_a, 0.3)
    assert h.drain_workers() == []  # b is gone from the queue
    h.assert_each_answered_once()


def test_cancel_of_a_running_request(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("a", stream=True), 0.0)
    rid = one_request(h, W1)
    h.partial(W1, rid, "par", 0.05)
    h.replies()
    h.send({"id": "c1", "op": "cancel", "target": "a"}, 0.1)
    cancelled, ok = h.replies()
    assert (cancelled["id"], cancelled["code"], cancelled["text"]) == ("a", 499, "par")
    assert ok["status"] == "ok" and ok["id"] == "c1"
    assert [(m.command, m.body) for m in h.drain_workers()] == [(CANCEL, {"rid": rid})]
    assert h.credit(W1) == 0
    h.send({"id": "c2", "op": "cancel", "target": "a"}, 0.12)  # already answered
    assert only_reply(h)["code"] == 404
    h.final(W1, rid, 0.15, status="cancelled", code=499)
    assert h.replies() == [] and h.credit(W1) == 1
    h.assert_each_answered_once()


def test_cancel_of_an_unknown_request_is_404(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("mine"), 0.0)
    rid = one_request(h, W1)
    h.send({"id": "c1", "op": "cancel", "target": "nope"}, 0.1)
    reply = only_reply(h)
    assert (reply["id"], reply["code"], reply["error"]) == ("c1", 404, "NOT_FOUND")
    assert "'nope'" in reply["message"]
    h.send({"id": "c2", "op": "cancel", "target": "mine"}, 0.1, client=OTHER_CLIENT)
    assert only_reply(h)["code"] == 404  # another client cannot cancel it
    assert h.drain_workers() == []
    h.final(W1, rid, 0.2)
    h.assert_each_answered_once()


# --------------------------------------------------------------------------- shutdown


def test_abort_all_answers_every_pending_request_once(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, slots=2)
    h.send(generate("expiring", timeout_ms=100), 0.0)
    h.send(generate("running"), 0.0)
    h.send(generate("queued"), 0.0)
    h.drain_workers()
    h.tick(0.1, keepalive=(W1,))  # "expiring" is answered 504 and waits for its ack
    assert only_reply(h)["id"] == "expiring"
    h.broker.abort_all("node is stopping", 1.0)
    replies = {r["id"]: r for r in h.replies()}
    assert set(replies) == {"running", "queued"}
    for reply in replies.values():
        assert (reply["code"], reply["reason"]) == (503, "shutdown")
        assert reply["message"] == "node is stopping"
    assert h.broker.pending_jobs() == 0
    h.assert_each_answered_once()


def test_a_stop_answers_queued_requests_503_draining_at_once_and_lets_running_ones_finish(
    h: BrokerHarness,
) -> None:
    # Queued requests used to wait the whole stop grace (5 s) and then get
    # 503 shutdown although no worker would ever start them in time.
    h.ready(W1, 0.0, slots=1)
    h.send(generate("running"), 0.1)
    (running,) = h.requests(W1)
    for n in range(3):
        h.send(generate(f"queued-{n}"), 0.2)
    assert h.replies() == []
    h.broker.drain(0.3)
    replies = {r["id"]: r for r in h.replies()}
    assert sorted(replies) == ["queued-0", "queued-1", "queued-2"]
    for reply in replies.values():
        assert (reply["code"], reply["reason"]) == (503, "draining"), reply
        assert reply["retry_after_ms"] > 0
    assert h.broker.pending_jobs() == 1
    h.final(W1, running["rid"], 0.4)
    assert [r["id"] for r in h.replies()] == ["running"]
    assert h.broker.pending_jobs() == 0
    assert h.drain_workers() == []  # nothing queued was dispatched
    h.assert_each_answered_once()


def test_a_request_whose_worker_is_lost_during_a_stop_is_answered_at_once(
    h: BrokerHarness,
) -> None:
    # It was queued to run again, but a stopping node starts no worker: it waited
    # out the whole stop grace for 503 shutdown (break-it pass, session 19).
    h.ready(W1, 0.0)
    h.send(generate("r"), 0.1)
    assert len(h.requests(W1)) == 1
    h.broker.drain(0.2)
    h.broker.worker_exited(W1.decode(), ExitCause(signal="SIGKILL"), 0.3)
    reply = only_reply(h)
    assert (reply["id"], reply["code"], reply["reason"]) == ("r", 503, "worker_lost"), reply
    assert h.broker.pending_jobs() == 0
    h.assert_each_answered_once()
