"""The owner of a job's life: how an accepted request ends, and what that causes.

A job ends in exactly one of three ways (``broker.records.JobState``):

* **answered**: its one final reply goes to its client, the client's id is
  free at once, the router settles the breaker permit and logs the outcome,
  and the model request's hedge, if still out, is dropped;
* **handed over**: another job answers its client from now on (degrade mode's
  fallback, a hedge that won: ``broker.handover``);
* **dropped**: a hedge whose answer nobody takes.

A settled job then leaves: forgotten if it never ran, cancelled on its worker
if it runs (``broker.dispatch``; it keeps its slot until the worker acks). A
job whose worker sent its FINAL ends in one call (``finished``): answered if
still open, then forgotten.
``Lifecycle`` moves the state through ``broker.jobs.JobTable``'s checked
transitions and puts every effect in the outbox; it never decides *whether* a
job ends (the core does) nor whether the rules may take it (``broker.handover``).
"""

from __future__ import annotations

from typing import Any

from broker import protocol as p
from broker.delivery import ReplyKind
from broker.dispatch import Dispatcher
from broker.jobs import JobTable
from broker.kinds import FinalOutcome
from broker.observations import ended
from broker.outbox import Outbox
from broker.queue import ClientCounts, RequestQueue
from broker.records import Job, JobState
from broker.reply_cache import ReplyCache
from broker.routing import Router
from broker.stats import Stats


class Lifecycle:
    """Answers, hands over, drops, stops and forgets jobs.

    Args:
        jobs: the job table (the state machine and the client ids).
        queue, clients: the queue, and the per-client counts of open requests.
        router: settles breaker permits and queues migration records.
        dispatcher: cancels running jobs.
        stats: the outcome counters.
        outbox: where replies go.
        reply_cache: where delivered finals are kept for safe retry.
    """

    def __init__(
        self,
        jobs: JobTable,
        queue: RequestQueue,
        clients: ClientCounts,
        router: Router,
        dispatcher: Dispatcher,
        stats: Stats,
        outbox: Outbox,
        reply_cache: ReplyCache,
    ) -> None:
        self.jobs = jobs
        self.queue = queue
        self.clients = clients
        self.router = router
        self.dispatcher = dispatcher
        self.stats = stats
        self.outbox = outbox
        self.reply_cache = reply_cache

    def answer(
        self,
        job: Job,
        body: dict[str, Any],
        now: float,
        *,
        deliver: bool = True,
        counted: FinalOutcome | None = None,
    ) -> None:
        """Send ``job``'s one final reply ``body`` (``ANSWERED``); the client may
        reuse its id at once.

        ``deliver=False``: end it the same way but send nothing (its client is gone).
        A delivered final is also kept for a while, for a resend (safe retry).
        ``counted``: the outcome counter the reply was counted under, moved to
        ``client_gone`` if the reply never reaches its client (``Outgoing``).
        A model copy (shadow/dual) has no client: its result only goes to the
        router. A hedge is answered only once it won (``Handover.take_hedge``
        handed its model over to it): its held-back text goes out first.
        Its end goes to the metrics (``broker.observations.Ended``).
        """
        self.jobs.settle(job, JobState.ANSWERED)
        if job.hedge_of is not None and job.req.stream:
            for index, text in enumerate(job.chunks):  # the stream it would have been
                partial = p.partial_reply(job.req.id, text, index)
                self.outbox.client(job.client, partial, ReplyKind.PARTIAL)
        self.drop_hedge(job)
        self.router.finished(job, body, now)
        if job.copy_of is not None:
            return
        self.jobs.release(job)
        self.clients.closed(job.owner)
        if self.outbox.observing:
            self.outbox.observations.append(ended(job, body, now, delivered=deliver))
        if deliver:
            self.outbox.client(job.client, body, ReplyKind.FINAL, counted)
            self.reply_cache.keep((job.client, job.req.id), job.req, body, now)

    def finished(
        self,
        job: Job,
        reply: dict[str, Any] | None,
        now: float,
        *,
        counted: FinalOutcome | None = None,
    ) -> None:
        """``job``'s worker sent its FINAL (for a cancelled job: its ack): the
        ``ack`` timer is disarmed, ``reply`` answers it (``answer``; None: nothing
        to send, it was settled already or is a hedge nobody takes), and it is
        forgotten (``forget``). ``counted``: as for ``answer``."""
        self.jobs.disarm("ack", job.rid)
        if reply is not None:
            self.answer(job, reply, now, counted=counted)
        self.forget(job)

    def hand_over(self, old: Job, new: Job, now: float) -> None:
        """``new`` answers ``old``'s client from now on (``old``: ``HANDED_OVER``,
        its breaker permit released); ``old`` leaves (``stop``)."""
        self.router.release(old, now)
        self.jobs.bind(new)
        self.jobs.settle(old, JobState.HANDED_OVER)
        self.stop(old, now)

    def drop(self, hedge: Job) -> None:
        """The rules' answer to ``hedge`` goes to nobody (``DROPPED``); a running
        hedge finishes, its FINAL only frees the slot."""
        self.jobs.settle(hedge, JobState.DROPPED)

    def drop_hedge(self, job: Job) -> None:
        """``job`` is settled: its hedge, if still out, answers nobody (counted
        ``hedge_model_kept``); a queued one never runs."""
        hedge = self.jobs.get(job.hedged_by)
        if hedge is None or hedge.settled:
            return
        self.drop(hedge)
        self.stats.count("hedge_model_kept")
        if hedge.worker is None:
            self.forget(hedge)

    def stop(self, job: Job, now: float) -> None:
        """A settled ``job`` leaves: forgotten if queued, cancelled if running
        (its credit returns with the worker's ack)."""
        if job.worker is None:
            self.forget(job)
        else:
            self.dispatcher.cancel(job, now)

    def requeue(self, job: Job) -> None:
        """Run ``job`` again (its worker was lost), ahead of the queue: it waited longest."""
        self.jobs.requeue(job)
        job.last_token_at = None  # no token gap spans the lost worker
        self.queue.push(job, front=True)
        self.outbox.trace("requeued", job, detail="its worker was lost")

    def forget(self, job: Job) -> None:
        """Drop ``job`` from the ledger and the queue (it ended, or its worker acked)."""
        self.jobs.forget(job)
        self.queue.remove(job)
