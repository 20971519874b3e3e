"""node.bench.load's arithmetic: goodput over the window or until the backlog is served."""

from __future__ import annotations

from node.bench.load import Reply, Run


def reply(status: str, at_s: float) -> Reply:
    return Reply({"id": f"r{at_s}", "status": status}, rtt_ms=10.0, at_s=at_s)


def test_goodput_counts_only_ok_replies_over_the_window() -> None:
    replies = [reply("ok", t / 10) for t in range(1, 41)] + [reply("error", 1.0)] * 30
    run = Run(replies, sent=72, window_s=5.0, elapsed_s=5.2)
    assert run.served_per_s() == 40 / 5.0
    assert run.lost == 2
    assert [r.ok for r in replies[39:41]] == [True, False]


def test_a_backlog_served_after_the_window_counts_with_its_time() -> None:
    # 10 served in the 2 s window, 10 more from the queue until 4 s: 5 req/s, not 10.
    replies = [reply("ok", 0.2 * i) for i in range(1, 21)]
    run = Run(replies, sent=20, window_s=2.0, elapsed_s=4.0)
    assert run.served_per_s() == 20 / 4.0
    assert Run([], sent=3, window_s=2.0, elapsed_s=2.0).served_per_s() == 0.0
