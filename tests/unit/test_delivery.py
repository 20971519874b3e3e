"""``broker.delivery.Delivery`` with a fake clock: what waits, what is dropped,
when a client is gone, and the counters that tell them apart."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from broker import protocol as p
from broker.delivery import Delivery, Fate, GoneCause, Offer, Outgoing, ReplyKind

A = b"client-a"
B = b"client-b"


def final(rid: str, client: bytes = A) -> Outgoing:
    return Outgoing(client, p.ok_reply(rid, text="done"), ReplyKind.FINAL)


def partial(rid: str, index: int, client: bytes = A) -> Outgoing:
    return Outgoing(client, p.partial_reply(rid, f"t{index}", index), ReplyKind.PARTIAL)


def sent_body(d: Delivery, out: Outgoing) -> dict[str, Any]:
    """The body as it goes on the wire."""
    return p.unpack_map(d.frames(out)[3])


def make(max_backlog: int = 3) -> tuple[Delivery, Counter[str]]:
    counters: Counter[str] = Counter()
    return Delivery(max_backlog, counters, retry_s=0.02), counters


def test_replies_that_go_out_are_counted_delivered() -> None:
    d, n = make()
    for out in (partial("r", 0), final("r")):
        assert d.offer(out) is Offer.SEND
        assert d.settle(out, Fate.SENT) is None
    assert n == {"partials_delivered": 1, "finals_delivered": 1}
    assert not d.has_backlog()


def test_a_final_that_finds_the_pipe_full_waits_and_goes_out_in_order() -> None:
    d, n = make()
    first, second = final("r1"), final("r2")
    assert d.offer(first) is Offer.SEND
    assert d.settle(first, Fate.FULL) is None
    # A later final waits behind it, without being tried.
    assert d.offer(second) is Offer.HELD
    assert d.clients() == [A]
    assert d.snapshot()["backlog"] == 2
    assert n["finals_backlogged"] == 2

    assert d.head(A) is first
    assert d.settle(first, Fate.FULL) is None  # still full: it stays first
    assert d.head(A) is first
    assert d.settle(first, Fate.SENT) is None
    assert d.head(A) is second
    assert d.settle(second, Fate.SENT) is None
    assert d.head(A) is None and not d.has_backlog()
    assert n["finals_delivered"] == 2 and "finals_undeliverable" not in n


def test_a_partial_that_cannot_go_is_dropped_and_the_next_reply_says_so() -> None:
    d, n = make()
    p0, p1, p2 = partial("r", 0), partial("r", 1), partial("r", 2)
    for out in (p0, p1):
        assert d.offer(out) is Offer.SEND
        assert d.settle(out, Fate.FULL) is None  # never queued
    assert not d.has_backlog()
    assert n["partials_dropped"] == 2
    assert d.offer(p2) is Offer.SEND
    assert sent_body(d, p2)["dropped_partials"] == 2
    d.settle(p2, Fate.SENT)
    last = final("r")
    assert d.offer(last) is Offer.SEND
    assert sent_body(d, last)["dropped_partials"] == 2  # the total, on the final too
    d.settle(last, Fate.SENT)
    # The request is over: the same id reused starts from nothing.
    again = final("r")
    assert "dropped_partials" not in sent_body(d, again)


def test_the_marker_is_per_request_and_absent_when_nothing_was_dropped() -> None:
    d, _ = make()
    lost = partial("r1", 0)
    d.offer(lost)
    d.settle(lost, Fate.FULL)
    other, theirs = partial("r2", 0), partial("r1", 0, client=B)
    assert "dropped_partials" not in sent_body(d, other)
    assert "dropped_partials" not in sent_body(d, theirs)


def test_partials_for_a_client_with_a_backlog_are_dropped_not_queued() -> None:
    d, n = make()
    waiting = final("r1")
    d.offer(waiting)
    d.settle(waiting, Fate.FULL)
    chunk = partial("r2", 5)
    assert d.offer(chunk) is Offer.HELD
    assert n["partials_dropped"] == 1
    assert d.snapshot()["backlog"] == 1
    # Another client is not held back by A's backlog.
    assert d.offer(final("x", client=B)) is Offer.SEND


def test_a_backlog_over_its_bound_makes_the_client_gone() -> None:
    d, n = make(max_backlog=2)
    first = final("r0")
    d.offer(first)
    assert d.settle(first, Fate.FULL) is None
    assert d.offer(final("r1")) is Offer.HELD
    assert d.offer(final("r2")) is Offer.OVERFLOW
    assert d.forget(A) == 3
    assert n["backlog_overflows"] == 1
    assert n["finals_undeliverable"] == 3
    assert not d.has_backlog()


def test_a_final_that_overflows_on_its_first_try_makes_the_client_gone() -> None:
    d, _ = make(max_backlog=1)
    first, second = final("r0"), final("r1")
    d.offer(first)
    d.settle(first, Fate.FULL)
    d.settle(first, Fate.SENT)  # drained
    d.offer(second)
    assert d.settle(second, Fate.FULL) is None  # one waiting: within the bound
    third = final("r2")
    assert d.offer(third) is Offer.OVERFLOW


def test_an_unreachable_client_is_gone_and_its_finals_are_undeliverable() -> None:
    d, n = make()
    waiting, fresh = final("r1"), final("r2", client=B)
    d.offer(waiting)
    d.settle(waiting, Fate.FULL)
    assert d.settle(waiting, Fate.GONE) is GoneCause.UNREACHABLE
    assert d.forget(A) == 1  # the backlog's final, counted once
    assert d.offer(fresh) is Offer.SEND
    assert d.settle(fresh, Fate.GONE) is GoneCause.UNREACHABLE
    chunk = partial("r3", 0, client=B)
    assert d.settle(chunk, Fate.GONE) is GoneCause.UNREACHABLE
    assert d.forget(B) == 0
    assert n["finals_undeliverable"] == 2
    assert n["partials_dropped"] == 1
    assert "backlog_overflows" not in n


def test_forgetting_a_client_clears_its_dropped_counts() -> None:
    d, _ = make()
    lost = partial("r", 0)
    d.offer(lost)
    d.settle(lost, Fate.FULL)
    d.forget(A)
    assert "dropped_partials" not in sent_body(d, final("r"))


def test_backlog_rounds_follow_the_clock_and_pollout_only_while_it_helps() -> None:
    d, _ = make()
    assert d.next_retry(0.0) is None and not d.due(0.0) and not d.wants_pollout()
    waiting = final("r")
    d.offer(waiting)
    d.settle(waiting, Fate.FULL)
    assert d.due(0.0) and d.wants_pollout() and d.next_retry(0.0) == 0.0

    # Woken by POLLOUT, nothing sent: the room was another peer's.
    d.round_done(0, 1.0, woken_by_pollout=True)
    assert not d.wants_pollout()
    assert not d.due(1.01)
    assert d.next_retry(1.01) == pytest.approx(0.01)
    assert d.due(1.02)

    # A timed round that sends something makes POLLOUT worth listening to again.
    d.round_done(1, 1.02, woken_by_pollout=False)
    assert d.wants_pollout()
    # A timed round that sends nothing leaves it as it was.
    d.round_done(0, 1.04, woken_by_pollout=False)
    assert d.wants_pollout()
    assert not d.due(1.05) and d.due(1.06)


def test_an_answer_its_client_never_gets_counts_client_gone_not_ok() -> None:
    d, n = make(max_backlog=1)
    n["ok"] += 3  # as the broker counts answers when it makes them
    lost, waiting, over = (Outgoing(A, p.ok_reply(r), ReplyKind.FINAL, "ok") for r in "xyz")
    assert d.offer(lost) is Offer.SEND
    assert d.settle(lost, Fate.GONE) is GoneCause.UNREACHABLE
    assert n["ok"] == 2 and n["client_gone"] == 1 and n["finals_undeliverable"] == 1
    assert d.offer(waiting) is Offer.SEND
    assert d.settle(waiting, Fate.FULL) is None
    assert d.offer(over) is Offer.OVERFLOW
    assert d.forget(A) == 2
    assert n["ok"] == 0 and n["client_gone"] == 3 and n["finals_undeliverable"] == 3
    # A final never counted as an outcome (a cancel's ack, a status reply) moves nothing.
    assert d.offer(final("ack", B)) is Offer.SEND
    d.settle(final("ack", B), Fate.GONE)
    assert n["client_gone"] == 3 and n["finals_undeliverable"] == 4
