"""Core planning, n_threads from cores and quota, cpu lists, CPU amounts, and the
in-worker calls (pin, renice) in a throwaway child process."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from broker.errors import ConfigError, SandboxError
from node.affinity import (
    Placement,
    apply_placement,
    format_cpus,
    parse_cpus,
    pin,
    plan_cpus,
    split_cores,
    threads_for_quota,
    usable_threads,
)
from node.units import parse_cores, quota_us

FOUR = (0, 1, 2, 3)


def test_one_reserved_core_is_shared_by_both_workers() -> None:
    plan = plan_cpus(2, [1], allowed=(0, 1))
    assert [p.cpus for p in plan.workers] == [(1,), (1,)]
    assert [p.threads for p in plan.workers] == [1, 1]
    assert plan.reserved == (1,) and plan.host == (0,) and plan.allowed == (0, 1)
    assert plan.restricts


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


def test_threads_for_a_quota_read_from_cgroupfs() -> None:
    assert threads_for_quota(150_000, 100_000, 4) == 1
    assert threads_for_quota(200_000, 100_000, 4) == 2
    assert threads_for_quota(None, 100_000, 4) == 4
    assert threads_for_quota(-1, 100_000, 3) == 3  # v1 "no quota"


@pytest.mark.parametrize(
    ("reserved", "allowed", "message"),
    [
        ([1, 1], (0, 1, 2), "lists core 1 twice"),
        ([5], (0, 1), r"core\(s\) 5, but this process may only run on 0-1"),
        ([2, 9, 3], FOUR, r"core\(s\) 9"),
        ([0, 1], (0, 1), "leaving none for the broker and the host"),
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
