"""A ``Client`` shared by threads fails loudly: a call from a second thread while
another thread's call is using the client raises ``ClientInUse`` at once, and
the first call's reply is not lost. Real node, test engine."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from broker.client import Client, ClientInUse, Reply
from broker.errors import EdgeNodeError
from node.testing import NodeProcess, wait_for

NodeFactory = Callable[..., NodeProcess]

#: 1 + 20 pieces at 100 ms: a call in progress for about 2 s.
SLOW = "!slow 100 " + " ".join(f"w{i}" for i in range(18))


def test_a_second_thread_gets_client_in_use(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1, "slots": 2})
    results: list[Reply | EdgeNodeError] = []
    with Client(node.frontend, wait_ms=10_000) as shared, node.client() as observer:

        def slow_call() -> None:
            try:
                results.append(shared.generate(SLOW, max_tokens=50))
            except EdgeNodeError as exc:
                results.append(exc)

        first = threading.Thread(target=slow_call, name="first")
        first.start()
        wait_for(lambda: observer.status()["in_flight"] == 1, timeout=5)
        with pytest.raises(ClientInUse) as caught:
            shared.generate("second", max_tokens=2)
        assert caught.value.reason == "client_in_use"
        assert "'first'" in caught.value.message and "thread-safe" in caught.value.message
        first.join(timeout=20)
        assert len(results) == 1 and isinstance(results[0], Reply), results
        assert results[0].text == "echo: " + SLOW
        # The refused call sent nothing; the client serves this thread now.
        assert observer.status()["counters"]["admitted"] == 1
        assert shared.generate("after", max_tokens=2).text == "echo: after"


def test_threads_taking_turns_share_a_client(make_node: NodeFactory) -> None:
    """Not at once: calls from several threads, one after another, all answered."""
    node = make_node(workers={"count": 1, "slots": 2})
    with Client(node.frontend, wait_ms=10_000) as shared:
        turn = threading.Lock()
        texts: list[str] = []

        def calls(k: int) -> None:
            for i in range(5):
                with turn:
                    texts.append(shared.generate(f"t{k} i{i}", max_tokens=3).text)

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(texts) == sorted(f"echo: t{k} i{i}" for k in range(3) for i in range(5))
