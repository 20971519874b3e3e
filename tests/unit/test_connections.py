"""``broker.connections.Connections``: routing ids by connection, from the
frontend monitor's ACCEPTED/DISCONNECTED events, with descriptors reused at once.

The loop's order is: messages (``seen``), then the events that arrived meanwhile,
then ``settle``, which names the ids that are gone.
"""

from __future__ import annotations

from broker.connections import Connections

A = b"\x00k\x8bEg"
B = b"\x00k\x8bEh"
C = b"\x00k\x8bEi"


def test_a_closed_connection_makes_the_ids_that_came_on_it_gone() -> None:
    c = Connections()
    c.seen(A, 15)
    c.accepted(15)
    c.accepted(16)
    c.seen(B, 16)
    assert c.settle() == []
    assert len(c) == 2
    c.disconnected(15)
    assert c.settle() == [A]
    c.disconnected(15)
    assert c.settle() == []  # once
    c.disconnected(16)
    assert c.settle() == [B]
    assert len(c) == 0


def test_an_id_on_a_reused_descriptor_is_not_taken_for_the_old_one() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    assert c.settle() == []
    # A closes and B connects on the same descriptor; B's message is read before
    # either event (it was queued after both).
    c.seen(B, 15)
    c.disconnected(15)
    c.accepted(15)
    assert c.settle() == [A]
    c.disconnected(15)
    assert c.settle() == [B]


def test_an_id_whose_connection_closed_before_it_was_bound_is_gone() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)  # it sent, then closed, all within one turn
    c.disconnected(15)
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
    c.disconnected(15)
    assert c.settle() == [A]


def test_a_client_reconnecting_under_its_own_routing_id_is_not_gone() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    c.settle()
    # Its old connection closes and a new one (same routing id) sends at once:
    # on another descriptor ...
    c.seen(A, 16)
    c.disconnected(15)
    c.accepted(16)
    assert c.settle() == []
    # ... or on the same number, reused.
    c.seen(A, 16)
    c.disconnected(16)
    c.accepted(16)
    assert c.settle() == []
    c.disconnected(16)
    assert c.settle() == [A]


def test_a_descriptor_whose_accept_was_not_seen_counts_as_open() -> None:
    # A connection made before the monitor watched (or an event lost): never a
    # live client taken for gone, and its close is still noticed.
    c = Connections()
    c.seen(A, 20)
    assert c.settle() == []
    c.disconnected(20)
    assert c.settle() == [A]
    c.accepted(20)
    c.seen(B, 20)
    assert c.settle() == []
    c.disconnected(20)
    assert c.settle() == [B]


def test_forget_stops_tracking_an_id_found_gone_otherwise() -> None:
    c = Connections()
    c.accepted(15)
    c.seen(A, 15)
    c.seen(C, 15)  # two ids on one descriptor (not DEALER's way, but possible)
    c.settle()
    c.forget(A)
    c.forget(A)
    c.disconnected(15)
    assert c.settle() == [C]
    assert len(c) == 0
