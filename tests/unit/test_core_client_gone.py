"""``Broker.client_gone``: a gone client's requests end without a reply, counted
``client_gone`` (never ``ok``); running ones are cancelled and their worker takes
the next request as soon as it acks. Fake clock, no sockets."""

from __future__ import annotations

from broker.delivery import Fate, GoneCause, Outgoing
from broker.protocol import WorkerCommand
from brokerkit import CLIENT, OTHER_CLIENT, RULES, W1, BrokerHarness, generate

REQUEST = WorkerCommand.REQUEST
CANCEL = WorkerCommand.CANCEL


def gone(h: BrokerHarness, client: bytes, now: float) -> int:
    """The client leaves: nothing more is expected for it."""
    for key in [k for k in h.expected if k[0] == client]:
        h.expected[key] = h.finals[key]
    return h.broker.client_gone(client, GoneCause.DISCONNECTED, now)


def test_a_running_request_is_cancelled_and_its_worker_serves_the_next(
    h: BrokerHarness,
) -> None:
    h.ready(W1, 0.0)
    h.send(generate("a", stream=True), 0.0)
    (req,) = h.requests(W1)
    h.send(generate("b"), 0.1, client=OTHER_CLIENT)
    h.partial(W1, req["rid"], "par", 0.2)
    h.replies()

    assert gone(h, CLIENT, 0.3) == 1
    assert [(m.command, m.body) for m in h.drain_workers()] == [(CANCEL, {"rid": req["rid"]})]
    assert h.replies() == []  # nobody to answer
    h.partial(W1, req["rid"], "late", 0.31)  # a token in flight before the CANCEL
    assert h.replies() == []
    h.final(W1, req["rid"], 0.32, status="error", code=499)  # the ack
    (nxt,) = h.requests(W1)  # the other client's request, at once
    h.final(W1, nxt["rid"], 0.4)
    counters = h.broker.status(0.5)["counters"]
    assert counters["client_gone"] == 1
    assert counters["ok"] == 1  # only b's
    h.assert_each_answered_once()


def test_queued_requests_leave_the_queue_and_others_stay(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send(generate("run"), 0.0, client=OTHER_CLIENT)
    (running,) = h.requests(W1)
    h.send(generate("q1"), 0.1)
    h.send(generate("q2"), 0.1)
    h.send(generate("q3"), 0.1, client=OTHER_CLIENT)
    assert h.broker.status(0.1)["queue_depth"] == 3
    assert gone(h, CLIENT, 0.2) == 2
    assert h.broker.status(0.2)["queue_depth"] == 1
    assert h.drain_workers() == []  # nothing ran: nothing to cancel
    h.final(W1, running["rid"], 0.3)
    (nxt,) = h.requests(W1)
    h.final(W1, nxt["rid"], 0.4)
    assert h.broker.status(0.5)["counters"]["client_gone"] == 2
    h.assert_each_answered_once()
    # Its in-flight cap and ids are free again (a reconnecting client may reuse them).
    h.send(generate("q1"), 0.6)
    (again,) = h.requests(W1)
    h.final(W1, again["rid"], 0.7)
    h.assert_each_answered_once()


def test_a_client_with_nothing_in_flight_changes_nothing(h: BrokerHarness) -> None:
    h.ready(W1, 0.0)
    h.send({"id": 1, "op": "ping"}, 0.0)
    h.replies()
    assert gone(h, CLIENT, 0.1) == 0
    assert "client_gone" not in h.broker.status(0.1)["counters"]
    h.assert_each_answered_once()


def test_its_waiting_final_replies_are_counted_undeliverable(h: BrokerHarness) -> None:
    d = h.broker.delivery
    waiting = Outgoing(CLIENT, {"id": "x", "status": "ok"})
    d.offer(waiting)
    d.settle(waiting, Fate.FULL)
    assert h.broker.status(0.0)["delivery"]["backlog"] == 1
    h.broker.client_gone(CLIENT, GoneCause.BACKLOG_OVERFLOW, 0.1)
    status = h.broker.status(0.1)
    assert status["delivery"]["backlog"] == 0
    assert status["counters"]["finals_undeliverable"] == 1


def test_a_request_the_rules_took_over_ends_too(h: BrokerHarness) -> None:
    # Degrade mode (the default): with no model worker, the rules answer.
    h.ready(RULES, 0.0, engine="rules", worker_id="rules-0")
    h.send(generate("a"), 0.0)
    (req,) = h.requests(RULES)
    assert gone(h, CLIENT, 0.1) == 1
    assert [(m.command, m.body) for m in h.drain_workers()] == [(CANCEL, {"rid": req["rid"]})]
    h.final(RULES, req["rid"], 0.2, text="rules", confidence=0.9, rule="r")
    assert h.replies() == []
    assert h.credit(RULES) == 1
    h.assert_each_answered_once()
