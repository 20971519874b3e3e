"""``broker.connections.Connections``: routing ids by connection, from the
frontend monitor's ACCEPTED/DISCONNECTED events, with descriptors reused at once.

The loop's order is: messages (``seen``), then the events that arrived meanwhile,
then ``settle``.
"""

from __future__ import annotations

from broker.connections import Connections

A = b"\x00k\x8bEg"
B = b"\x00k\x8bEh"
C = b"\x00k\x8bEi"


def test_a_closed_connection_names_the_ids_that_came_on_it() -> None:
    c = Connections()
    c.seen(A, 15)
    c.accepted(15)
    c.accepted(16)
    c.seen(B, 16)
    assert c.settle() == []
    assert len(c) == 2
    assert c.disconnected(15) == [A]
    assert c.disconnected(15) == []  # once
    assert c.disconnected(16) == [B]
    assert len(c) == 0


def test_an_id_on_a_reused_descriptor_is_not_taken_for_the_old_one() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    assert c.settle() == []
    # A closes and B connects on the same descriptor; B's message is read before
    # either event (it was queued after both).
    c.seen(B, 15)
    assert c.disconnected(15) == [A]
    c.accepted(15)
    assert c.settle() == []
    assert c.disconnected(15) == [B]


def test_an_id_whose_connection_closed_before_it_was_bound_is_gone() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)  # it sent, then closed, all within one turn
    assert c.disconnected(15) == []
    assert c.settle() == [A]
    assert len(c) == 0


def test_repeated_messages_keep_the_binding() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    c.settle()
    c.seen(A, 15)
    assert c.settle() == []
    c.accepted(16)  # a neighbour's traffic changes nothing
    c.seen(B, 16)
    c.settle()
    assert c.disconnected(15) == [A]


def test_a_descriptor_whose_accept_was_not_seen_counts_as_open() -> None:
    # A connection made before the monitor watched (or an event lost): never a
    # live client taken for gone, and its close is still noticed.
    c = Connections()
    c.seen(A, 20)
    assert c.settle() == []
    assert c.disconnected(20) == [A]
    c.accepted(20)
    c.seen(B, 20)
    assert c.settle() == []
    assert c.disconnected(20) == [B]


def test_forget_stops_tracking_an_id_found_gone_otherwise() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    c.seen(C, 15)  # two ids on one descriptor (not DEALER's way, but possible)
    c.settle()
    c.forget(A)
    c.forget(A)
    assert c.disconnected(15) == [C]
    assert len(c) == 0
