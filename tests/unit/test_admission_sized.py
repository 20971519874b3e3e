"""Admission by each request's size, with a fake clock and simulated workers.

The defect this guards against: the deadline check estimated a request's wait
from one mean service time, so a burst of long prompts queued behind short ones
was admitted and about half of it then expired (504) in the queue or on a
worker: model time spent on answers nobody could use. Estimated by size
(``service_estimate = "size"``), the requests that cannot finish are refused
at once (503 ``deadline_unmeetable``) and what fits is still admitted.
"""

from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Any

import pytest

from broker.admission import Admit
from broker.client_request import ClientRequest
from broker.protocol import WorkerCommand
from broker.routing import Route
from broker.service_time import ServiceEstimator, Slots
from broker.snapshot import EnginePool, PoolView
from brokerkit import CLIENT, FAST, W1, W2, BrokerHarness, Exact, generate

REQUEST = WorkerCommand.REQUEST
CANCEL = WorkerCommand.CANCEL

#: The simulated model: 2 ms per prompt token (one token per character plus
#: BOS, as the test tokenizer below), 20 ms per generated token.
PREFILL_S = 0.002
DECODE_S = 0.020
SHORT = "x" * 10  # 11 tokens: 0.022 s prefill + 4 tokens = 0.102 s
LONG = "y" * 500  # 501 tokens: 1.002 s prefill + 4 tokens = 1.082 s
MAX_TOKENS = 4

#: Heartbeats and stall checks out of the way: the simulated workers send none.
QUIET = replace(FAST, max_queue=32, heartbeat_interval_ms=600_000, stall_timeout_ms=600_000)


def chars(req: ClientRequest) -> int:
    """A stand-in tokenizer: one token per character, plus BOS."""
    return len(req.prompt or "") + 1


class SimulatedWorkers:
    """Model workers on the fake clock: each REQUEST gets its first PARTIAL after
    the prefill and one decode step, and a FINAL with ``usage`` after its last
    token; a CANCEL is acknowledged at once. Collects every client reply."""

    def __init__(self, h: BrokerHarness) -> None:
        self.h = h
        self._due: list[tuple[float, int, str, bytes, int, int]] = []
        self._seq = 0
        self.finals: dict[Any, dict[str, Any]] = {}

    def collect(self) -> None:
        for body in self.h.replies():
            if body["status"] != "partial":
                self.finals[body["id"]] = body

    def pump(self, now: float) -> None:
        """Take what the broker sent to the workers at ``now``."""
        for m in self.h.drain_workers():
            rid = m.body["rid"]
            if m.command is REQUEST:
                tokens = len(m.body["prompt"]) + 1
                first = now + PREFILL_S * tokens + DECODE_S
                self._at(first, "partial", m.identity, rid, tokens)
                self._at(
                    first + DECODE_S * (m.body["max_tokens"] - 1), "final", m.identity, rid, tokens
                )
            elif m.command is CANCEL:
                self._due = [e for e in self._due if e[4] != rid]
                heapq.heapify(self._due)
                self.h.final(m.identity, rid, now, status="cancelled", code=499)
        self.collect()

    def _at(self, when: float, what: str, worker: bytes, rid: int, tokens: int) -> None:
        self._seq += 1
        heapq.heappush(self._due, (when, self._seq, what, worker, rid, tokens))

    def run(self, start: float, end: float, step: float = 0.01) -> None:
        """Advance the clock from ``start`` to ``end``: worker events at their own
        times, the broker's timers every ``step``."""
        t = start
        while t <= end:
            while self._due and self._due[0][0] <= t:
                when, _, what, worker, rid, tokens = heapq.heappop(self._due)
                if what == "partial":
                    self.h.partial(worker, rid, "tok", when)
                else:
                    usage = {"prompt_tokens": tokens, "completion_tokens": MAX_TOKENS}
                    self.h.final(worker, rid, when, usage=usage)
                self.pump(when)
            self.h.broker.tick(t)
            self.pump(t)
            t = round(t + step, 6)


def two_workers(estimate: str) -> tuple[BrokerHarness, SimulatedWorkers]:
    """A broker estimating by ``estimate`` with two one-slot simulated workers."""
    h = BrokerHarness(replace(QUIET, service_estimate=estimate))
    h.broker.gate.count_tokens = Exact(chars)
    sim = SimulatedWorkers(h)
    for w in (W1, W2):
        h.ready(w, 0.0)
    return h, sim


def burst(estimate: str) -> tuple[BrokerHarness, dict[Any, dict[str, Any]]]:
    """Warm up on one long and eight short requests, then send 4 short and 8 long
    ones at once, each with a 3 s budget, to two one-slot workers."""
    h, sim = two_workers(estimate)
    h.send(generate("warm-long", LONG, max_tokens=MAX_TOKENS), 0.0)
    sim.pump(0.0)
    sim.run(0.0, 1.5)
    for i in range(8):
        h.send(generate(f"warm-{i}", SHORT, max_tokens=MAX_TOKENS), 2.0)
    sim.pump(2.0)
    sim.run(2.0, 3.0)
    # The mean has mostly seen short requests: 0.102 + 0.98 x 0.8^8 s.
    assert h.broker.estimator.mean_s("llm") == pytest.approx(0.266, abs=0.001)
    for i in range(4):
        h.send(generate(f"short-{i}", SHORT, max_tokens=MAX_TOKENS, timeout_ms=3000), 5.0)
    for i in range(8):
        h.send(generate(f"long-{i}", LONG, max_tokens=MAX_TOKENS, timeout_ms=3000), 5.0)
    sim.pump(5.0)
    sim.run(5.0, 11.0)
    h.assert_each_answered_once()
    return h, {k: v for k, v in sim.finals.items() if not str(k).startswith("warm")}


def outcome(body: dict[str, Any]) -> str:
    return "ok" if body["status"] == "ok" else f"{body['code']} {body.get('reason', '')}".strip()


def test_mean_estimate_admits_a_long_prompt_burst_that_then_expires() -> None:
    """The defect, reproduced: every request is admitted (each could *start* by
    the mean), the pool finishes two long prompts per 1.082 s, and the last four
    long ones expire: a third of the admitted requests end in 504."""
    _, finals = burst("mean")
    assert {k: outcome(v) for k, v in finals.items()} == {
        **{f"short-{i}": "ok" for i in range(4)},
        **{f"long-{i}": "ok" for i in range(4)},
        **{f"long-{i}": "504" for i in range(4, 8)},
    }


def test_size_estimate_refuses_the_doomed_part_of_the_burst_up_front() -> None:
    h, finals = burst("size")
    assert {k: outcome(v) for k, v in finals.items()} == {
        **{f"short-{i}": "ok" for i in range(4)},
        **{f"long-{i}": "ok" for i in range(4)},  # what fits is still admitted
        **{f"long-{i}": "503 deadline_unmeetable" for i in range(4, 8)},
    }
    refused = finals["long-4"]
    assert refused["message"].startswith("expected wait 2")
    assert "+ service 1082 ms exceeds the 3000 ms budget" in refused["message"]
    # Retry when the queue of the moment has drained: 2 x 0.102 s of short
    # requests, then two rounds of two long ones.
    assert refused["retry_after_ms"] == pytest.approx(2 * 102 + 2 * 1082, abs=2)
    assert h.broker.stats.counters["deadline_exceeded"] == 0
    assert h.broker.stats.counters["shed_deadline_unmeetable"] == 4


def warmed(estimate: str = "size") -> tuple[BrokerHarness, SimulatedWorkers]:
    """Two workers and a service model that has seen one long and one short request."""
    h, sim = two_workers(estimate)
    h.send(generate("warm-long", LONG, max_tokens=MAX_TOKENS), 0.0)
    h.send(generate("warm-short", SHORT, max_tokens=MAX_TOKENS), 0.0)
    sim.pump(0.0)
    sim.run(0.0, 1.5)
    assert h.broker.estimator.sizes.ready("llm")
    return h, sim


def test_a_slot_that_frees_soon_is_waited_for_not_the_average_of_both() -> None:
    """One long and one short request run; a short one with a 300 ms budget fits
    behind the short one (0.102 + 0.102 s), though the pool's work divided by
    its slots ((1.082 + 0.102) / 2 s) would not."""
    h, sim = warmed()
    h.send(generate("long", LONG, max_tokens=MAX_TOKENS), 2.0)
    h.send(generate("short", SHORT, max_tokens=MAX_TOKENS), 2.0)
    sim.pump(2.0)
    h.send(generate("hurry", SHORT, max_tokens=MAX_TOKENS, timeout_ms=300), 2.0)
    sim.pump(2.0)
    sim.run(2.0, 4.0)
    assert outcome(sim.finals["hurry"]) == "ok"
    assert sim.finals["hurry"]["total_ms"] <= 300


def test_a_request_that_alone_outlasts_its_budget_gets_no_retry_advice() -> None:
    h, sim = warmed()
    h.send(generate("hopeless", LONG, max_tokens=MAX_TOKENS, timeout_ms=500), 2.0)
    sim.pump(2.0)
    reply = sim.finals["hopeless"]
    assert (reply["code"], reply["reason"]) == (503, "deadline_unmeetable")
    assert "alone exceeds the 500 ms budget" in reply["message"]
    assert "retry_after_ms" not in reply  # the same request can never fit: retrying is futile


def test_the_mean_estimate_still_only_asks_whether_a_request_can_start() -> None:
    h, sim = warmed("mean")
    h.send(generate("hopeless", LONG, max_tokens=MAX_TOKENS, timeout_ms=500), 2.0)
    sim.pump(2.0)
    assert "hopeless" not in sim.finals  # admitted: an idle pool can start it at once
    sim.run(2.0, 3.0)
    assert outcome(sim.finals["hopeless"]) == "504"


def test_the_size_check_count_is_the_jobs_prompt_size() -> None:
    """A prompt that might not fit is tokenized for the 413 check; its job keeps
    that exact count instead of the estimate from its bytes."""
    h, _ = warmed()
    h.broker.gate.count_tokens = Exact(lambda req: len(req.prompt or "") // 2)
    h.send(generate("big", "z" * 2040, max_tokens=16), 2.0)  # 2041 bytes + 16 > 2048
    (job,) = [j for j in h.broker.jobs if j.req.id == "big"]
    assert job.prompt_tokens == 1020


def test_each_checked_request_keeps_its_own_count() -> None:
    """The count travels with the verdict (``Admit.prompt_tokens``), not in the gate:
    two requests checked before either is queued each keep their own."""
    h, _ = warmed()
    gate = h.broker.gate
    gate.count_tokens = Exact(lambda req: len(req.prompt or "") // 2)
    pool = PoolView(llm=h.broker.snapshot.engine("llm", "normal", 2.0), rules=EnginePool(0))
    first, second = (
        ClientRequest(id=rid, op="generate", prompt=prompt, max_tokens=16)
        for rid, prompt in ((1, "y" * 2040), (2, "z" * 2036))  # both might not fit
    )
    verdicts = [gate.check(CLIENT, req, Route("llm"), pool, 2.0) for req in (first, second)]
    assert [v.prompt_tokens for v in verdicts if isinstance(v, Admit)] == [1020, 1018]


def test_one_request_plays_each_engines_queue_forward_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routing and admission share one snapshot of the pool: one wait per engine."""
    h, sim = warmed()
    waits: list[str] = []
    wait = ServiceEstimator.wait

    def counted(self: ServiceEstimator, ahead: Any, slots: Slots, now: float) -> Any:
        waits.append(slots.kind)
        return wait(self, ahead, slots, now)

    monkeypatch.setattr(ServiceEstimator, "wait", counted)
    h.send(generate("one", SHORT, max_tokens=MAX_TOKENS), 2.0)
    sim.pump(2.0)
    assert sorted(waits) == ["llm", "rules"]


def test_before_any_measured_request_the_size_setting_behaves_as_the_mean() -> None:
    h = BrokerHarness(QUIET)
    assert h.broker.settings.service_estimate == "size"
    h.ready(W1, 0.0)
    h.send(generate("first", LONG, timeout_ms=1), 0.0)  # nothing measured: no refusal
    assert h.replies() == []
    assert not h.broker.estimator.sizes.ready("llm")


def test_a_stream_is_admitted_if_its_first_token_can_come_in_time() -> None:
    """A streaming client uses the tokens as they come: refusing a stream because
    its *whole* answer cannot finish withheld the tokens it could have had (our
    isolation benchmark's streams were all refused so). Its first token must come
    in time; the deadline then ends it with 504 and the text so far."""
    h, sim = warmed()
    for rid, stream in (("whole", False), ("stream", True)):
        h.send(generate(rid, LONG, max_tokens=64, timeout_ms=1500, stream=stream), 2.0)
    sim.pump(2.0)
    whole = sim.finals["whole"]  # 1.002 s prefill + 64 x 0.02 s decode > 1.5 s
    assert outcome(whole) == "503 deadline_unmeetable"
    assert "expected service 2282 ms alone exceeds" in whole["message"]
    assert "stream" not in sim.finals  # admitted: its first token comes after 1.022 s
    sim.run(2.0, 4.0)
    streamed = sim.finals["stream"]
    assert outcome(streamed) == "504" and streamed["text"] == "tok"


def test_a_stream_whose_first_token_cannot_come_in_time_is_refused() -> None:
    h, sim = warmed()
    h.send(generate("late", LONG, max_tokens=64, timeout_ms=500, stream=True), 2.0)
    sim.pump(2.0)
    late = sim.finals["late"]
    assert outcome(late) == "503 deadline_unmeetable"
    assert late["message"] == "expected first token 1022 ms alone exceeds the 500 ms budget"
    assert "retry_after_ms" not in late


def test_short_prompts_alone_teach_enough_to_refuse_a_request_longer_than_its_budget() -> None:
    """Break-it finding (session 13): a node that had served only short prompts
    (fewer than ``MIN_PREFILL_TOKENS`` each: IoT commands) never left the mean, so
    16 requests for 200 tokens with a 300 ms budget were all admitted and each
    ended 504 at 0.3 s. Their decode rate is known after the first: 200 x 20 ms
    alone exceeds 300 ms."""
    h, sim = two_workers("size")
    for i in range(8):
        h.send(generate(f"cmd-{i}", SHORT, max_tokens=MAX_TOKENS), 0.0)
    sim.pump(0.0)
    sim.run(0.0, 1.0)
    assert h.broker.estimator.sized("llm")
    h.send(generate("story", SHORT, max_tokens=200, timeout_ms=300), 2.0)
    sim.pump(2.0)
    reply = sim.finals["story"]
    assert (reply["code"], reply["reason"]) == (503, "deadline_unmeetable")
    assert "alone exceeds the 300 ms budget" in reply["message"]
    h.send(generate("cmd", SHORT, max_tokens=MAX_TOKENS, timeout_ms=300), 2.0)
    sim.pump(2.0)
    sim.run(2.0, 3.0)
    assert outcome(sim.finals["cmd"]) == "ok"  # what fits is still admitted
