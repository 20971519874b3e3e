"""Safe retry in the broker core (PROTOCOL §3.5), on a fake clock: a resend with
``retry: true`` is attached to its running request or answered from the kept
final, and never reaches a worker a second time."""

from __future__ import annotations

from dataclasses import replace

from broker import protocol as p
from broker.delivery import GoneCause
from broker.protocol import WorkerCommand
from brokerkit import CLIENT, FAST, OTHER_CLIENT, W1, BrokerHarness, generate


def worker_requests(h: BrokerHarness) -> list[int]:
    return [m.body["rid"] for m in h.drain_workers() if m.command is WorkerCommand.REQUEST]


def resend(h: BrokerHarness, body: dict[str, object], now: float, client: bytes = CLIENT) -> None:
    """A resend that expects no final of its own (it is attached)."""
    h.broker.handle_client(p.client_frames(client, body), now)


def test_a_retry_of_a_running_request_is_attached_not_run_again() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0, slots=2)
    h.send(generate("r", stream=True), 0.0)
    (rid,) = worker_requests(h)
    h.partial(W1, rid, "one", 0.1)
    resend(h, generate("r", stream=True, retry=True), 0.2)
    assert worker_requests(h) == []
    h.partial(W1, rid, " two", 0.3)
    h.final(W1, rid, 0.4, text="one two")
    replies = h.replies()
    assert [(r["status"], r.get("text")) for r in replies] == [
        ("partial", "one"),
        ("partial", " two"),
        ("ok", "one two"),
    ]
    assert h.broker.stats.counters["retry_attached"] == 1
    h.assert_each_answered_once()


def test_a_retry_of_an_answered_request_gets_its_final_again() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.send(generate("r", max_tokens=4), 0.0)
    (rid,) = worker_requests(h)
    h.final(W1, rid, 0.1, text="the answer")
    (first,) = h.replies()
    h.send(generate("r", max_tokens=4, retry=True), 5.0)
    (again,) = h.replies()
    assert worker_requests(h) == []
    assert again == {**first, "replayed": True}
    assert h.broker.stats.counters["retry_replayed"] == 1
    h.assert_each_answered_once()


def test_a_retry_after_the_ttl_runs_as_a_new_request() -> None:
    h = BrokerHarness(replace(FAST, retry_ttl_ms=1000))
    h.ready(W1, 0.0)
    h.send(generate("r"), 0.0)
    h.final(W1, worker_requests(h)[0], 0.1)
    h.send(generate("r", retry=True), 1.2)  # kept until 1.1 only
    (rid,) = worker_requests(h)
    h.final(W1, rid, 1.3)
    assert "replayed" not in h.replies()[-1]
    h.assert_each_answered_once()


def test_without_retry_an_answered_id_is_free_for_a_new_request() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.send(generate("r"), 0.0)
    h.final(W1, worker_requests(h)[0], 0.1)
    h.send(generate("r"), 0.2)  # PROTOCOL §3.3: the id is free once answered
    assert len(worker_requests(h)) == 1
    assert h.broker.pending_jobs() == 1


def test_a_retry_asking_for_something_else_is_refused_with_duplicate_id() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.send(generate("r", prompt="first"), 0.0)
    (rid,) = worker_requests(h)
    h.send(generate("r", prompt="second", retry=True), 0.1)  # while it runs
    (running,) = h.replies()
    assert (running["code"], running["reason"]) == (400, "duplicate_id")
    h.final(W1, rid, 0.2)
    h.replies()
    h.send(generate("r", prompt="second", retry=True), 0.3)  # once it is answered
    (answered,) = h.replies()
    assert (answered["code"], answered["reason"]) == (400, "duplicate_id")
    assert "different request" in answered["message"]
    assert worker_requests(h) == []
    h.assert_each_answered_once()


def test_retries_are_per_connection() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.send(generate("r"), 0.0)
    h.final(W1, worker_requests(h)[0], 0.1)
    h.send(generate("r", retry=True), 0.2, client=OTHER_CLIENT)
    assert len(worker_requests(h)) == 1  # another connection's "r" is its own request
    assert all("replayed" not in r for r in h.replies())


def test_a_gone_client_s_kept_replies_are_dropped() -> None:
    h = BrokerHarness()
    h.ready(W1, 0.0)
    h.send(generate("r"), 0.0)
    h.final(W1, worker_requests(h)[0], 0.1)
    assert len(h.broker.reply_cache) == 1
    h.broker.client_gone(CLIENT, GoneCause.DISCONNECTED, 0.2)
    assert len(h.broker.reply_cache) == 0


def test_a_refused_request_is_not_kept_so_its_retry_is_admitted_again() -> None:
    h = BrokerHarness(replace(FAST, max_in_flight_per_client=1))
    h.ready(W1, 0.0)
    h.send(generate("a"), 0.0)
    (rid,) = worker_requests(h)
    h.send(generate("b"), 0.1)
    (refused,) = h.replies()
    assert refused["code"] == 429
    h.final(W1, rid, 0.2)
    h.send(generate("b", retry=True), 0.3)
    assert len(worker_requests(h)) == 1  # the 429 was no answer to replay: it runs now


def test_a_client_cycling_through_ids_stays_within_the_cache_bounds() -> None:
    h = BrokerHarness(replace(FAST, retry_cache_entries=8, retry_cache_bytes=4096))
    h.ready(W1, 0.0)
    for i in range(100):
        h.send(generate(i), i * 0.01)
        h.final(W1, worker_requests(h)[0], i * 0.01, text="z" * (i % 7) * 50)
        cache = h.broker.reply_cache
        assert len(cache) <= 8 and cache.bytes <= 4096
    assert h.broker.status(2.0)["retry_cache"]["evicted"] >= 92
    h.assert_each_answered_once()


def test_retry_must_be_a_msgpack_bool() -> None:
    h = BrokerHarness()
    h.send(generate("r", retry=1), 0.0)
    (reply,) = h.replies()
    assert (reply["code"], reply["id"]) == (400, "r") and "retry" in reply["message"]
    h.assert_each_answered_once()
