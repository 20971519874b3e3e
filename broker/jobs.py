"""The broker's ledger of accepted requests and the one place a job's state changes.

``JobTable`` owns everything keyed by a job: the jobs themselves (by the
broker's request id), the mapping from a client's own ``(identity, id)`` to the
job answering it, the timers (a ``DeadlineHeap`` keyed ``(timer, rid)``, the
timer a ``Timer``), and the state
machine of ``broker.records.JobState``: ``start``, ``requeue``, ``settle`` and
``cancelling`` each check the state the job leaves and raise
``InvalidTransition`` if it is not one they move from. What a transition
*causes* (replies, CANCELs, the queue, the router's books) is
``broker.lifecycle.Lifecycle``'s.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from broker.client_request import ClientRequest
from broker.deadlines import DeadlineHeap
from broker.kinds import EngineKind
from broker.records import OPEN_STATES, Job, JobState

ClientKey = tuple[bytes, str | int]

#: A job's timers: ``job`` = the request's deadline, ``ttft`` = degrade mode's
#: first-token budget, ``late`` = degrade mode's last chance to ask the rules before
#: the deadline (``broker.routing.LATE_HEDGE_S``), ``ack`` = the grace a cancelled
#: worker has to acknowledge.
Timer = Literal["job", "ttft", "late", "ack"]

#: The states a job may be settled into (``JobTable.settle``).
SETTLED_STATES = frozenset({JobState.ANSWERED, JobState.HANDED_OVER, JobState.DROPPED})


class InvalidTransition(RuntimeError):
    """A job was asked to leave a state it cannot leave that way (a broker bug)."""


def _leave(job: Job, allowed: frozenset[JobState], to: JobState) -> None:
    if job.state not in allowed:
        raise InvalidTransition(f"job {job.rid}: {job.state.value} -> {to.value}")
    job.state = to


class JobTable:
    """Jobs, the client ids bound to them, and their timers (monotonic seconds)."""

    def __init__(self) -> None:
        self._jobs: dict[int, Job] = {}
        self._by_client: dict[ClientKey, int] = {}
        self._timers: DeadlineHeap[tuple[Timer, int]] = DeadlineHeap()
        self._next_rid = 1

    def __iter__(self) -> Iterator[Job]:
        return iter(list(self._jobs.values()))

    def new(
        self,
        client: bytes,
        req: ClientRequest,
        now: float,
        deadline: float,
        kind: EngineKind,
        principal: bytes | None = None,
    ) -> Job:
        """A new job with a fresh request id, its ``job`` deadline armed;
        ``principal``: its client's authenticated key (``Job.principal``)."""
        job = Job(self._next_rid, client, req, now, deadline, kind=kind, principal=principal)
        self._next_rid += 1
        self._jobs[job.rid] = job
        self._timers.set(("job", job.rid), deadline)
        return job

    def get(self, rid: object) -> Job | None:
        """The job with broker request id ``rid``, if it is still known."""
        return self._jobs.get(rid) if isinstance(rid, int) else None

    # ------------------------------------------------------------------ transitions

    def start(self, job: Job, worker: bytes, now: float) -> None:
        """``QUEUED`` -> ``RUNNING``: dispatched to ``worker`` at ``now``."""
        _leave(job, frozenset({JobState.QUEUED}), JobState.RUNNING)
        job.worker = worker
        job.dispatched_at = now

    def requeue(self, job: Job) -> None:
        """``RUNNING`` -> ``QUEUED``: its worker was lost and it runs again; the
        output the client never saw is thrown away."""
        _leave(job, frozenset({JobState.RUNNING}), JobState.QUEUED)
        job.attempts += 1
        job.worker = None
        job.chunks.clear()
        job.first_token_at = None

    def settle(self, job: Job, to: JobState) -> None:
        """``QUEUED`` or ``RUNNING`` -> ``to`` (``ANSWERED``, ``HANDED_OVER`` or
        ``DROPPED``): nothing more of it reaches its client."""
        assert to in SETTLED_STATES, to
        _leave(job, OPEN_STATES, to)

    def cancelling(self, job: Job) -> None:
        """A settled job still on its worker -> ``CANCELLING``: told to stop, it
        holds its slot until the worker acks (its FINAL)."""
        assert job.worker is not None, job.rid
        _leave(job, SETTLED_STATES, JobState.CANCELLING)

    # ------------------------------------------------------------------ client ids

    def bind(self, job: Job) -> None:
        """Make ``job`` the one answering its client's id (accept, hand-over)."""
        self._by_client[(job.client, job.req.id)] = job.rid

    def of_client(self, client: bytes, client_id: str | int) -> Job | None:
        """The job answering a client's id, if one is in flight."""
        return self.get(self._by_client.get((client, client_id)))

    def release(self, job: Job) -> None:
        """Free the client's id (answered): never a newer job's binding."""
        key = (job.client, job.req.id)
        if self._by_client.get(key) == job.rid:
            del self._by_client[key]

    def forget(self, job: Job) -> None:
        """Drop ``job`` entirely (its ``job`` timer too; an ``ack`` timer is the caller's)."""
        self._jobs.pop(job.rid, None)
        self._timers.discard(("job", job.rid))
        self.release(job)

    # ------------------------------------------------------------------ timers

    def arm(self, timer: Timer, rid: int, at: float) -> None:
        """Set ``timer`` of job ``rid`` to fire at ``at``."""
        self._timers.set((timer, rid), at)

    def disarm(self, timer: Timer, rid: int) -> None:
        """Cancel ``timer`` of job ``rid`` (lazy: the heap skips it later)."""
        self._timers.discard((timer, rid))

    def expired(self, now: float) -> list[tuple[Timer, int]]:
        """``(timer, rid)`` of every timer due at ``now``, earliest first. The
        caller looks each job up as it goes: handling one may end another."""
        return self._timers.pop_expired(now)

    def next_timer(self) -> float | None:
        """When the earliest timer fires, or None."""
        return self._timers.next_deadline()

    # ------------------------------------------------------------------ counts

    def pending(self) -> int:
        """Jobs still without a final reply."""
        return sum(1 for j in self._jobs.values() if not j.settled)

    def running(self) -> int:
        """Jobs on a worker and not yet answered."""
        return sum(1 for j in self._jobs.values() if j.state is JobState.RUNNING)
