"""Whose memory limit OOM-killed a model worker, on fake cgroupfs trees: the pool's
exit cause (``WorkerPool._explain`` with the reading ``_prepare`` kept at the spawn).

A kill at the worker's own ``memory.max`` blames its request (not run again); one
by a limit above its cgroup (the node's tree, a parent slice, the machine) blames
nothing. The fault these tests were written for: the verdict used the worker's
lifetime peak, so a worker that once came within 10 % of its own limit (a big
``json_schema`` request earlier) and was later killed by the tree's limit had its
current request blamed. The kernel's counters since the spawn tell them apart:
v2 the worker's own ``oom`` event (``memory.events``), v1 the ancestors'
``memory.failcnt`` (kernel 6.18 counts a hit at a worker's own v1 limit in no
failcnt; one at the tree's limit in the tree's: measured, README "Lost work").
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sandbox import EVENTS, SERVICE, FakeKernel, v1_host, v2_host

from broker.exits import ExitCause
from capacitykit import memory_reading
from node.config import from_dict
from node.pool import WorkerPool
from node.sandbox.cgroups import Sandbox
from node.sandbox.driver import MemoryReading, SandboxOptions, killed_by_own_limit

MiB = 2**20
WORKER = "llm-0"
KILLED = ExitCause(signal="SIGKILL")


@pytest.fixture
def kernel(tmp_path: Path) -> FakeKernel:
    return FakeKernel(tmp_path / "host")


def pool_on(kernel: FakeKernel, tmp_path: Path) -> WorkerPool:
    """A one-worker pool (test engine, memory_max 256 MiB) whose sandbox is opened on
    the fake kernel, and its worker's cgroup made as for a spawn (``_prepare``)."""
    config = from_dict(
        {"workers": {"engine": "test", "count": 1, "memory_max": "256M", "sandbox": "off"}}
    )
    pool = WorkerPool(config, "test", None, tmp_path / "run")
    pool.sandbox = Sandbox(SandboxOptions(mode="required"), kernel.host())
    pool.sandbox.open()
    pool._prepare(pool.specs[0])
    return pool


def bump(path: Path, key: str, by: int = 1) -> None:
    """Add ``by`` to one line of a flat keyed file (``memory.events``, ``memory.oom_control``)."""
    lines = []
    for line in path.read_text().splitlines():
        name, value = line.split()
        lines.append(f"{name} {int(value) + by if name == key else value}")
    path.write_text("\n".join(lines) + "\n")


def add(path: Path, by: int) -> None:
    """Add ``by`` to a counter file (``memory.failcnt``)."""
    path.write_text(str(int(path.read_text()) + by))


# ---------------------------------------------------------------- cgroup v1


def v1_worker(kernel: FakeKernel, tmp_path: Path) -> tuple[WorkerPool, Path, Path]:
    """(pool, the node's tree, the worker's cgroup) on a v1 host."""
    dirs = v1_host(kernel, hybrid=False)
    pool = pool_on(kernel, tmp_path)
    base = dirs["memory"] / "edgenode"
    return pool, base, base / f"worker-{WORKER}"


def test_v1_a_kill_by_the_trees_limit_after_a_peak_near_its_own_is_not_blamed(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    """The user's case: 240 MiB of 256 held earlier (a json_schema), then the tree's
    lowered limit is hit (its failcnt rises, 92 on the dev machine) and the kernel
    kills the worker. The peak alone read as its own limit and blamed the request."""
    pool, base, worker = v1_worker(kernel, tmp_path)
    assert (worker / "memory.limit_in_bytes").read_text() == str(256 * MiB)
    (worker / "memory.max_usage_in_bytes").write_text(str(240 * MiB))
    add(base / "memory.failcnt", 92)
    bump(worker / "memory.oom_control", "oom_kill")
    cause = pool._explain(WORKER, KILLED)
    assert cause.oom_killed and cause.oom_above, cause
    assert cause.describe() == (
        "OOM-killed by a memory limit above its cgroup (peak 240 MiB, memory.max 256 MiB)"
        " (killed by SIGKILL)"
    )
    assert pool.oom_kills[WORKER] == 1


def test_v1_a_limit_hit_higher_up_the_path_counts_too(kernel: FakeKernel, tmp_path: Path) -> None:
    """A parent slice above the node's tree (its memsw counter: swap accounting on)."""
    pool, base, worker = v1_worker(kernel, tmp_path)
    (worker / "memory.max_usage_in_bytes").write_text(str(250 * MiB))
    slice_ = base.parent.parent
    assert slice_.name == SERVICE.split("/")[1]
    add(slice_ / "memory.memsw.failcnt", 3)
    bump(worker / "memory.oom_control", "oom_kill")
    assert pool._explain(WORKER, KILLED).oom_above


def test_v1_a_kill_at_its_own_limit_blames_the_request(kernel: FakeKernel, tmp_path: Path) -> None:
    """No ancestor hit its limit since the spawn (hits before it do not count) and
    the peak reached its own: its own limit did it. The worker's own failcnt is no
    evidence either way (kernel 6.18 left it at 0 for such a kill)."""
    pool, _, worker = v1_worker(kernel, tmp_path)
    (worker / "memory.max_usage_in_bytes").write_text(str(256 * MiB))
    bump(worker / "memory.oom_control", "oom_kill")
    cause = pool._explain(WORKER, KILLED)
    assert cause.oom_killed and not cause.oom_above, cause
    assert cause.describe() == (
        "OOM-killed in its cgroup at memory.max 256 MiB (killed by SIGKILL)"
    )


def test_v1_tree_hits_before_the_spawn_are_not_this_kills(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    dirs = v1_host(kernel, hybrid=False)
    base = dirs["memory"] / "edgenode"
    pool = pool_on(kernel, tmp_path)
    add(base / "memory.failcnt", 40)  # an earlier incarnation's kill by the tree
    pool._prepare(pool.specs[0])  # the respawn: the baseline is taken again
    worker = base / f"worker-{WORKER}"
    (worker / "memory.max_usage_in_bytes").write_text(str(255 * MiB))
    bump(worker / "memory.oom_control", "oom_kill")
    assert not pool._explain(WORKER, KILLED).oom_above


def test_v1_a_machine_wide_oom_kill_below_its_own_limit_is_not_blamed(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    """No limit on the path was hit (the machine ran out): the peak, far below its
    own limit, says so."""
    pool, _, worker = v1_worker(kernel, tmp_path)
    (worker / "memory.max_usage_in_bytes").write_text(str(100 * MiB))
    bump(worker / "memory.oom_control", "oom_kill")
    assert pool._explain(WORKER, KILLED).oom_above


# ---------------------------------------------------------------- cgroup v2


def v2_worker(kernel: FakeKernel, tmp_path: Path) -> tuple[WorkerPool, Path]:
    own = v2_host(kernel)
    pool = pool_on(kernel, tmp_path)
    return pool, own / "edgenode" / f"worker-{WORKER}"


def test_v2_a_kill_by_the_trees_limit_after_a_peak_near_its_own_is_not_blamed(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    """memory.peak near memory.max, but the worker's own ``oom`` event did not rise:
    the tree's (its ``oom`` rose, which never propagates down) did it."""
    pool, worker = v2_worker(kernel, tmp_path)
    (worker / "memory.peak").write_text(str(250 * MiB))
    bump(worker / "memory.events", "oom_kill")
    bump(worker / "memory.events", "oom_group_kill")
    bump(worker.parent / "memory.events", "oom")
    cause = pool._explain(WORKER, KILLED)
    assert cause.oom_killed and cause.oom_above, cause


def test_v2_a_kill_at_its_own_limit_blames_the_request(kernel: FakeKernel, tmp_path: Path) -> None:
    pool, worker = v2_worker(kernel, tmp_path)
    (worker / "memory.peak").write_text(str(256 * MiB))
    for key in ("max", "oom", "oom_kill"):
        bump(worker / "memory.events", key)
    cause = pool._explain(WORKER, KILLED)
    assert cause.oom_killed and not cause.oom_above, cause


def test_v2_before_5_19_without_memory_peak_still_tells_them_apart(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    """No memory.peak (Linux < 5.19): the ``oom`` event alone decides. The peak test
    held such a kill as its own, whatever limit did it."""
    pool, worker = v2_worker(kernel, tmp_path)
    (worker / "memory.peak").unlink()
    bump(worker / "memory.events", "oom_kill")
    above = pool._explain(WORKER, KILLED)
    assert above.oom_killed and above.oom_above and above.oom_peak == "", above
    pool._prepare(pool.specs[0])  # the respawn
    (worker / "memory.peak").unlink(missing_ok=True)
    bump(worker / "memory.events", "oom")
    bump(worker / "memory.events", "oom_kill")
    own = pool._explain(WORKER, KILLED)
    assert own.oom_killed and not own.oom_above, own


def test_v2_an_own_limit_oom_before_the_spawn_is_not_this_kills(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    """The cgroup is reused by the next incarnation: its counters never go down."""
    pool, worker = v2_worker(kernel, tmp_path)
    bump(worker / "memory.events", "oom", by=2)
    bump(worker / "memory.events", "oom_kill", by=2)
    pool._prepare(pool.specs[0])
    (worker / "memory.peak").write_text(str(255 * MiB))  # v2's peak is the cgroup's, all lives
    bump(worker / "memory.events", "oom_kill")
    assert pool._explain(WORKER, KILLED).oom_above


def test_no_oom_kill_since_the_spawn_leaves_the_cause_alone(
    kernel: FakeKernel, tmp_path: Path
) -> None:
    pool, worker = v2_worker(kernel, tmp_path)
    (worker / "memory.events").write_text(EVENTS.replace("oom 0", "oom 1"))
    assert pool._explain(WORKER, KILLED) == KILLED


# ---------------------------------------------------------------- the verdict alone


def reading(
    peak_mib: int | None = None,
    limit_mib: int | None = 256,
    own_ooms: int | None = None,
    above_hits: int | None = None,
) -> MemoryReading:
    """A worker's reading with only what ``killed_by_own_limit`` looks at."""
    return memory_reading(
        peak=None if peak_mib is None else peak_mib * MiB,
        limit=None if limit_mib is None else limit_mib * MiB,
        own_limit_ooms=own_ooms,
        above_limit_hits=above_hits,
    )


@pytest.mark.parametrize(
    ("spawn", "death", "own"),
    [
        # v2: its own oom count since the spawn decides, whatever the peak.
        (reading(own_ooms=3), reading(250, own_ooms=3), False),
        (reading(own_ooms=3), reading(10, own_ooms=4), True),
        (reading(own_ooms=0), reading(None, own_ooms=0), False),  # < 5.19: no peak
        (reading(own_ooms=0), reading(None, own_ooms=1), True),
        # v1: an ancestor's failcnt rose since the spawn: above, whatever the peak.
        (reading(above_hits=7), reading(256, above_hits=99), False),
        # v1, none rose: the peak (NEAR_LIMIT, 0.9 of the limit, is its own).
        (reading(above_hits=7), reading(256, above_hits=7), True),
        (reading(above_hits=0), reading(231, above_hits=0), True),
        (reading(above_hits=0), reading(230, above_hits=0), False),  # a machine-wide OOM
        (reading(above_hits=0), reading(100, None, above_hits=0), False),  # no limit of its own
        # No spawn reading: the counters say nothing, the peak decides.
        (None, reading(250, own_ooms=5), True),
        (None, reading(100, above_hits=5), False),
        (None, reading(None), True),  # nothing tells them apart: as before, its own
    ],
)
def test_whose_limit_from_the_readings_at_spawn_and_at_death(
    spawn: MemoryReading | None, death: MemoryReading, own: bool
) -> None:
    assert killed_by_own_limit(spawn, death) is own
