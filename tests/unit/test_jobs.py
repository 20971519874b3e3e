"""The job state machine (``broker.jobs.JobTable``): each transition checks the
state it leaves, so a job can never be answered twice or run after it ended."""

from __future__ import annotations

import pytest

from broker.client_request import parse_client_request
from broker.jobs import InvalidTransition, JobTable
from broker.records import Job, JobState


def new_job(table: JobTable) -> Job:
    req = parse_client_request({"id": 1, "op": "generate", "prompt": "hi"})
    return table.new(b"client", req, 0.0, 10.0, "llm")


def test_a_job_runs_is_answered_and_is_cancelled_once() -> None:
    table = JobTable()
    job = new_job(table)
    assert job.state is JobState.QUEUED and not job.settled
    table.start(job, b"w", 1.0)
    assert (job.state, job.worker, job.dispatched_at) == (JobState.RUNNING, b"w", 1.0)
    assert table.running() == 1 and table.pending() == 1
    table.settle(job, JobState.ANSWERED)
    assert job.settled and table.pending() == 0 and table.running() == 0
    table.cancelling(job)
    assert job.state is JobState.CANCELLING
    with pytest.raises(InvalidTransition):
        table.settle(job, JobState.ANSWERED)  # answered twice
    with pytest.raises(InvalidTransition):
        table.cancelling(job)


def test_a_lost_workers_job_is_queued_again_with_its_output_thrown_away() -> None:
    table = JobTable()
    job = new_job(table)
    table.start(job, b"w", 1.0)
    job.chunks.append("partial text")
    job.first_token_at = 1.5
    table.requeue(job)
    assert (job.state, job.worker, job.chunks, job.first_token_at, job.attempts) == (
        JobState.QUEUED,
        None,
        [],
        None,
        1,
    )
    with pytest.raises(InvalidTransition):
        table.requeue(job)  # only a running job goes back to the queue


def test_a_settled_job_never_starts() -> None:
    table = JobTable()
    job = new_job(table)
    table.settle(job, JobState.HANDED_OVER)
    with pytest.raises(InvalidTransition):
        table.start(job, b"w", 1.0)
    dropped = new_job(table)
    table.settle(dropped, JobState.DROPPED)
    assert dropped.settled
