"""``node.engine.BackgroundCounter``: the broker's token counter loads on a thread of its
own (after the workers are ready, ``node.app``); until then it learns nothing of a
prompt (a lower bound of 0: the worker decides), then answers as the loaded counter."""

from __future__ import annotations

import threading

import pytest

from broker.client_request import ClientRequest
from broker.token_count import TokenCount, TokenCounter
from node.engine import BackgroundCounter, WordCounter


def request(prompt: str) -> ClientRequest:
    return ClientRequest(id=1, op="generate", prompt=prompt, max_tokens=4)


class HeldLoad:
    """A load that ends when the test says so, on the counter's own thread."""

    def __init__(self, fail: bool = False) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []
        self.fail = fail

    def __call__(self) -> TokenCounter:
        self.threads.append(threading.current_thread().name)
        assert self.release.wait(10)
        if self.fail:
            raise ValueError("llama.cpp could not read the vocabulary")
        return WordCounter()


def test_it_learns_nothing_until_loaded_then_answers_as_the_loaded_counter() -> None:
    load = HeldLoad()
    counter = BackgroundCounter(load)
    assert isinstance(counter, TokenCounter)
    prompt = request("one two three four five")
    assert counter.state == "waiting"
    assert counter.bounded(prompt, 3) == TokenCount(0, exact=False)
    counter.start()
    counter.start()  # once: a second call starts nothing
    assert counter.state == "loading"
    assert counter.bounded(prompt, 3) == TokenCount(0, exact=False)
    load.release.set()
    assert counter(prompt) == 5  # waits for the load
    assert counter.state == "loaded"
    assert counter.bounded(prompt, 3) == TokenCount(5, exact=True)
    assert load.threads == ["token-counter"]  # loaded once, off the caller's thread


def test_a_failed_load_leaves_sizes_to_the_workers(caplog: pytest.LogCaptureFixture) -> None:
    load = HeldLoad(fail=True)
    counter = BackgroundCounter(load)
    counter.start()
    load.release.set()
    with pytest.raises(RuntimeError, match="could not be loaded"):
        counter(request("a b"))
    assert counter.state == "failed"
    assert counter.bounded(request("a b c"), 1) == TokenCount(0, exact=False)
    assert "could not read the vocabulary" in caplog.text
