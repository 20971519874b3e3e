"""Isolation with real cgroups and a real node (root, cgroup v1/hybrid or v2).

The node runs the test engine; ``!hog <MiB>`` makes a worker allocate and touch
that much memory, like a model outgrowing its cgroup. What these tests show
(issue 4, "What it must show"):

* a worker whose ``memory_max`` is too small for its work is OOM-killed inside
  its own cgroup while the broker and the other worker keep serving; ``status``
  shows the kill, the supervisor restarts the worker;
* a worker OOM-killed by a limit above its cgroup (the node's tree, lowered) has
  its request run again once, not blamed, even when it came near its own limit
  earlier in its life;
* no process or cgroup is left after ``edgenode stop``, nor after the node was
  killed with ``kill -9`` and started again (the restart reaps the stale cgroups);
* ``sandbox = "required"`` with an impossible ``cgroup_root``, and an impossible
  core reservation, fail ``edgenode start`` with a clear message and leave
  nothing running;
* a CPU quota puts a worker in a cpu cgroup weighted by its nice level.

Both incarnations of a node are started from this test process, so they see
the same own cgroup (each bash job on the dev machine gets its own memory
cgroup) and, with the same run dir, the same cgroup name.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cgroups import _gone, _skip_reason

from broker.client import Client
from node.sandbox.cgroupfs import NODE_LEAF, parse_keyed, read_int, read_optional
from node.sandbox.cgroupfs import Host as CgroupHost
from node.sandbox.cgroups import cgroup_name
from node.sandbox.cores import format_cpus
from node.sandbox.driver import NEAR_LIMIT
from node.sandbox.layout import read_layout
from node.testing import Collector, NodeProcess, leftover_processes
from node.testing import wait_for as _wait_for

pytestmark = pytest.mark.system

#: Restarts back off (0.5 s, 1 s, ...): these waits get longer than the default.
wait_for = functools.partial(_wait_for, timeout=15.0, every=0.05)

NodeFactory = Callable[..., NodeProcess]
MiB = 2**20
LIMIT = "64M"  # per worker: an idle test-engine worker charges well under 1 MiB
HOG_MIB = 200
#: The shipped heartbeats (3 s to a verdict), not the tests' fast 300 ms: a worker
#: thrashing at its limit on a loaded host can miss 300 ms of heartbeats before the
#: OOM killer ends it, and these tests are about the OOM kill (the missed-heartbeat
#: verdict at the limit has its own test below).
OOM_BROKER = {"heartbeat_interval_ms": 1000}
#: 60 s of streaming (600 tokens x 100 ms, the per-test timeout): it runs whatever the
#: test waits for, and the test ends it with a cancel. An 8 s stream could end before
#: the hog was dispatched on a loaded host, and the hog then went to its worker.
ENDLESS_STREAM = "!slow 100 " + " ".join(f"w{i}" for i in range(598))
#: The memory-limit verdict test's worker: memory.max, and what it holds. The hold is
#: 6 MiB above NEAR_LIMIT's line (the verdict says "at its memory limit" whatever the
#: runtime's own few hundred KiB do) and ~18 MiB below the limit, so the kernel never
#: has to reclaim or OOM-kill before the test's SIGSTOP (60 of 64 MiB left 3 MiB).
VERDICT_LIMIT_MIB = 256
VERDICT_HOLD_MIB = math.ceil(NEAR_LIMIT * VERDICT_LIMIT_MIB) + 6
#: The stale-peak test's worker: memory.max, the first request's hold (its peak
#: lands 2-3 MiB above NEAR_LIMIT's line, with the runtime's ~0.5 MiB), the room the
#: node's tree is then given above its usage, and the second request, which
#: outgrows that room by 6 MiB while its worker stays ~10 MiB under its own limit.
#: The tree held no page cache worth reclaiming on the dev machine (12 KiB), so the
#: kernel OOM-kills at once.
NEAR_PEAK_LIMIT_MIB = 256
NEAR_PEAK_HOLD_MIB = math.ceil(NEAR_LIMIT * NEAR_PEAK_LIMIT_MIB) + 2
NEAR_PEAK_TREE_ROOM_MIB = 6
NEAR_PEAK_SECOND_MIB = 12


@pytest.fixture(scope="module")
def usable() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def working_set(memory: dict[str, Any]) -> int:
    """A status memory map's working set (bytes): usage minus inactive page cache,
    what ``MemoryReading.near_limit`` compares with the limit."""
    return int(memory["current"]) - int(memory["inactive_file"])


def partials(col: Collector, rid: str) -> int:
    """How many partial replies ``rid`` has received so far."""
    return sum(1 for r in col.replies.get(rid, []) if r["status"] == "partial")


def processes(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["worker_id"]: p for p in status["processes"]}


def node_cgroup_dirs(name: str) -> list[Path]:
    """Where a node's cgroup named ``name`` can be, in every hierarchy this host
    mounts, under this process's own cgroup (where a node started from here goes)."""
    layout = read_layout(CgroupHost())
    dirs = {m.dir_of(layout.own_v1.get(c, "/")) / name for c, m in layout.v1.items()}
    if layout.v2 is not None:
        dirs.add(layout.v2.dir_of(layout.own_v2 or "/") / name)
    return sorted(dirs)


def oom_kills_of(cgroup: Path) -> int:
    """OOM kills a cgroup recorded (v1 ``memory.oom_control``, v2 ``memory.events``)."""
    text = read_optional(cgroup / "memory.oom_control") or read_optional(cgroup / "memory.events")
    return parse_keyed(text).get("oom_kill", 0)


def peak_of(cgroup: Path) -> int | None:
    """Peak memory use (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), if known."""
    return read_int(cgroup / "memory.max_usage_in_bytes") or read_int(cgroup / "memory.peak")


def run_hog(node: NodeProcess, mib: int = HOG_MIB, rid: str = "hog") -> dict[str, Any]:
    """Send one ``!hog <mib>`` request (the test engine allocates that much and holds
    it until its process ends) and return its final reply."""
    col = Collector(node.frontend)
    try:
        col.send(id=rid, op="generate", prompt=f"!hog {mib}", timeout_ms=30_000)
        col.collect(timeout=30)
        return col.final(rid)
    finally:
        col.close()


@contextlib.contextmanager
def tree_limit_above_usage(base: Path, room_mib: int) -> Iterator[None]:
    """The node's tree limited to what it uses now plus ``room_mib`` MiB (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``), as a systemd slice or a container
    lowered below what the workers hold would be; restored on the way out."""
    knob = base / "memory.limit_in_bytes"
    if not knob.exists():
        knob = base / "memory.max"
    usage = read_int(base / "memory.usage_in_bytes") or read_int(base / "memory.current")
    assert usage is not None
    saved = knob.read_text().strip()
    knob.write_text(str(usage + room_mib * MiB))
    try:
        yield
    finally:
        knob.write_text(saved)


class Pinger(threading.Thread):
    """A client sending short requests one after another until stopped."""

    def __init__(self, frontend: str) -> None:
        super().__init__(name="pinger", daemon=True)
        self.frontend = frontend
        self.results: list[tuple[str, str | Exception]] = []  # (prompt, text or error)
        self.halt = threading.Event()

    def run(self) -> None:
        with Client(self.frontend, wait_ms=30_000) as client:
            i = 0
            while not self.halt.is_set():
                prompt = f"ping {i}"
                try:
                    reply = client.generate(prompt, max_tokens=8, timeout_ms=20_000)
                    self.results.append((prompt, reply.text))
                except Exception as exc:  # recorded; the test asserts there are none
                    self.results.append((prompt, exc))
                i += 1

    def ok(self) -> int:
        return sum(1 for _, r in self.results if isinstance(r, str))


# --------------------------------------------------------------------------- OOM


def test_oom_kill_stays_in_the_workers_cgroup_and_the_node_keeps_serving(
    usable: None, make_node: NodeFactory
) -> None:
    node = make_node(workers={"memory_max": LIMIT, "sandbox": "required"}, broker=OOM_BROKER)
    assert node.proc is not None
    before = node.status()
    assert before["pid"] == node.proc.pid  # the broker runs in the node process
    base = Path(before["sandbox"]["cgroup"])
    pids = {wid: p["pid"] for wid, p in processes(before).items()}
    col = Collector(node.frontend)
    pinger = Pinger(node.frontend)
    try:
        # The other worker (Y) streams until the test cancels it; the pings and then
        # the hog can only go to X, which is OOM-killed and restarted. The hog is not
        # run again: an OOM kill in a worker's own cgroup blames its request.
        col.send(id="long", op="generate", prompt=ENDLESS_STREAM, max_tokens=600, stream=True)
        busy = wait_for(lambda: [w for w in node.status()["workers"] if w["active"]])
        survivor = busy[0]["worker_id"]
        victim = next(wid for wid in pids if wid != survivor)
        pinger.start()
        wait_for(lambda: pinger.ok() >= 3)
        col.send(id="hog", op="generate", prompt=f"!hog {HOG_MIB}", timeout_ms=30_000)
        wait_for(lambda: col.collect(False, 0.05, 0) or col.finals_of("hog"), timeout=30)
        streamed_at_kill = partials(col, "long")

        hog = col.final("hog")
        assert (hog["status"], hog["code"], hog["reason"]) == ("error", 503, "worker_lost"), hog
        assert hog["message"] == (
            "worker lost: OOM-killed in its cgroup at memory.max 64 MiB (killed by SIGKILL)"
            " (not retried: the worker ran out of memory running this request)"
        ), hog

        status = wait_for(
            lambda: (
                (s := node.status())["all_ready"] and processes(s)[victim]["restarts"] == 1 and s
            )
        )
        after_ok = pinger.ok()
        wait_for(lambda: pinger.ok() >= after_ok + 3)  # served again after the restart
        # The other worker's stream went on through the OOM kill and the restart.
        wait_for(lambda: col.collect(False, 0.05, 0) or partials(col, "long") > streamed_at_kill)
        col.send(id="stop", op="cancel", target="long")
        col.collect(timeout=30)
        col.assert_exactly_one_final_each()
    finally:
        pinger.halt.set()
        pinger.join(timeout=30)
        col.close()

    # The stream was never cut: every token in order, then the cancel's 499 with all of them.
    long = col.final("long")
    assert (long["status"], long["code"]) == ("error", 499), long
    assert ("echo: " + ENDLESS_STREAM).startswith(long["text"])
    streamed = "".join(r["text"] for r in col.replies["long"] if r["status"] == "partial")
    assert streamed == long["text"] and col.final("stop")["status"] == "ok"

    # Every ping succeeded: the broker kept serving throughout.
    assert pinger.results and all(text == f"echo: {prompt}" for prompt, text in pinger.results), [
        r for r in pinger.results if not isinstance(r[1], str)
    ]

    procs = processes(status)
    killed, other = procs[victim], procs[survivor]
    assert killed["state"] == "ready" and killed["pid"] not in (None, pids[victim])
    assert (killed["restarts"], killed["oom_kills"]) == (1, 1)
    assert (
        killed["last_exit"] == "OOM-killed in its cgroup at memory.max 64 MiB (killed by SIGKILL)"
    )
    assert killed["cgroup"] == str(base / f"worker-{victim}")
    memory = killed["memory"]
    assert memory["limit"] == 64 * MiB and memory["oom_kills"] >= 1
    assert memory["peak"] is None or memory["peak"] <= 64 * MiB  # never above its cap
    assert memory["swap"] in (None, 0)
    # The other worker: untouched, same process, never restarted.
    assert (other["state"], other["pid"], other["restarts"]) == ("ready", pids[survivor], 0)
    assert (other["oom_kills"], other["last_exit"]) == (0, "")
    assert other["memory"]["oom_kills"] == 0

    # The node (broker) process: alive, same pid, its own leaf never OOM-killed,
    # and the hog's 200 MiB never landed anywhere in the node's tree.
    assert node.proc.poll() is None and status["pid"] == node.proc.pid
    assert oom_kills_of(base / NODE_LEAF) == 0
    tree_peak = peak_of(base)
    assert tree_peak is None or tree_peak < HOG_MIB * MiB, tree_peak
    assert status["counters"].get("workers_lost") == 1
    with node.client(wait_ms=5000) as c:
        assert c.ping()


def test_a_later_crash_is_not_blamed_on_an_earlier_oom_kill(
    usable: None, make_node: NodeFactory
) -> None:
    node = make_node(
        workers={"count": 1, "memory_max": LIMIT, "sandbox": "required"}, broker=OOM_BROKER
    )
    hog = run_hog(node)
    assert (hog["code"], hog["reason"]) == (503, "worker_lost"), hog
    assert "worker lost: OOM-killed in its cgroup" in hog["message"]
    status = wait_for(
        lambda: (s := node.status())["all_ready"] and s["processes"][0]["restarts"] == 1 and s
    )
    (worker,) = status["processes"]
    assert (worker["oom_kills"], worker["restarts"]) == (1, 1)
    # The restarted process reuses the cgroup, whose OOM counter stays at 1:
    # a plain kill -9 now is a SIGKILL, not a second OOM kill.
    os.kill(worker["pid"], signal.SIGKILL)
    status = wait_for(
        lambda: (s := node.status())["all_ready"] and s["processes"][0]["restarts"] == 2 and s
    )
    (worker,) = status["processes"]
    assert (worker["last_exit"], worker["oom_kills"]) == ("killed by SIGKILL", 1)


def test_an_oom_kill_by_the_nodes_own_limit_is_not_blamed_on_the_request(
    usable: None, make_node: NodeFactory
) -> None:
    """A limit above the workers' cgroups, lowered after start (the node's tree here; a
    systemd slice or a container alike): the kernel kills the largest task under it,
    a worker far below its own memory.max. The message named that memory.max, and the
    request was blamed as a poison one and not run again; it is run again once, as any
    lost request, and the worker's last exit says whose limit it was."""
    node = make_node(
        workers={"count": 1, "memory_max": "256M", "sandbox": "required"}, broker=OOM_BROKER
    )
    base = Path(node.status()["sandbox"]["cgroup"])
    with tree_limit_above_usage(base, 128):  # the worker's hog meets this first
        hog = run_hog(node)
        status = wait_for(
            lambda: (s := node.status())["all_ready"] and s["processes"][0]["restarts"] == 2 and s
        )
    assert (hog["code"], hog["reason"]) == (503, "worker_lost"), hog
    # Run again once on the restarted worker, which the same limit killed too.
    above = "OOM-killed by a memory limit above its cgroup (peak "
    assert hog["message"].startswith(f"worker lost: {above}"), hog
    assert "memory.max 256 MiB) (killed by SIGKILL)" in hog["message"], hog
    assert "not retried" not in hog["message"], hog
    (worker,) = status["processes"]
    assert worker["last_exit"].startswith(above), worker
    assert node.proc is not None and status["pid"] == node.proc.pid  # the broker lived
    with node.client(wait_ms=5000) as c:
        assert c.ping()


def test_a_kill_by_the_nodes_limit_after_a_peak_near_its_own_is_not_blamed(
    usable: None, make_node: NodeFactory
) -> None:
    """A worker that once came within 10 % of its own memory.max (a big json_schema
    request, here a held ``!hog``) and is later killed by the node's lowered limit:
    its request was blamed, as its lifetime peak read as its own limit (a user's
    finding). Since the spawn the tree's ``memory.failcnt`` rose (v1) and the
    worker's own ``oom`` event did not (v2): the request is run again once, on the
    restarted worker, and the worker's last exit names the limit above it."""
    limit = NEAR_PEAK_LIMIT_MIB * MiB
    node = make_node(
        workers={"count": 1, "memory_max": f"{NEAR_PEAK_LIMIT_MIB}M", "sandbox": "required"},
        broker=OOM_BROKER,
    )
    base = Path(node.status()["sandbox"]["cgroup"])
    near = run_hog(node, NEAR_PEAK_HOLD_MIB, rid="near")
    assert (near["status"], near.get("text")) == ("ok", f"echo: !hog {NEAR_PEAK_HOLD_MIB}"), near
    (worker,) = node.status()["processes"]
    # The premises: the peak is in the band the old verdict read as "at its own
    # limit", the worker is alive and unkilled, and its own limit has room for
    # the second request, which only the tree's limit stops.
    memory = worker["memory"]
    assert (worker["restarts"], worker["oom_kills"], memory["limit"]) == (0, 0, limit), worker
    peak = peak_of(Path(worker["cgroup"]))
    assert peak is None or NEAR_LIMIT * limit <= peak, (peak, memory)
    assert memory["current"] + NEAR_PEAK_SECOND_MIB * MiB < limit - 4 * MiB, memory
    with tree_limit_above_usage(base, NEAR_PEAK_TREE_ROOM_MIB):
        second = run_hog(node, NEAR_PEAK_SECOND_MIB, rid="second")
        status = wait_for(
            lambda: (s := node.status())["all_ready"] and s["processes"][0]["restarts"] == 1 and s
        )
    # Run again once, on the restarted worker, which the tree's limit (set for the
    # dead worker's usage) leaves room for: the client sees its answer.
    assert (second["status"], second.get("text")) == ("ok", f"echo: !hog {NEAR_PEAK_SECOND_MIB}"), (
        second,
        status["processes"][0]["last_exit"],
    )
    (worker,) = status["processes"]
    assert (worker["restarts"], worker["oom_kills"]) == (1, 1), worker
    above = "OOM-killed by a memory limit above its cgroup (peak "
    own = f"memory.max {NEAR_PEAK_LIMIT_MIB} MiB) (killed by SIGKILL)"
    assert worker["last_exit"].startswith(above) and worker["last_exit"].endswith(own), worker
    counters = status["counters"]
    assert (counters.get("workers_lost"), counters.get("worker_lost", 0)) == (1, 0), counters
    assert node.proc is not None and status["pid"] == node.proc.pid  # the broker lived


def test_a_worker_lost_at_its_memory_limit_says_so(usable: None, make_node: NodeFactory) -> None:
    # A worker stuck in reclaim at its limit misses heartbeats before the OOM
    # killer comes; a SIGSTOP while it holds more than NEAR_LIMIT of memory.max is
    # that stall, made reproducible. It used to be lost before the SIGSTOP (4 of 7
    # runs on the loaded dev VM): the test engine's !hog allocated in one GIL-holding
    # memset, the nice-10 worker sent no heartbeat for 3 s, and the restarted worker
    # ran the hog again. !hog now allocates a MiB per call, the hold leaves the kernel
    # ~18 MiB of room, and the premises are checked before the SIGSTOP.
    limit = VERDICT_LIMIT_MIB * MiB
    node = make_node(
        workers={"count": 1, "memory_max": f"{VERDICT_LIMIT_MIB}M", "sandbox": "required"},
        broker={"heartbeat_interval_ms": 1000, "heartbeat_liveness": 3, "stall_timeout_ms": 15000},
    )
    with Client(node.frontend, wait_ms=30_000) as client:
        assert client.generate(f"!hog {VERDICT_HOLD_MIB} held", max_tokens=1).text == "echo:"
    (worker,) = node.status()["processes"]
    memory = worker["memory"]
    # The premises, checked rather than hoped for: the hog is held, inside the
    # "at its limit" band, and the cgroup never reached memory.max (no reclaim yet).
    lost_early = (worker["last_exit"], node.log.read_text()[-2000:])
    assert worker["restarts"] == 0 and memory["limit"] == limit, lost_early
    assert NEAR_LIMIT * limit <= working_set(memory) < limit - 16 * MiB, memory
    assert memory["limit_hits"] in (None, 0), memory
    os.kill(worker["pid"], signal.SIGSTOP)
    status = wait_for(lambda: (s := node.status())["processes"][0]["restarts"] == 1 and s)
    (after,) = status["processes"]
    assert after["last_exit"].startswith("dead: missed heartbeats, at its memory limit ("), after
    assert f"of memory.max {VERDICT_LIMIT_MIB} MiB)" in after["last_exit"], after
    assert after["oom_kills"] == 0, after
    # A plain stall away from the limit gets the plain verdict. The restarted worker
    # reuses the cgroup, which may still be charged for its predecessor's pages for
    # a while (a CI run under load saw 60.5 of 64 MiB right after the restart): wait
    # until the working set is away from the limit, the premise of this half.

    def settled() -> dict[str, Any] | None:
        s = node.status()
        m = s["processes"][0]["memory"]
        away = m is not None and working_set(m) < NEAR_LIMIT * limit / 2
        return s if s["all_ready"] and away else None

    fresh = wait_for(settled, timeout=30)["processes"][0]
    os.kill(fresh["pid"], signal.SIGSTOP)
    status = wait_for(lambda: (s := node.status())["processes"][0]["restarts"] == 2 and s)
    assert status["processes"][0]["last_exit"] == "dead: missed heartbeats (killed by SIGKILL)"


# --------------------------------------------------------------------------- leftovers


def _assert_nothing_left(node: NodeProcess, dirs: list[Path], pids: list[int]) -> None:
    assert leftover_processes(node.run_dir) == []
    assert all(_gone(pid) for pid in pids), [p for p in pids if Path(f"/proc/{p}").exists()]
    assert [d for d in dirs if d.exists()] == []


def test_nothing_is_left_after_stop_nor_after_kill9_and_a_restart(
    usable: None, make_node: NodeFactory
) -> None:
    node = make_node(workers={"memory_max": "128M", "sandbox": "required"})
    assert node.proc is not None
    status = node.status()
    name = cgroup_name(node.run_dir)
    dirs = node_cgroup_dirs(name)
    base = Path(status["sandbox"]["cgroup"])
    assert base.name == name and base in dirs and base.is_dir()
    workers = [base / f"worker-{wid}" for wid in processes(status)]
    assert all(w.is_dir() for w in workers)

    # 1. edgenode stop: the workers, their cgroups and the node's own tree go.
    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert node.proc.wait(timeout=10) == 0
    _assert_nothing_left(node, dirs, [p["pid"] for p in status["processes"]])

    # 2. Same run dir (so the same cgroup name), then the node is killed with kill -9.
    node.start()
    first = node.status()
    first_pids = [p["pid"] for p in first["processes"]]
    inodes = {w: w.stat().st_ino for w in workers}
    node.proc.kill()
    node.proc.wait(timeout=10)  # reaped: a zombie node would still own its leaf
    # The workers die with their node (PR_SET_PDEATHSIG); their cgroups stay behind.
    assert all(_gone(pid) for pid in first_pids)
    assert all(w.is_dir() for w in workers)

    # 3. The second start reaps the stale worker cgroups before making fresh ones.
    node.start()
    second = node.status()
    sandbox = second["sandbox"]
    assert sandbox["cgroup"] == str(base)
    for w in workers:
        assert any(r.startswith(str(w)) for r in sandbox["reaped"]), sandbox["reaped"]
        assert w.stat().st_ino != inodes[w]  # a new cgroup, not the stale one
    second_pids = {p["pid"] for p in second["processes"]}
    assert not second_pids & set(first_pids)
    in_cgroups = {int(pid) for w in workers for pid in (w / "cgroup.procs").read_text().split()}
    assert in_cgroups == second_pids  # only the new workers, nothing of the first run
    assert set(leftover_processes(node.run_dir)) == second_pids | {node.proc.pid}

    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert node.proc.wait(timeout=10) == 0
    _assert_nothing_left(node, dirs, list(second_pids))


# --------------------------------------------------------------------------- refusals


def test_required_sandbox_with_an_impossible_cgroup_root_fails_fast(
    usable: None, make_node: NodeFactory
) -> None:
    root = "/no/such/edgenode-root"
    node = make_node(start=False, workers={"sandbox": "required", "cgroup_root": root})
    result = node.cli("start", "--wait-s", "30")
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'workers.sandbox = "required", but cgroup ' in result.stderr, result.stderr
    assert f"{root} does not exist (workers.cgroup_root?)" in result.stderr, result.stderr
    assert "workers not ready after" not in result.stderr  # not a READY timeout: it gave up
    assert leftover_processes(node.run_dir) == []
    assert not list((node.run_dir / "logs").glob("llm-*.log"))  # no worker was ever spawned
    assert node.cli("status").returncode == 3  # nothing answers
    name = cgroup_name(node.run_dir)
    assert [d for d in node_cgroup_dirs(name) if d.exists()] == []


@pytest.mark.parametrize(
    ("cpus", "expected"),
    [
        ([99], "workers.cpus names core(s) 99, but this process may only run on {allowed}"),
        (None, "workers.cpus reserves every core this process may use ({allowed})"),
        ([1, 1], "workers.cpus must list distinct core numbers >= 0, got [1, 1]"),
    ],
    ids=["outside-the-allowed-set", "every-core", "twice"],
)
def test_impossible_core_reservation_fails_start_before_anything_starts(
    make_node: NodeFactory, cpus: list[int] | None, expected: str
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    node = make_node(start=False, workers={"cpus": allowed if cpus is None else cpus})
    result = node.cli("start", "--wait-s", "30")
    assert result.returncode == 1, result.stdout + result.stderr
    assert expected.format(allowed=format_cpus(allowed)) in result.stderr, result.stderr
    assert "starting edgenode" not in result.stdout  # refused before the node was spawned
    assert not (node.run_dir / "logs").exists()
    assert leftover_processes(node.run_dir) == []


def test_a_cpu_quota_gives_each_worker_a_cpu_cgroup_weighted_by_its_nice_level(
    usable: None, make_node: NodeFactory
) -> None:
    # In a cpu cgroup of its own a worker is one scheduling entity: the cgroup's
    # weight ranks it against the broker's leaf, not its threads' nice level.
    node = make_node(workers={"count": 1, "cpu_quota": 0.5, "sandbox": "required", "nice": 10})
    layout = read_layout(CgroupHost())
    worker = processes(node.status())["llm-0"]
    own = {
        line.split(":")[1]: line.split(":", 2)[2]
        for line in Path(f"/proc/{worker['pid']}/cgroup").read_text().splitlines()
    }
    if layout.kind == "v2":
        assert layout.v2 is not None
        d = layout.v2.dir_of(own[""])
        assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        assert (d / "cpu.weight").read_text().strip() == "11"
        assert (d.parent / "cpu.weight").read_text().strip() == "11"  # the node's whole tree
        assert (d.parent / NODE_LEAF / "cpu.weight").read_text().strip() == "100"
    else:
        cpu = next(key for key in own if "cpu" in key.split(","))  # "cpu" or "cpu,cpuacct"
        d = layout.v1["cpu"].dir_of(own[cpu])
        assert d.name == "worker-llm-0"
        assert (d / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (d / "cpu.shares").read_text().strip() == "110"  # nice 10's CFS weight
        # The node's whole tree weighs that among the host's tasks; the broker's
        # leaf keeps nice 0's weight inside it, ahead of the workers.
        assert (d.parent / "cpu.shares").read_text().strip() == "110"
        assert (d.parent / NODE_LEAF / "cpu.shares").read_text().strip() == "1024"
    assert worker["threads"] == 1  # half a core runs one thread
