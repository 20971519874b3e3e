"""DeadlineHeap: lazy deletion, rescheduling, expiry order, compaction."""

from __future__ import annotations

from broker.deadlines import DeadlineHeap


def heap_of(**deadlines: float) -> DeadlineHeap:
    heap = DeadlineHeap()
    for key, deadline in deadlines.items():
        heap.set(key, deadline)
    return heap


def test_empty_heap() -> None:
    heap = DeadlineHeap()
    assert len(heap) == 0
    assert heap.next_deadline() is None
    assert heap.pop_expired(1e9) == []


def test_pop_expired_returns_due_keys_earliest_first_and_removes_them() -> None:
    heap = heap_of(c=3.0, a=1.0, d=4.0, b=2.0)
    assert heap.pop_expired(0.5) == []
    assert heap.pop_expired(2.5) == ["a", "b"]
    assert len(heap) == 2
    assert heap.pop_expired(2.5) == []  # popped keys do not come back
    assert heap.next_deadline() == 3.0


def test_a_deadline_equal_to_now_has_expired() -> None:
    heap = heap_of(a=1.0)
    assert heap.pop_expired(0.999) == []
    assert heap.pop_expired(1.0) == ["a"]


def test_equal_deadlines_expire_in_insertion_order_with_uncomparable_keys() -> None:
    heap = DeadlineHeap()
    keys = [("job", 2), ("ack", 1), frozenset({3}), ("job", 1)]
    for key in keys:
        heap.set(key, 5.0)  # ties never compare the keys themselves
    assert heap.pop_expired(5.0) == keys


def test_discard_is_lazy_but_never_surfaces() -> None:
    heap = heap_of(a=1.0, b=2.0, c=3.0)
    heap.discard("a")
    heap.discard("b")
    heap.discard("missing")  # discarding an unknown key is a no-op
    assert len(heap) == 1
    assert heap.next_deadline() == 3.0
    assert heap.pop_expired(10.0) == ["c"]


def test_reschedule_later_moves_the_key() -> None:
    heap = heap_of(a=1.0, b=2.0)
    heap.set("a", 5.0)
    assert len(heap) == 2
    assert heap.next_deadline() == 2.0
    assert heap.pop_expired(4.0) == ["b"]
    assert heap.pop_expired(5.0) == ["a"]
    assert heap.pop_expired(100.0) == []  # the stale 1.0 entry never fires


def test_reschedule_earlier_moves_the_key() -> None:
    heap = heap_of(a=5.0, b=2.0)
    heap.set("a", 1.0)
    assert heap.pop_expired(1.5) == ["a"]
    assert heap.pop_expired(100.0) == ["b"]


def test_reschedule_to_the_same_deadline_fires_once() -> None:
    heap = heap_of(a=1.0)
    heap.set("a", 1.0)
    heap.discard("a")
    heap.set("a", 1.0)
    assert heap.pop_expired(2.0) == ["a"]
    assert len(heap) == 0 and heap.next_deadline() is None


def test_discard_then_set_again_revives_the_key() -> None:
    heap = heap_of(a=1.0)
    heap.discard("a")
    heap.set("a", 3.0)
    assert heap.pop_expired(2.0) == []
    assert heap.pop_expired(3.0) == ["a"]


def test_compaction_bounds_memory_and_keeps_live_keys() -> None:
    heap = DeadlineHeap()
    for i in range(1000):
        heap.set(i, float(i))
        if i % 10:
            heap.discard(i)  # keep every tenth key
    for i in range(0, 1000, 10):
        heap.set(i, 2000.0 - i)  # and reschedule each live key once (reversed order)
    assert len(heap) == 100
    # Stale entries are purged when they outnumber live ones (internal bound).
    assert len(heap._heap) <= 2 * len(heap) + 64
    expired = heap.pop_expired(1e9)
    assert expired == list(range(990, -1, -10))  # 1010.0, 1020.0, ... 2000.0
    assert len(heap) == 0


def test_compaction_during_churn_never_loses_a_deadline() -> None:
    heap = DeadlineHeap()
    live: dict[int, float] = {}
    for step in range(5000):
        key = step % 37
        if step % 3 == 0:
            heap.discard(key)
            live.pop(key, None)
        else:
            deadline = float((step * 7919) % 1000)
            heap.set(key, deadline)
            live[key] = deadline
    assert len(heap) == len(live)
    assert heap.next_deadline() == min(live.values())
    expected = sorted(live, key=lambda k: live[k])
    got = heap.pop_expired(1e9)
    assert sorted(got) == sorted(expected)
    assert [live[k] for k in got] == sorted(live.values())
