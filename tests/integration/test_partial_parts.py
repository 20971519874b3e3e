"""Tokens that reach a worker's I/O thread together leave it as one PARTIAL
(``parts``, PROTOCOL §13.2); each client still gets every piece, in order,
as its own ``partial`` reply, and the text of its final is their sum."""

from __future__ import annotations

from collections.abc import Callable

from node.testing import Collector, NodeProcess

NodeFactory = Callable[..., NodeProcess]

WORDS = 40


def test_four_streams_at_full_speed_each_get_every_piece_in_order(
    make_node: NodeFactory,
) -> None:
    # test_token_ms 0: four engine threads emit as fast as they can, so their
    # tokens pile up at the I/O thread and share PARTIALs.
    node = make_node(workers={"count": 1, "slots": 4, "test_token_ms": 0})
    col = Collector(node.frontend)
    try:
        for i in range(4):
            prompt = " ".join(f"s{i}w{j}" for j in range(WORDS))
            col.send(id=f"s{i}", op="generate", prompt=prompt, max_tokens=WORDS + 1, stream=True)
        col.collect(timeout=30)
        col.assert_exactly_one_final_each()
    finally:
        col.close()
    for i in range(4):
        replies = col.replies[f"s{i}"]
        partials, final = replies[:-1], replies[-1]
        expected = "echo:" + "".join(f" s{i}w{j}" for j in range(WORDS))
        assert final["status"] == "ok", final
        assert final["text"] == expected
        assert [r["index"] for r in partials] == list(range(WORDS + 1))
        assert "".join(r["text"] for r in partials) == expected
        assert "dropped_partials" not in final
    counters = node.status()["counters"]
    assert counters.get("worker_protocol_errors", 0) == 0
