"""Degrade mode's hand-overs of model requests to the rules.

Two ways, with different rules on what the rules' answer is worth:

* a **fallback** after the model failed (worker lost, none left): a new rules job
  takes over the client's id and its answer is served whatever it says, a "no rule
  matched" included: there is nothing better;
* a **hedge** at the latency budget (the model is late, not failing): the rules
  are asked while the model keeps running; a matched rule's answer is served and
  the model's job cancelled, a miss is dropped and the model answers
  (``broker.routing.usable_rules_answer``).

``Handover`` owns no state: it works on the broker's job table, queue, router,
registry and counters by reference (``broker.core.Broker`` owns them), and asks
the broker to cancel a running job or forget a finished one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broker.admission import AdmissionGate
from broker.jobs import JobTable
from broker.kinds import DegradeReason
from broker.records import Job
from broker.routing import Router, usable_rules_answer
from broker.stats import Stats
from broker.workers import WorkerRegistry


class Handover:
    """Fallbacks and hedges: model requests handed (or offered) to the rules.

    Args:
        jobs, gate, router, stats, workers: the broker's job table, queue, router,
            counters and registry (references, not copies).
        cancel: tells a running job's worker to stop it (credit returns with the ack).
        forget: drops a job from the ledger and the queue.
    """

    def __init__(
        self,
        *,
        jobs: JobTable,
        gate: AdmissionGate,
        router: Router,
        stats: Stats,
        workers: WorkerRegistry,
        cancel: Callable[[Job, float], None],
        forget: Callable[[Job], None],
    ) -> None:
        self.jobs = jobs
        self.gate = gate
        self.router = router
        self.stats = stats
        self.workers = workers
        self._cancel = cancel
        self._forget = forget

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
        """Hand ``job`` to the rules if degrade mode allows it now (see
        ``_reroute``); False, with nothing done, if it does not."""
        if not self.can_fall_back(job):
            return False
        self._reroute(job, reason, now)
        return True

    def _reroute(self, job: Job, reason: DegradeReason, now: float) -> None:
        """Hand an unanswered model request over to the rules (degrade mode).

        A new job takes the client's id; the old one is cancelled on its worker
        if it runs (its credit returns with the ack) and never answers itself.
        """
        self.drop_hedge(job)
        new = self.jobs.new(job.client, job.req, job.accepted_at, job.deadline, "rules")
        new.degraded = reason
        self._hand_over(job, new, now)
        self.gate.push(new, front=True)
        self.stats.count(f"fallback_{reason}")

    def _hand_over(self, old: Job, new: Job, now: float) -> None:
        """``new`` answers ``old``'s client from now on; ``old`` is cancelled on its
        worker if it runs (its credit returns with the ack) and never answers."""
        self.router.release(old, now)
        self.jobs.bind(new)
        old.replied = True  # handed over, not answered: the client still waits
        if old.worker is None:
            self._forget(old)
        else:
            self._cancel(old, now)

    # ------------------------------------------------------------------ the hedge

    def hedge(self, job: Job) -> None:
        """Ask the rules about ``job`` (a model request past its latency budget)
        while the model keeps it; ``take_hedge`` decides whose answer the client gets."""
        hedge = self.jobs.new(job.client, job.req, job.accepted_at, job.deadline, "rules")
        hedge.degraded, hedge.hedge_of = "latency_budget", job.rid
        job.hedged_by = hedge.rid
        # The model's request owns the client's id and deadline; the hedge ends with it.
        self.jobs.disarm("job", hedge.rid)
        self.gate.push(hedge, front=True)

    def take_hedge(self, hedge: Job, body: dict[str, Any], now: float) -> bool:
        """Whether the rules' final ``body`` answers the client. Only a matched rule
        does, while the model's request could still be handed over (no streamed
        token yet); the model's job is then cancelled. Otherwise the model keeps it."""
        model = self.jobs.get(hedge.hedge_of)
        if (
            model is None
            or model.replied
            or not self.can_fall_back(model)
            or not usable_rules_answer(body)
        ):
            self.stats.count("hedge_model_kept")
            return False
        self._hand_over(model, hedge, now)
        self.stats.count("hedge_rules_won")
        self.stats.count("fallback_latency_budget")
        return True

    def drop_hedge(self, job: Job) -> None:
        """``job`` is settled: its hedge, if still out, answers nobody."""
        hedge = self.jobs.get(job.hedged_by)
        if hedge is None or hedge.replied:
            return
        hedge.replied = True  # its FINAL (or its worker's loss) only frees the slot
        self.stats.count("hedge_model_kept")
        if hedge.worker is None:
            self._forget(hedge)  # still queued: it never runs
