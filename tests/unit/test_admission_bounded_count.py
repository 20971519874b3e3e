"""The size check with a bounded token counter: what the bound decides costs no count.

The defect: every prompt whose bytes did not bound it inside the context was
tokenized on the broker's loop before its 413, ~0.2 s per 250 KB body, so a
burst of them stalled pings for most of a second. A ``TokenCounter``
answers with a lower bound when that decides, or gives up within its budget;
the gate then refuses (413 "at least"), or leaves the exact check to the worker.
"""

from __future__ import annotations

from dataclasses import replace

from broker.client_request import ClientRequest
from broker.protocol import WorkerCommand
from broker.token_count import TokenCount, TokenCounter
from brokerkit import FAST, W1, BrokerHarness, bodies, generate

REQUEST = WorkerCommand.REQUEST
N_CTX = 2048  # what the harness's workers report
MAX_TOKENS = 48
LIMIT = N_CTX - MAX_TOKENS  # prompt tokens that fit


class Scripted:
    """A bounded counter that answers ``found`` and records what it was asked."""

    def __init__(self, found: TokenCount) -> None:
        self.found = found
        self.limits: list[int] = []
        self.exact_calls = 0

    def __call__(self, req: ClientRequest) -> int:
        self.exact_calls += 1
        return len(req.prompt or "")

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        self.limits.append(limit)
        return self.found


def harness(counter: Scripted) -> BrokerHarness:
    h = BrokerHarness(replace(FAST, default_timeout_ms=5000))
    h.broker.gate.count_tokens = counter
    h.ready(W1, 0.0)
    h.drain_workers()
    return h


def test_the_counter_is_a_bounded_one() -> None:
    assert isinstance(Scripted(TokenCount(1, exact=True)), TokenCounter)


def test_a_lower_bound_over_the_limit_is_refused_without_an_exact_count() -> None:
    counter = Scripted(TokenCount(5209, exact=False))
    h = harness(counter)
    h.send(generate("huge", "w" * 3000, max_tokens=MAX_TOKENS), 0.0)
    [reply] = h.replies()
    assert (reply["code"], reply["reason"]) == (413, "too_large")
    assert reply["message"] == (
        "prompt at least 5209 tokens + max_tokens 48 = 5257 exceeds the context of 2048 tokens"
    )
    assert counter.limits == [LIMIT] and counter.exact_calls == 0
    h.assert_each_answered_once()


def test_an_exact_count_over_the_limit_says_so() -> None:
    h = harness(Scripted(TokenCount(2001, exact=True)))
    h.send(generate("big", "w" * 3000, max_tokens=MAX_TOKENS), 0.0)
    [reply] = h.replies()
    assert reply["message"] == (
        "prompt 2001 tokens + max_tokens 48 = 2049 exceeds the context of 2048 tokens"
    )


def test_prompts_whose_bytes_fit_are_not_counted_at_all() -> None:
    counter = Scripted(TokenCount(10**6, exact=False))
    h = harness(counter)
    h.send(generate("small", "w" * (LIMIT - 1), max_tokens=MAX_TOKENS), 0.0)  # + BOS
    assert counter.limits == []
    assert bodies(h.drain_workers(), W1, REQUEST)


def test_an_undecided_prompt_goes_to_the_worker_which_counts_exactly() -> None:
    counter = Scripted(TokenCount(700, exact=False))  # under the limit: undecided
    h = harness(counter)
    h.send(generate("maybe", "w" * 3000, max_tokens=MAX_TOKENS), 0.0)
    assert h.replies() == []
    [sent] = bodies(h.drain_workers(), W1, REQUEST)
    assert sent["prompt"] == "w" * 3000 and counter.exact_calls == 0
    h.final(W1, sent["rid"], 0.5, status="error", code=413, message="exceeds context window")
    [reply] = h.replies()
    assert reply["code"] == 413
    h.assert_each_answered_once()


def learn(h: BrokerHarness, tokens_per_byte: float) -> None:
    """One finished request: ``tokens_per_byte``, 2 ms per prompt token, 20 ms per
    generated token (and every request generates all it may)."""
    req = ClientRequest(id="seen", op="generate", prompt="x" * 999, max_tokens=10)
    prompt = int(1000 * tokens_per_byte)
    ttft = 0.002 * prompt + 0.02
    usage = {"prompt_tokens": prompt, "completion_tokens": 10}
    h.broker.estimator.sizes.observe("llm", req, 10, ttft, ttft + 0.18, usage)
    h.broker.estimator.observe_service(ttft + 0.18)


def test_an_undecided_prompt_is_predicted_no_longer_than_the_largest_that_fits() -> None:
    """Its bytes suggest 3000 tokens (6 s of prefill + 1 s of decode: over the 5.5 s
    budget), but a prompt over 2000 tokens is refused by its worker at once: at
    most 2000 run (4 s + 1 s)."""
    h = harness(Scripted(TokenCount(700, exact=False)))
    learn(h, tokens_per_byte=1.0)
    h.send(generate("maybe", "w" * 2999, max_tokens=MAX_TOKENS, timeout_ms=5500), 0.0)
    assert h.replies() == []
    assert bodies(h.drain_workers(), W1, REQUEST)


def test_a_lower_bound_raises_the_estimate_of_an_undecided_prompt() -> None:
    """Its bytes suggest 750 tokens, the bound says at least 1990: the bound counts."""
    h = harness(Scripted(TokenCount(1990, exact=False)))
    learn(h, tokens_per_byte=0.25)
    h.send(generate("dense", "w" * 2999, max_tokens=MAX_TOKENS), 0.0)
    [job] = list(h.broker.jobs)
    assert job.prompt_tokens == 1990
