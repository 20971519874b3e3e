"""A request whose worker crashed running it (SIGSEGV & co.) is not re-dispatched:
a poison request must not take every worker down in turn (break-it finding: a
json_schema llama.cpp could not parse crashed both model workers, one after the
other). A SIGKILL says nothing about the request: re-dispatched once, as before."""

from __future__ import annotations

import pytest

from broker.protocol import WorkerCommand
from broker.retry import crashed_running_it
from broker.routing import RoutingSettings
from brokerkit import FAST, W1, W2, BrokerHarness, bodies, generate

REQUEST = WorkerCommand.REQUEST


@pytest.fixture
def h() -> BrokerHarness:
    return BrokerHarness(FAST, routing=RoutingSettings("full"))


def _start_on_w1(h: BrokerHarness) -> None:
    h.ready(W1, 0.0, worker_id="llm-0")
    h.send(generate("poison", prompt="the poison"), 0.0)
    assert len(bodies(h.drain_workers(), W1, REQUEST)) == 1
    h.ready(W2, 0.05, worker_id="llm-1")
    assert h.drain_workers() == []


@pytest.mark.parametrize("signal", ["SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE"])
def test_a_crash_running_a_request_is_not_passed_on(h: BrokerHarness, signal: str) -> None:
    _start_on_w1(h)
    h.broker.worker_exited("llm-0", f"killed by {signal}", 0.1)
    assert bodies(h.drain_workers(), W2, REQUEST) == []  # llm-1 is spared
    (reply,) = h.replies()
    assert reply["code"] == 503 and reply["reason"] == "worker_lost"
    assert f"killed by {signal}" in reply["message"] and "not retried" in reply["message"]
    h.assert_each_answered_once()


def test_a_sigkill_is_not_the_requests_fault_and_it_is_run_again(h: BrokerHarness) -> None:
    _start_on_w1(h)
    h.broker.worker_exited("llm-0", "killed by SIGKILL", 0.1)
    (again,) = bodies(h.drain_workers(), W2, REQUEST)
    assert again["prompt"] == "the poison"
    h.final(W2, again["rid"], 0.3)
    assert h.replies()[0]["status"] == "ok"
    h.assert_each_answered_once()


def test_an_oom_kill_running_a_request_is_not_passed_on(h: BrokerHarness) -> None:
    _start_on_w1(h)
    oom = "OOM-killed in its cgroup at memory.max 256 MiB (killed by SIGKILL)"
    h.broker.worker_exited("llm-0", oom, 0.1)
    assert bodies(h.drain_workers(), W2, REQUEST) == []  # llm-1 is spared
    (reply,) = h.replies()
    assert (reply["code"], reply["reason"]) == (503, "worker_lost")
    assert reply["message"] == (
        f"worker lost: {oom} (not retried: the worker ran out of memory running this request)"
    )
    h.assert_each_answered_once()


def test_crash_wording_is_the_supervisors() -> None:
    from node.supervisor import describe_exit

    assert crashed_running_it(describe_exit(-11)) and crashed_running_it(describe_exit(-6))
    assert not crashed_running_it(describe_exit(-9))
    assert not crashed_running_it("dead: missed heartbeats")
    assert not crashed_running_it(describe_exit(3))


def test_a_crash_of_a_multi_slot_worker_retries_each_request_once(h: BrokerHarness) -> None:
    """Several requests in flight: the poison one cannot be told apart, so each is
    run again once; crashing its second worker too, none is run a third time."""
    h.ready(W1, 0.0, worker_id="llm-0", slots=2)
    h.send(generate("a", prompt="the poison"), 0.0)
    h.send(generate("b", prompt="innocent"), 0.0)
    assert len(bodies(h.drain_workers(), W1, REQUEST)) == 2
    h.ready(W2, 0.05, worker_id="llm-1", slots=2)
    h.broker.worker_exited("llm-0", "killed by SIGSEGV", 0.1)
    again = bodies(h.drain_workers(), W2, REQUEST)
    assert sorted(b["prompt"] for b in again) == ["innocent", "the poison"]
    assert h.replies() == []
    h.ready(W1, 0.2, worker_id="llm-0", slots=2)  # restarted
    h.broker.worker_exited("llm-1", "killed by SIGSEGV", 0.3)
    assert bodies(h.drain_workers(), W1, REQUEST) == []  # a third worker is spared
    replies = h.replies()
    assert [(r["code"], r["reason"]) for r in replies] == [(503, "worker_lost")] * 2
    assert all("not retried" not in r["message"] for r in replies)  # nobody was blamed
    h.assert_each_answered_once()
