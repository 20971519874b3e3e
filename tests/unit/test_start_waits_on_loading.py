"""``edgenode start`` past ``--wait-s``: it reads the node's ``processes[].loading``
(``node.cli.main._StillLoading``) and waits on while every worker not ready is the same
process still loading, until the supervisor's reported cap; it never judges a load itself."""

from __future__ import annotations

from typing import Any

from node.cli.main import _StillLoading


def row(worker_id: str, state: str, pid: int | None, loading_ms: int | None = None) -> Any:
    """A ``processes`` row of ``status``; ``loading_ms``: a load report (cap 600 s)."""
    loading = (
        None
        if loading_ms is None
        else {
            "cpu_s": 1.0,
            "rss_bytes": 1 << 20,
            "idle_ms": 100,
            "loading_ms": loading_ms,
            "cap_ms": 600_000,
        }
    )
    return {
        "worker_id": worker_id,
        "pid": pid,
        "state": state,
        "restarts": 0,
        "last_exit": "",
        "loading": loading,
    }


def test_loading_workers_are_waited_on_until_the_latest_reported_cap() -> None:
    processes = [row("llm-0", "starting", 11, 180_000), row("llm-1", "starting", 12, 100_000)]
    loading = _StillLoading.judge(processes, None, now=1000.0)
    assert loading is not None
    assert loading.pids == {"llm-0": 11, "llm-1": 12}
    assert loading.until == 1000.0 + 500.0  # llm-1 has 500 s of its cap left
    assert loading.cap_s == 600.0


def test_a_ready_worker_does_not_count_and_the_wait_end_stays_put() -> None:
    first = [row("llm-0", "ready", 11), row("llm-1", "starting", 12, 100_000)]
    loading = _StillLoading.judge(first, None, now=1000.0)
    assert loading is not None and loading.pids == {"llm-1": 12}
    later = [row("llm-0", "ready", 11), row("llm-1", "starting", 12, 160_000)]
    assert _StillLoading.judge(later, loading, now=1060.0) is loading


def test_a_worker_respawned_since_the_last_poll_ends_the_wait() -> None:
    before = _StillLoading.judge([row("llm-0", "starting", 11, 100_000)], None, now=0.0)
    assert _StillLoading.judge([row("llm-0", "starting", 13, 1_000)], before, now=5.0) is None


def test_a_worker_not_ready_and_not_loading_ends_the_wait() -> None:
    for other in (row("llm-1", "restarting", None), row("llm-1", "starting", None)):
        assert _StillLoading.judge([row("llm-0", "starting", 11, 1), other], None, 0.0) is None


def test_nothing_pending_is_no_wait() -> None:
    assert _StillLoading.judge([row("llm-0", "ready", 11)], None, now=0.0) is None
