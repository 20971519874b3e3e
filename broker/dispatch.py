"""Credit and dispatch: queued jobs out as REQUESTs, running ones stopped with CANCELs.

A worker's credit is its slots minus the requests it holds (``WorkerState.active``);
only READY, REQUEST, FINAL and CREDIT change it, never a heartbeat. A request
leaves the queue only onto a worker with free credit, and a cancelled one keeps
its slot until the worker acks with its FINAL: the broker never runs more on a
worker than it said it can take. Under memory pressure part of the model's
credit is withheld (``broker.snapshot.free_credit``).
"""

from __future__ import annotations

from broker.jobs import JobTable
from broker.kinds import ENGINE_KINDS
from broker.outbox import Outbox
from broker.pressure import PressureLevels
from broker.protocol import WorkerCommand
from broker.queue import RequestQueue
from broker.records import BrokerSettings, Job
from broker.service_time import ServiceEstimator
from broker.snapshot import free_credit
from broker.workers import WorkerRegistry


class Dispatcher:
    """The queue -> REQUEST frames within free credit, and CANCEL frames.

    Args:
        settings: the broker's knobs (``default_max_tokens``, ``cancel_grace_ms``).
        workers, jobs, queue: the registry, the job table and the queue it reads
            and moves jobs between.
        levels: the broker's pressure levels (a reference): how much of the
            model's credit they leave usable.
        estimator: told each worker's batch level as jobs start on it.
        outbox: where the frames go.
    """

    def __init__(
        self,
        settings: BrokerSettings,
        workers: WorkerRegistry,
        jobs: JobTable,
        queue: RequestQueue,
        levels: PressureLevels,
        estimator: ServiceEstimator,
        outbox: Outbox,
    ) -> None:
        self.settings = settings
        self.workers = workers
        self.jobs = jobs
        self.queue = queue
        self.levels = levels
        self.estimator = estimator
        self.outbox = outbox

    def dispatch(self, now: float) -> None:
        """Send queued requests, by priority then age, while credit allows."""
        if not self.queue:
            return  # most calls (a FINAL with nothing waiting): no credit to count
        free = {kind: free_credit(self.workers, self.levels, kind) for kind in ENGINE_KINDS}
        for job in self.queue:
            if free[job.kind] <= 0:
                if not any(n > 0 for n in free.values()):
                    return
                continue
            worker = self.workers.pick(job.kind, self.settings.dispatch)
            if worker is None:
                continue  # another kind of worker may still take later requests
            self.queue.remove(job)
            free[job.kind] -= 1
            worker.active.add(job.rid)
            self.estimator.levels.running(worker.identity, worker.active, now)
            if len(worker.active) == 1:
                worker.progress_at = now  # the stall clock starts when work starts
            worker.last_dispatch = now
            self.jobs.start(job, worker.identity, now)
            # request_id: only for the worker's log lines (docs/PROTOCOL.md §13.3).
            body = {"rid": job.rid, "request_id": job.req.id, **job.req.engine_fields()}
            body.setdefault("max_tokens", self.settings.default_max_tokens)
            body["timeout_ms"] = max(1, int((job.deadline - now) * 1000))
            self.outbox.worker(worker.identity, WorkerCommand.REQUEST, body)
            if self.outbox.tracing:
                attempt = f"attempt {job.attempts + 1}"
                self.outbox.trace("dispatched", job, worker.worker_id, attempt)

    def cancel(self, job: Job, now: float) -> None:
        """Tell settled ``job``'s worker to stop it (``CANCELLING``); the credit
        returns with the worker's ack (its FINAL), and no ack within
        ``cancel_grace_ms`` means it hangs (``broker.liveness``)."""
        self.jobs.cancelling(job)
        assert job.worker is not None
        self.outbox.worker(job.worker, WorkerCommand.CANCEL, {"rid": job.rid})
        worker = self.workers.get(job.worker)
        self.outbox.trace("cancelling", job, "" if worker is None else worker.worker_id)
        self.jobs.arm("ack", job.rid, now + self.settings.cancel_grace_ms / 1000)
