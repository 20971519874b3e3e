"""Core planning, n_threads from cores and quota, cpu lists, CPU amounts, CFS
weights, and the in-worker calls (pin, renice, the autogroup's nice) in
throwaway child processes."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.errors import ConfigError, SandboxError
from node.config import WorkersSection, from_dict, validate
from node.sandbox import niceness
from node.sandbox.cores import (
    Placement,
    apply_placement,
    format_cpus,
    parse_cpus,
    pin,
    plan_cpus,
    plan_workers,
    reserved_cores,
    split_cores,
    usable_threads,
)
from node.sandbox.niceness import (
    autogroup_nice,
    autogroups_enabled,
    check_slice,
    cpu_weight_v2,
    kernel_has_custom_slices,
    nice_weight,
    process_niceness,
    set_autogroup_nice,
    thread_slice_us,
)
from node.units import parse_cores, quota_us

FOUR = (0, 1, 2, 3)


def test_one_reserved_core_is_shared_by_both_workers() -> None:
    plan = plan_cpus(2, [1], allowed=(0, 1))
    assert [p.cpus for p in plan.workers] == [(1,), (1,)]
    assert [p.threads for p in plan.workers] == [1, 1]
    assert plan.reserved == (1,) and plan.host == (0,) and plan.allowed == (0, 1)
    assert plan.node == (1,)  # the broker and the rules follow the reservation
    assert plan.restricts


def test_node_cpus_put_the_broker_where_the_operator_says() -> None:
    assert plan_cpus(2, [1], allowed=(0, 1), node=[0]).node == (0,)
    assert plan_cpus(2, [2, 3], allowed=FOUR, node=[3, 0]).node == (0, 3)  # may overlap
    assert plan_cpus(2, allowed=FOUR).node == ()  # nothing reserved: not pinned
    assert plan_cpus(2, allowed=FOUR, node=[1]).node == (1,)
    with pytest.raises(ConfigError, match=r"node\.cpus names core\(s\) 9"):
        plan_cpus(2, [1], allowed=FOUR, node=[9])
    with pytest.raises(ConfigError, match=r"node\.cpus lists core 0 twice"):
        plan_cpus(2, [1], allowed=FOUR, node=[0, 0])


def test_enough_reserved_cores_are_split_per_worker() -> None:
    plan = plan_cpus(2, [2, 3, 4, 5, 6], allowed=range(8), max_threads=8)
    assert [p.cpus for p in plan.workers] == [(2, 3, 4), (5, 6)]
    assert [p.threads for p in plan.workers] == [3, 2]
    assert plan.host == (0, 1, 7)


def test_no_reservation_splits_all_allowed_cores() -> None:
    plan = plan_cpus(2, allowed=FOUR, max_threads=4)
    assert [p.cpus for p in plan.workers] == [(0, 1), (2, 3)]
    assert plan.host == FOUR  # nothing reserved: the host keeps every core
    single = plan_cpus(1, allowed=FOUR, max_threads=4)
    assert single.workers[0].cpus == FOUR and not single.restricts


def test_more_workers_than_cores_share_the_pool() -> None:
    plan = plan_cpus(3, allowed=(0, 1), max_threads=4)
    assert [p.cpus for p in plan.workers] == [(0, 1)] * 3


def test_auto_reservation_leaves_the_first_allowed_core_to_the_host() -> None:
    assert reserved_cores("auto", (0, 1)) == (1,)
    assert reserved_cores("auto", (3, 2, 5)) == (3, 5)  # the lowest allowed, not core 0
    assert reserved_cores("auto", (4,)) == ()  # one core: shared, nothing to leave
    assert reserved_cores((), FOUR) == ()
    assert reserved_cores((2, 3), FOUR) == (2, 3)


def test_the_default_config_reserves_all_but_one_core_and_the_node_follows() -> None:
    w = WorkersSection()
    assert w.cpus == "auto"
    two = plan_workers(w, allowed=(0, 1))
    assert two.reserves and two.host == (0,) and two.node == (1,)
    assert [(p.cpus, p.threads) for p in two.workers] == [((1,), 1)]
    four = plan_workers(w, allowed=FOUR)
    assert four.host == (0,) and four.node == (1, 2, 3)
    assert [(p.cpus, p.threads) for p in four.workers] == [((1, 2, 3), w.threads)]
    one = plan_workers(w, allowed=(0,))
    assert not one.reserves and one.node == () and one.workers[0].cpus == (0,)
    shared = plan_workers(WorkersSection(cpus=()), allowed=(0, 1))
    assert not shared.reserves and shared.workers[0].cpus == (0, 1)


def test_default_allowed_set_is_this_process_affinity() -> None:
    plan = plan_cpus(1)
    assert set(plan.allowed) == os.sched_getaffinity(0)


def test_quota_and_configured_threads_cap_n_threads() -> None:
    plan = plan_cpus(1, allowed=range(8), cpu_quota_cores=2.5, max_threads=16, nice=5)
    assert plan.workers[0] == Placement(index=0, cpus=tuple(range(8)), threads=2, nice=5)
    assert plan_cpus(1, allowed=range(8), max_threads=3).workers[0].threads == 3
    assert plan_cpus(0, allowed=FOUR).workers == ()


@pytest.mark.parametrize(
    ("cpus", "quota", "cap", "threads"),
    [
        (4, None, None, 4),
        (4, 0.5, None, 1),  # half a core still runs one thread
        (4, 1.5, None, 1),  # rounded down
        (4, 2.0, None, 2),
        (2, 8.0, None, 2),  # the cores bound it too
        (4, None, 1, 1),
        (4, None, 0, 4),  # 0 = no cap
        (0, None, None, 1),
    ],
)
def test_usable_threads(cpus: int, quota: float | None, cap: int | None, threads: int) -> None:
    assert usable_threads(cpus, quota, cap) == threads


@pytest.mark.parametrize(
    ("reserved", "allowed", "message"),
    [
        ([1, 1], (0, 1, 2), "lists core 1 twice"),
        ([5], (0, 1), r"core\(s\) 5, but this process may only run on 0-1"),
        ([2, 9, 3], FOUR, r"core\(s\) 9"),
        ([0, 1], (0, 1), "leaving none for the host"),
        ([0], (0,), "leaving none"),
    ],
)
def test_impossible_reservations_are_config_errors(
    reserved: list[int], allowed: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_cpus(2, reserved, allowed=allowed)


@pytest.mark.parametrize("nice", [-1, 20])
def test_nice_out_of_range(nice: int) -> None:
    with pytest.raises(ConfigError, match=r"workers\.nice"):
        plan_cpus(1, allowed=FOUR, nice=nice)


def test_split_cores_sizes_differ_by_at_most_one() -> None:
    assert split_cores(range(7), 3) == [(0, 1, 2), (3, 4), (5, 6)]
    assert split_cores((3, 1), 2) == [(1,), (3,)]
    assert split_cores(FOUR, 0) == []


@pytest.mark.parametrize(
    ("cores", "text"),
    [((0, 1, 2, 3, 6), "0-3,6"), ((5,), "5"), ((), ""), ((1, 3, 4), "1,3-4")],
)
def test_cpu_lists_round_trip(cores: tuple[int, ...], text: str) -> None:
    assert format_cpus(cores) == text
    assert parse_cpus(text) == cores


def test_cpu_list_parse_is_lenient_about_a_newline_and_refuses_garbage() -> None:
    assert parse_cpus("0-1\n") == (0, 1)
    with pytest.raises(ValueError):
        parse_cpus("3-1")
    with pytest.raises(ValueError):
        parse_cpus("a")


@pytest.mark.parametrize(
    ("value", "cores"),
    [("max", None), ("MAX", None), (0.5, 0.5), (2, 2.0), ("1.5", 1.5)],
)
def test_parse_cores(value: str | float, cores: float | None) -> None:
    assert parse_cores(value) == cores


@pytest.mark.parametrize("value", [0, -1, "none", "nan", True])
def test_parse_cores_refuses(value: str | float) -> None:
    with pytest.raises(ValueError):
        parse_cores(value)


def test_quota_us() -> None:
    assert quota_us(0.5) == 50_000
    assert quota_us(2.0, period_us=50_000) == 100_000
    assert quota_us(0.001) == 1000  # the kernel's 1 ms minimum
    assert quota_us(None) is None


def _placed(cpus: tuple[int, ...], nice: int, out: multiprocessing.Queue[object]) -> None:
    apply_placement(cpus, nice)
    out.put((sorted(os.sched_getaffinity(0)), os.getpriority(os.PRIO_PROCESS, 0)))


def test_apply_placement_pins_and_renices_the_calling_process() -> None:
    core = min(os.sched_getaffinity(0))
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter, like a worker
    out: multiprocessing.Queue[object] = ctx.Queue()
    child = ctx.Process(target=_placed, args=((core,), 12, out))
    child.start()
    result = out.get(timeout=30)
    child.join(timeout=30)
    assert result == ([core], max(12, os.getpriority(os.PRIO_PROCESS, 0)))


def test_pin_to_an_impossible_core_is_a_sandbox_error() -> None:
    with pytest.raises(SandboxError, match="cannot pin"):
        pin([max(os.sched_getaffinity(0)) + 4096])
    pin([])  # nothing planned: nothing to do


def test_nice_weights_are_the_kernels() -> None:
    assert [nice_weight(n) for n in (0, 1, 10, 19)] == [1024, 820, 110, 15]
    assert [cpu_weight_v2(n) for n in (0, 5, 10, 19)] == [100, 33, 11, 1]
    with pytest.raises(ConfigError, match=r"workers\.nice"):
        nice_weight(20)


def test_autogroup_nice_reads_the_proc_file(tmp_path: Path) -> None:
    f = tmp_path / "autogroup"
    f.write_text("/autogroup-52 nice 3\n")
    assert autogroup_nice(f) == 3
    f.write_text("garbage\n")
    assert autogroup_nice(f) is None
    assert autogroup_nice(tmp_path / "absent") is None


def test_set_autogroup_nice_only_lowers_and_only_for_a_session_leader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "autogroup"
    f.write_text("/autogroup-52 nice 5\n")
    monkeypatch.setattr(niceness, "autogroups_enabled", lambda: True)
    monkeypatch.setattr(os, "getsid", lambda _pid: os.getpid())
    assert set_autogroup_nice(10, f) is True
    assert f.read_text() == "10\n"  # what the kernel is given; it shows "/autogroup-52 nice 10"
    f.write_text("/autogroup-52 nice 10\n")
    assert set_autogroup_nice(3, f) is False  # never raises the group's priority
    assert f.read_text() == "/autogroup-52 nice 10\n"
    monkeypatch.setattr(os, "getsid", lambda _pid: os.getpid() + 1)  # not a session leader
    assert set_autogroup_nice(15, f) is False
    assert f.read_text() == "/autogroup-52 nice 10\n"
    monkeypatch.setattr(niceness, "autogroups_enabled", lambda: False)
    monkeypatch.setattr(os, "getsid", lambda _pid: os.getpid())
    assert set_autogroup_nice(15, f) is False  # no autogroups: the thread's nice is enough


#: A worker's first steps, in a fresh interpreter: place itself, show its nice and its
#: autogroup's. A process in the kernel's default autogroup (a CI runner that never called
#: setsid) reads an empty /proc/self/autogroup: autogroup_nice() is None there.
PLACE = (
    "import os, sys; from node.sandbox.cores import apply_placement; "
    "from node.sandbox.niceness import autogroup_nice; "
    "apply_placement(tuple(os.sched_getaffinity(0)), 12); "
    "print(os.getpriority(os.PRIO_PROCESS, 0), autogroup_nice())"
)

needs_autogroups = pytest.mark.skipif(
    not autogroups_enabled(), reason="kernel.sched_autogroup_enabled is not 1 here"
)


def run_code(code: str, *, new_session: bool = False) -> str:
    """stdout of ``code`` in a fresh interpreter started from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        start_new_session=new_session,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout


@needs_autogroups
def test_a_worker_in_its_own_session_renices_its_autogroup() -> None:
    # The case that made nice 10 useless: a session of its own is an autogroup
    # that competes with the host's at nice 0 (node/sandbox/niceness.py).
    out = run_code(PLACE, new_session=True).split()
    assert out == ["12", "12"]


@needs_autogroups
def test_a_process_that_is_not_a_session_leader_leaves_its_sessions_autogroup_alone() -> None:
    before = autogroup_nice()
    out = run_code(PLACE).split()
    assert out == ["12", str(before)]  # only the process was reniced
    assert autogroup_nice() == before


def test_process_niceness_reads_nice_and_autogroup() -> None:
    me = process_niceness(os.getpid())
    assert me["nice"] == os.getpriority(os.PRIO_PROCESS, 0)
    assert me["autogroup_nice"] == (autogroup_nice() if autogroups_enabled() else None)
    assert me["slice_us"] == thread_slice_us(os.getpid())
    gone = process_niceness(2**22 + 12345)  # above pid_max's default: no such process
    assert gone == {"nice": None, "autogroup_nice": None, "slice_us": None}


#: A worker asks for a short slice, then starts a thread (llama.cpp's come later).
SLICE = (
    "import os, threading; from node.sandbox.niceness import set_slice, thread_slice_us; "
    "os.setpriority(os.PRIO_PROCESS, 0, 12); before = thread_slice_us(0); got = set_slice(250); "
    "out = []; read = lambda: out.append(thread_slice_us(threading.get_native_id())); "
    "t = threading.Thread(target=read); t.start(); t.join(); "
    "print(before, got, out[0], os.getpriority(os.PRIO_PROCESS, 0))"
)


@pytest.mark.skipif(not kernel_has_custom_slices(), reason="custom slices need Linux 6.12+")
def test_set_slice_is_inherited_by_later_threads_and_keeps_the_nice_level() -> None:
    before, got, thread, nice = run_code(SLICE).split()
    assert before == str(thread_slice_us(os.getpid()))  # the kernel's default, as here
    assert got == thread == "250"
    assert nice == "12"  # sched_setattr sets nice too: set_slice passes the current one


def test_kernel_has_custom_slices_by_release() -> None:
    assert kernel_has_custom_slices("6.12.0")
    assert kernel_has_custom_slices("6.18.44-fc-v1045")
    assert kernel_has_custom_slices("7.0.1")
    assert not kernel_has_custom_slices("6.11.9-arch1")
    assert not kernel_has_custom_slices("5.15.0-91-generic")
    assert not kernel_has_custom_slices("garbage")


@pytest.mark.parametrize("value", [0, 100, 2000, 100_000])
def test_check_slice_takes_zero_and_the_kernels_range(value: int) -> None:
    check_slice(value)  # raises ConfigError otherwise (the test below)
    config = validate(from_dict({"workers": {"slice_us": value}}))
    assert config.workers.slice_us == value


@pytest.mark.parametrize("value", [1, 99, 100_001, -5])
def test_check_slice_refuses_what_the_kernel_would_clamp(value: int) -> None:
    with pytest.raises(ConfigError, match=r"workers\.slice_us"):
        check_slice(value)


#: A process with a thread started before it pins itself, like the node after numpy's import.
PIN_ALL = (
    "import os, threading; from node.sandbox.cores import pin_all_threads; "
    "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start(); "
    "core = min(os.sched_getaffinity(0)); pin_all_threads([core]); "
    "print(sorted({min(os.sched_getaffinity(int(x))) for x in os.listdir('/proc/self/task')}), "
    "sorted({len(os.sched_getaffinity(int(x))) for x in os.listdir('/proc/self/task')}), core); "
    "stop.set(); t.join()"
)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_pin_all_threads_moves_threads_started_earlier() -> None:
    out = run_code(PIN_ALL).split("] ")
    core = out[-1].strip()
    assert out[0] == f"[{core}" and out[1] == "[1"  # every thread: that one core only
