"""The human view of ``edgenode status``: one row per worker, the nice column."""

from __future__ import annotations

from typing import Any

from node.cli.status_view import render_status
from node.config import WorkersSection
from node.sandbox.cores import plan_workers


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


def _capacity(**plan: Any) -> dict[str, Any]:
    return {
        "queue_depth": 0,
        "queue_bound": 64,
        "in_flight": 0,
        "credit": 8,
        "capacity": {
            "per_worker": 440 * 2**20,
            "grammar": 176 * 2**20,
            "memory_max": 507_514_880,
            "total": 1_169_162_240,
            "budget": 8 * 2**30,
            "worker_limits": {"setting": "auto", "memory_max": 507_514_880, "memory_high": 1},
            **plan,
        },
    }


def _capacity_line(status: dict[str, Any]) -> str:
    lines = [x for x in render_status(status).splitlines() if x.startswith("capacity")]
    assert len(lines) == 1  # one line, whatever the layout
    return lines[0]


def test_the_capacity_line_shows_workers_times_slots() -> None:
    line = _capacity_line(_capacity(workers=2, slots=4, sequences=8))
    assert line.startswith("capacity plan: 2 workers x 4 slots = 8 sequences, 440 MiB per worker")
    # With "auto" the workers get the plan's memory.max: said once, not twice.
    assert line.count("484 MiB") == 1
    assert 'workers get memory.max 484 MiB (workers.memory_max = "auto")' in line
    single = _capacity_line(_capacity(workers=1, slots=1, sequences=1))
    assert single.startswith("capacity plan: 1 worker x 1 slot = 1 sequence, 440 MiB per worker")


def test_a_fixed_limit_shows_the_plans_memory_max_too() -> None:
    status = _capacity(workers=2, slots=1, sequences=2)
    status["capacity"]["worker_limits"] = {"setting": "1G", "memory_max": 2**30}
    line = _capacity_line(status)
    assert "(plan's memory.max 484 MiB); workers get memory.max 1 GiB" in line


def test_a_plan_without_slots_shows_no_layout() -> None:
    # A node from before workers.slots: the line is the old one.
    assert _capacity_line(_capacity()).startswith("capacity plan: 440 MiB per worker")


def test_the_credit_column_is_free_slots_of_the_workers_slots() -> None:
    status = _capacity(workers=2, slots=4, sequences=8)
    status["processes"] = [_proc("llm-0", 10, 10), _proc("llm-1", 10, 10), _proc("rules-0", 0, 0)]
    status["workers"] = [
        {"worker_id": "llm-0", "state": "busy", "credit": 1, "slots": 4},
        {"worker_id": "llm-1", "state": "ready", "credit": 4, "slots": 4},
        {"worker_id": "rules-0", "state": "ready", "credit": 1, "slots": 1},
    ]
    lines = render_status(status).splitlines()
    header = next(line for line in lines if line.startswith("WORKER")).split()
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("llm", "rules"))}
    col = header.index("CREDIT")
    assert (rows["llm-0"][col], rows["llm-1"][col], rows["rules-0"][col]) == ("1/4", "4/4", "1/1")
    assert rows["llm-0"][header.index("STATE")] == "busy"


def test_replies_to_clients_get_their_own_line() -> None:
    status = {
        "pid": 1,
        "model": "/m/gemma.gguf",
        "engine": "test",
        "queue_depth": 0,
        "queue_bound": 16,
        "in_flight": 0,
        "credit": 2,
        "counters": {
            "ok": 20,
            "client_gone": 1,
            "finals_delivered": 22,
            "finals_backlogged": 12,
            "finals_undeliverable": 1,
            "partials_delivered": 2500,
            "partials_dropped": 3560,
        },
        "delivery": {"backlog": 3, "backlog_clients": 1, "max_backlog": 64},
    }
    lines = render_status(status).splitlines()
    (requests,) = [line for line in lines if line.startswith("requests:")]
    assert requests == "requests: client_gone 1, ok 20"
    (replies,) = [line for line in lines if line.startswith("replies:")]
    assert replies == (
        "replies: finals 22 delivered (every op's, status included), 12 waited, 1 undeliverable; "
        "partials 2500 delivered,"
        " 3560 dropped; waiting now 3 for 1 client(s) (max 64 each), 0 overflowed"
    )


def test_the_security_line_shows_each_side_and_its_refusals() -> None:
    status = _capacity(workers=1, slots=1, sequences=1)
    status["security"] = {"frontend": "curve", "backend": "plaintext"}
    status["refused"] = {
        "frontend": {"key_not_allowed": 2, "handshake_failed": 5},
        "backend": {"key_not_allowed": 0, "handshake_failed": 0},
    }
    assert (
        "security: frontend curve (refused 2 keys, 5 handshakes), backend plaintext"
        in render_status(status).splitlines()
    )


def test_remote_workers_get_a_table_of_their_own_and_local_ones_stay_in_theirs() -> None:
    status = {
        "pid": 1,
        "model": "/m/gemma.gguf",
        "engine": "llama",
        "queue_depth": 0,
        "queue_bound": 16,
        "in_flight": 1,
        "credit": 4,
        "processes": [_proc("llm-0", 10, 10)],
        "workers": [
            {"worker_id": "llm-0", "state": "ready", "credit": 1, "slots": 1, "remote": False},
            {
                "worker_id": "boardb.llm-0",
                "host": "boardb",
                "remote": True,
                "state": "busy",
                "pid": 777,
                "credit": 3,
                "slots": 4,
                "cpus": [1, 2, 3],
                "threads": 3,
                "last_seen_ms": 120,
            },
        ],
    }
    lines = render_status(status).splitlines()
    header = lines.index(next(line for line in lines if line.startswith("REMOTE WORKER")))
    assert lines[header + 1].split() == [
        "boardb.llm-0",
        "boardb",
        "busy",
        "777",
        "3/4",
        "1-3",  # its cores, as the local table lists them
        "3",
        "120ms",
    ]
    assert not any(line.startswith("llm-0") for line in lines[header:])
    assert sum(line.startswith("boardb.llm-0") for line in lines) == 1
    # A node without remote workers shows no such table.
    status["workers"] = status["workers"][:1]
    assert not any(line.startswith("REMOTE") for line in render_status(status).splitlines())


def test_the_security_line_says_when_no_client_key_is_allowed() -> None:
    status = _capacity(workers=1, slots=1, sequences=1)
    status["security"] = {"frontend": "curve", "backend": "curve"}
    status["refused"] = {"frontend": {"key_not_allowed": 3, "handshake_failed": 0}}
    status["allowed_keys"] = {"frontend": 0, "backend": 0}
    assert (
        "security: frontend curve (no client key allowed: only this host; refused 3 keys,"
        " 0 handshakes), backend curve" in render_status(status).splitlines()
    )
    status["allowed_keys"] = {"frontend": 2, "backend": 0}
    assert "security: frontend curve (refused 3 keys, 0 handshakes), backend curve" in (
        render_status(status).splitlines()
    )


def test_a_loading_worker_shows_its_progress_and_its_last_exit() -> None:
    loading = {
        "cpu_s": 12.34,
        "rss_bytes": 310 * 2**20,
        "idle_ms": 200,
        "loading_ms": 45_000,
        "cap_ms": 600_000,
    }
    first = {**_proc("llm-0", 10, 10), "state": "starting", "loading": loading}
    again = {**first, "worker_id": "llm-1", "last_exit": "not READY within 60s (killed by SIGKILL)"}
    status = {
        "pid": 1,
        "queue_depth": 0,
        "queue_bound": 16,
        "in_flight": 0,
        "credit": 1,
        "processes": [first, again, _proc("rules-0", 0, None)],
    }
    lines = render_status(status).splitlines()
    rows = {line.split()[0]: line for line in lines if line.startswith(("llm", "rules"))}
    assert rows["llm-0"].endswith("loading 12.3s CPU, 310 MiB in 45s, progress 0.2s ago")
    assert rows["llm-1"].endswith(
        "loading 12.3s CPU, 310 MiB in 45s, progress 0.2s ago; "
        "not READY within 60s (killed by SIGKILL)"
    )
    assert "loading" not in rows["rules-0"]


def test_a_budget_lowered_after_start_shows_on_the_plans_line() -> None:
    """Break-it finding (session 13): a parent's memory limit lowered to 1 GiB while
    the node ran showed on the pressure line within 2 s, but the plan's line still
    said "in all of 23.5 GiB" while ``edgenode capacity`` said DOES NOT FIT."""
    status = _capacity(workers=1, slots=4, sequences=4)
    status["memory"] = {"level": "high", "working_set": 700 * 2**20, "budget": 2**30}
    line = _capacity_line(status)
    assert "in all of 8 GiB at start; the budget is now 1 GiB: DOES NOT FIT;" in line
    status["memory"]["budget"] = 4 * 2**30  # lowered, and the plan still fits
    assert "at start; the budget is now 4 GiB: fits;" in _capacity_line(status)
    status["memory"]["budget"] = 8 * 2**30
    assert "at start" not in _capacity_line(status)


def test_the_nodes_own_pressure_budget_is_not_a_lowered_one() -> None:
    """Break-it finding (session 15): a fresh node with no cgroup limit on its path said
    "in all of 23.5 GiB at start; the budget is now 1.4 GiB: fits": the pressure budget
    it computes itself (its workers' limits plus its share) read as a lowered limit."""
    status = _capacity(workers=1, slots=4, sequences=4)
    status["memory"] = {"level": "ok", "working_set": 700 * 2**20, "budget": 2**30}
    status["memory"]["budget_kind"] = "node"
    assert "at start" not in _capacity_line(status)
    status["memory"]["budget_kind"] = "cgroup"
    assert "at start; the budget is now 1 GiB" in _capacity_line(status)


def _cores_line(cores: dict[str, Any] | None) -> str | None:
    status = _capacity()
    if cores is not None:
        status["cores"] = cores
    lines = render_status(status).splitlines()
    found = [line for line in lines if line.startswith("cores: ")]
    return found[0] if found else None


def test_the_cores_line_says_what_the_host_keeps() -> None:
    plan = plan_workers(WorkersSection(), allowed=(0, 1))
    line = _cores_line(plan.describe(WorkersSection().cpus))
    assert line == (
        'cores: workers on 1; the node on 1; the host keeps 0 alone (workers.cpus = "auto")'
    )
    listed = plan_workers(WorkersSection(cpus=(2, 3)), node_cpus=[1], allowed=range(4))
    assert _cores_line(listed.describe((2, 3))) == (
        "cores: workers on 2-3; the node on 1; the host keeps 0 alone (workers.cpus = [2, 3])"
    )
    # The node on the host's core: no core is the host's alone any more.
    on_host = plan_workers(WorkersSection(), node_cpus=[0], allowed=(0, 1))
    assert on_host.describe("auto")["host"] == []
    assert _cores_line(on_host.describe("auto")) == (
        'cores: workers on 1; the node on 0; no core is the host\'s alone (workers.cpus = "auto")'
    )
    shared = plan_workers(WorkersSection(cpus=()), allowed=(0, 1))
    assert _cores_line(shared.describe(())) == (
        "cores: workers on 0-1, shared with the host below it by nice; the node on any; "
        "no core is the host's alone (workers.cpus = [])"
    )
    # An app embedding the node under "auto": its threads (the broker's) stay anywhere.
    embedded = plan_workers(WorkersSection(), allowed=(0, 1), embedded=True)
    assert embedded.describe("auto") == {
        "setting": "auto",
        "reserved": True,
        "workers": [1],
        "node": [],
        "host": [],
    }
    # "auto" on a one-core host reserves nothing.
    alone = plan_workers(WorkersSection(), allowed=(0,))
    assert _cores_line(alone.describe("auto")) == (
        "cores: workers on 0, shared with the host below it by nice; the node on any; "
        'no core is the host\'s alone (workers.cpus = "auto")'
    )
    assert _cores_line(None) is None  # an older node's status: no line


def test_an_unpinned_worker_shows_the_cores_it_reported() -> None:
    status = _capacity()
    unpinned = {**_proc("llm-0", 10, 10), "cpus": []}
    status["processes"] = [unpinned]
    status["workers"] = [{"worker_id": "llm-0", "state": "ready", "credit": 4, "slots": 4}]
    row = next(line for line in render_status(status).splitlines() if line.startswith("llm-0"))
    assert row.split()[5] == "all"  # no plan and no READY affinity: nothing narrower known
    status["workers"][0]["cpus"] = [1]  # READY: a node started under taskset -c 1
    row = next(line for line in render_status(status).splitlines() if line.startswith("llm-0"))
    assert row.split()[5] == "1"
