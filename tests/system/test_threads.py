"""The llama engine's compute threads under starvation, with the real model
(``node.llama.threads``, ``LlamaEngine._adapt_threads``, ``_starved_inside``).

* Real starvation, made deterministic: every thread of this process and one
  nice-0 busy loop pinned to the same core, so the engine's two compute threads and
  the loop share one core (each waits for it about half the time or more, against a
  threshold of 40 %). The engine drops to one thread.
* The engine's reaction, with injected readings (``read_task_times`` replaced by
  a fake whose figures follow the real clock): the drop happens inside a long
  prompt step, which stops and runs again on one thread without changing the
  text; after the hold a probe goes back to two threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import llama_cpp.llama_cpp as llama_c
import pytest

import node.llama.engine as engine_module
import node.llama.threads as threads_module
from node.engine import EngineSpec
from node.llama.engine import LlamaEngine
from node.model import resolve_model
from node.sandbox.cores import pin_all_threads

pytestmark = [pytest.mark.system, pytest.mark.timeout(60)]

#: ~500 tokens: one prompt chunk (n_batch 512) of about a second on two threads,
#: longer than a starved streak of the fake host's windows (2 x 0.2 s).
LONG_PROMPT = "The valve opened and the pressure fell. " * 55


def spec(adaptive: bool = True) -> EngineSpec:
    return EngineSpec(
        "llama",
        str(resolve_model("default")),
        n_ctx=2048,
        n_batch=512,
        threads=2,
        slots=2,
        adaptive_threads=adaptive,
        flash_attn=False,  # the prompt in one step (under it, steps of 63 prompt tokens)
    )


def greedy(prompt: str, tokens: int) -> dict[str, Any]:
    return {"op": "generate", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}


def evict(engine: LlamaEngine) -> None:
    """Two unrelated requests in both slots at once: no slot keeps a cached prompt
    prefix, so the next prompt is evaluated whole."""
    for rid, prompt in enumerate(("Red", "Blue")):
        engine.submit(100 + rid, greedy(prompt, 1), threading.Event(), lambda _: None)
    while engine.busy:
        engine.step()


def llama_threads(engine: LlamaEngine) -> tuple[int, int]:
    """What llama.cpp itself says it computes with: (n_threads, n_threads_batch)."""
    ctx = engine._ctx  # the context itself: the thing under test
    return llama_c.llama_n_threads(ctx), llama_c.llama_n_threads_batch(ctx)


class FakeHost:
    """Readings of one compute thread that waits ``share`` of the real time since
    the last change of ``share``, cumulative as the kernel's are."""

    def __init__(self) -> None:
        self.share = 0.0
        self.at = time.monotonic()
        self.run_ns = self.wait_ns = 0
        self.reads = 0

    def set(self, share: float) -> None:
        self._advance()
        self.share = share

    def _advance(self) -> None:
        now = time.monotonic()
        spent = (now - self.at) * 1e9
        self.run_ns += round(spent * (1 - self.share))
        self.wait_ns += round(spent * self.share)
        self.at = now

    def __call__(self) -> dict[int, tuple[int, int]]:
        self._advance()
        self.reads += 1
        return {1: (self.run_ns, self.wait_ns)}


@pytest.fixture
def fake_host(monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    host = FakeHost()
    monkeypatch.setattr(engine_module, "read_task_times", host)
    monkeypatch.setattr(threads_module, "HOLD_S", 1.0)  # a probe within the test's time
    # Shorter windows: a starved streak (STARVED_WINDOWS of them) well inside the
    # long prompt's step, however fast the machine.
    monkeypatch.setattr(threads_module, "WINDOW_S", 0.2)
    monkeypatch.setattr(engine_module, "WINDOW_S", 0.2)
    return host


@pytest.fixture
def engine() -> Iterator[LlamaEngine]:
    made = LlamaEngine(spec())
    yield made
    made.close()


def test_starved_inside_a_prompt_step_it_runs_again_on_one_thread_then_probes_back(
    fake_host: FakeHost, engine: LlamaEngine
) -> None:
    quiet_text = engine.run(greedy(LONG_PROMPT, 16), threading.Event(), lambda _: None)["text"]
    assert engine.compute_threads == 2 and llama_threads(engine) == (2, 2)
    assert engine.starved_aborts == 0

    evict(engine)
    assert engine.compute_threads == 2
    fake_host.set(0.9)  # the compute thread now waits 90 % of the time
    streamed: list[str] = []
    engine.submit(1, greedy(LONG_PROMPT, 16), threading.Event(), streamed.append)
    outcome = engine.step()  # the prompt chunk: stopped inside llama_decode
    assert outcome == [] and engine.starved_aborts == 1 and engine.aborts == 0
    assert engine.compute_threads == 1 and llama_threads(engine) == (1, 1)
    ended = []
    while engine.busy:
        ended += engine.step()
    assert ended[0][1]["text"] == quiet_text == "".join(streamed)  # type: ignore[index]

    # The host goes quiet: after the hold (1 s here) and one window, a probe runs
    # two threads again, and a quiet probe keeps them.
    fake_host.set(0.0)
    deadline = time.monotonic() + 20
    engine.submit(2, greedy("Once upon a time", 400), threading.Event(), lambda _: None)
    while engine.compute_threads == 1 and time.monotonic() < deadline:
        engine.step()
    assert engine.compute_threads == 2 and llama_threads(engine) == (2, 2)
    while engine.busy:
        engine.step()
    assert engine.compute_threads == 2


def test_without_adaptive_threads_the_count_never_changes(fake_host: FakeHost) -> None:
    fixed = LlamaEngine(spec(adaptive=False))
    try:
        fake_host.set(0.9)
        fixed.run(greedy(LONG_PROMPT, 8), threading.Event(), lambda _: None)
        assert fixed.compute_threads == 2 and llama_threads(fixed) == (2, 2)
        assert fake_host.reads == 0 and fixed.starved_aborts == 0
    finally:
        fixed.close()


def test_real_starvation_on_one_shared_core_drops_to_one_thread(engine: LlamaEngine) -> None:
    """This process's threads (the engine's two compute threads among them) and a
    nice-0 busy loop on one core: the kernel's own accounting shows the wait."""
    engine.run(greedy("Hello", 2), threading.Event(), lambda _: None)  # OpenMP's team exists
    allowed, cancel = os.sched_getaffinity(0), threading.Event()
    core = max(allowed)
    loop = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        pin_all_threads({core})
        deadline = time.monotonic() + 20
        prompt = greedy("The history of the bicycle", 1000)
        engine.submit(1, prompt, cancel, lambda _: None)
        while engine.compute_threads == 2 and engine.busy and time.monotonic() < deadline:
            engine.step()
        assert engine.compute_threads == 1 and llama_threads(engine) == (1, 1)
    finally:
        loop.kill()
        loop.wait()
        pin_all_threads(allowed)
        cancel.set()
        while engine.busy:
            engine.step()
