"""The human view of ``edgenode status``: one row per worker, the nice column."""

from __future__ import annotations

from typing import Any

from node.status_view import render_status


def _proc(wid: str, nice: int | None, group: int | None) -> dict[str, Any]:
    return {
        "worker_id": wid,
        "state": "ready",
        "pid": 4242,
        "restarts": 0,
        "cpus": [1],
        "threads": 1,
        "nice": nice,
        "autogroup_nice": group,
        "memory": {"current": 150 * 2**20, "limit": 2**30, "peak": 160 * 2**20},
        "oom_kills": 0,
        "last_exit": None,
    }


def test_the_worker_table_shows_the_nice_level_and_a_differing_autogroup() -> None:
    status = {
        "pid": 1,
        "model": "/m/gemma.gguf",
        "engine": "llama",
        "queue_depth": 0,
        "queue_bound": 16,
        "in_flight": 0,
        "credit": 2,
        "processes": [
            _proc("llm-0", 10, 10),  # the autogroup follows: one number
            _proc("llm-1", 10, 0),  # it does not: both, so the operator sees why
            _proc("rules-0", 0, None),  # no autogroups on this host
            _proc("llm-2", None, None),  # not running
        ],
    }
    lines = render_status(status).splitlines()
    header = next(line for line in lines if line.startswith("WORKER"))
    assert "NICE" in header.split()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("llm", "rules"))}
    col = header.split().index("NICE")
    assert rows["llm-0"][col] == "10"
    assert rows["llm-1"][col] == "10/0"
    assert rows["rules-0"][col] == "0"
    assert rows["llm-2"][col] == "-"
