"""A min-heap of deadlines with lazy deletion.

The idea is trio's ``Deadlines`` (``trio/_core/_run.py``): entries are never
removed from the middle of the heap; a cancelled or rescheduled key just leaves a
stale entry that is skipped when it surfaces. The heap is rebuilt when stale
entries outnumber live ones, so memory stays proportional to live keys.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineHeap(Generic[K]):
    """Absolute deadlines (monotonic seconds) keyed by any hashable id."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._live: dict[K, float] = {}
        self._seq = 0  # tie-breaker so keys never need to be comparable

    def __len__(self) -> int:
        return len(self._live)

    def set(self, key: K, deadline: float) -> None:
        """Schedule (or reschedule) ``key`` to expire at ``deadline`` seconds."""
        self._live[key] = deadline
        self._seq += 1
        heapq.heappush(self._heap, (deadline, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def discard(self, key: K) -> None:
        """Forget ``key``; its heap entry becomes stale and is skipped later."""
        self._live.pop(key, None)

    def next_deadline(self) -> float | None:
        """The earliest live deadline, or None when nothing is scheduled."""
        heap = self._heap
        while heap and self._live.get(heap[0][2]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_expired(self, now: float) -> list[K]:
        """Remove and return every key whose deadline is <= ``now``, earliest first."""
        out: list[K] = []
        while True:
            deadline = self.next_deadline()
            if deadline is None or deadline > now:
                return out
            _, _, key = heapq.heappop(self._heap)
            del self._live[key]
            out.append(key)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2]) == e[0]]
        heapq.heapify(self._heap)
