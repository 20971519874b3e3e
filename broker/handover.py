"""Degrade mode's hand-overs of model requests to the rules: the policy.

Two ways, with different rules on what the rules' answer is worth:

* a **fallback** after the model failed (worker lost, none left): a new rules job
  takes over the client's id and its answer is served whatever it says, a "no rule
  matched" included: there is nothing better;
* a **hedge** at the latency budget (the model is late, not failing): the rules
  are asked while the model keeps running; a matched rule's answer is served and
  the model's job cancelled, a miss is dropped and the model answers
  (``broker.routing.usable_rules_answer``).

``Handover`` decides; the job owner (``broker.lifecycle.Lifecycle``) carries
the hand-over and the drop out.
"""

from __future__ import annotations

from typing import Any

from broker.jobs import JobTable
from broker.kinds import DegradeReason
from broker.lifecycle import Lifecycle
from broker.queue import RequestQueue
from broker.records import Job
from broker.routing import Router, usable_rules_answer
from broker.stats import Stats
from broker.workers import WorkerRegistry


class Handover:
    """Fallbacks and hedges: model requests handed (or offered) to the rules.

    Args:
        life: the job owner, which hands jobs over and drops hedges.
        jobs, queue: the job table (new rules jobs) and the queue they join.
        router: the migration mode.
        stats: the counters (``fallback_*``, ``hedge_*``).
        workers: the registry (are there rule workers?).
    """

    def __init__(
        self,
        life: Lifecycle,
        jobs: JobTable,
        queue: RequestQueue,
        router: Router,
        stats: Stats,
        workers: WorkerRegistry,
    ) -> None:
        self.life = life
        self.jobs = jobs
        self.queue = queue
        self.router = router
        self.stats = stats
        self.workers = workers

    def can_fall_back(self, job: Job) -> bool:
        """Whether degrade mode may answer ``job`` from the rules now."""
        return (
            job.kind == "llm"
            and job.copy_of is None
            and job.req.route == "auto"
            and self.router.mode == "degrade"
            and not (job.req.stream and job.chunks)
            and bool(self.workers.of_kind("rules"))
        )

    def fall_back(self, job: Job, reason: DegradeReason, now: float) -> bool:
        """Hand the unanswered model request ``job`` to the rules if degrade mode
        allows it now; False, with nothing done, if it does not.

        A new rules job takes the client's id, ahead of the queue; the old one is
        cancelled on its worker if it runs (its credit returns with the ack) and
        never answers itself.
        """
        if not self.can_fall_back(job):
            return False
        self.life.drop_hedge(job)
        new = self.jobs.new(
            job.client, job.req, job.accepted_at, job.deadline, "rules", job.principal
        )
        new.degraded = reason
        self.life.hand_over(job, new, now)
        self.queue.push(new, front=True)
        self.stats.count(f"fallback_{reason}")
        return True

    # ------------------------------------------------------------------ the hedge

    def hedge(self, job: Job) -> None:
        """Ask the rules about ``job`` (a model request past its latency budget)
        while the model keeps it; ``take_hedge`` decides whose answer the client gets."""
        hedge = self.jobs.new(
            job.client, job.req, job.accepted_at, job.deadline, "rules", job.principal
        )
        hedge.degraded, hedge.hedge_of = "latency_budget", job.rid
        job.hedged_by = hedge.rid
        # The model's request owns the client's id and deadline; the hedge ends with it.
        self.jobs.disarm("job", hedge.rid)
        self.queue.push(hedge, front=True)

    def take_hedge(self, hedge: Job, body: dict[str, Any], now: float) -> bool:
        """Whether the rules' final ``body`` answers the client (the caller then
        answers ``hedge``). Only a matched rule does, while the model's request
        could still be handed over (no streamed token yet); the model's job is
        then handed over to the hedge. Otherwise the hedge is dropped and the
        model keeps the request."""
        model = self.jobs.get(hedge.hedge_of)
        if (
            model is None
            or model.settled
            or not self.can_fall_back(model)
            or not usable_rules_answer(body)
        ):
            self.stats.count("hedge_model_kept")
            self.life.drop(hedge)
            return False
        self.life.hand_over(model, hedge, now)
        self.stats.count("hedge_rules_won")
        self.stats.count("fallback_latency_budget")
        return True
