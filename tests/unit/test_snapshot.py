"""The pressure levels' rules (``broker.pressure``) and the pool snapshot
(``broker.snapshot``): free credit defined once, one view per request."""

from __future__ import annotations

import pytest

from broker.kinds import PressureLevel
from broker.pressure import PressureLevels
from broker.snapshot import free_credit
from brokerkit import FAST, RULES, W1, W2, BrokerHarness, generate


@pytest.mark.parametrize(
    ("level", "bound", "limit", "shed"),
    [
        ("ok", 64, 4, ()),
        ("high", 32, 2, ("sheddable",)),
        ("critical", 32, 2, ("normal", "sheddable")),
    ],
)
def test_memory_pressure_halves_the_queue_and_the_credit_and_sheds_classes(
    level: PressureLevel, bound: int, limit: int, shed: tuple[str, ...]
) -> None:
    levels = PressureLevels(level=level)
    assert levels.queue_bound(8, 64) == bound
    assert levels.concurrency(4) == limit
    assert levels.memory_sheds() == shed


def test_the_queue_bound_is_8_per_slot_unless_configured_and_never_0() -> None:
    assert PressureLevels().queue_bound(3, 0) == 24
    assert PressureLevels().queue_bound(0, 0) == 8
    assert PressureLevels(level="high").queue_bound(1, 1) == 1
    assert PressureLevels(level="high").concurrency(1) == 1


def test_cpu_pressure_sheds_only_sheddable_work_and_leaves_the_bounds() -> None:
    levels = PressureLevels(cpu="high")
    assert levels.cpu_sheds("sheddable")
    assert not levels.cpu_sheds("normal") and not levels.cpu_sheds("critical")
    assert (levels.queue_bound(8, 0), levels.concurrency(4)) == (64, 4)
    assert not PressureLevels().cpu_sheds("sheddable")


def test_free_credit_is_the_workers_credit_within_the_pressures_limit() -> None:
    h = BrokerHarness(FAST)
    for w in (W1, W2):
        h.ready(w, 0.0)
    h.ready(RULES, 0.0, engine="rules")
    workers, levels = h.broker.workers, h.broker.pressure
    assert (free_credit(workers, levels, "llm"), free_credit(workers, levels, "rules")) == (2, 1)
    h.broker.set_pressure("high", 0.0)
    assert free_credit(workers, levels, "llm") == 1  # half the model's slots
    h.send(generate("a", route="llm"), 0.0)
    assert free_credit(workers, levels, "llm") == 0
    assert free_credit(workers, levels, "rules") == 1  # the rules need no memory to protect


def test_the_view_carries_the_levels_and_each_engines_pool() -> None:
    h = BrokerHarness(FAST)
    h.ready(W1, 0.0)
    h.broker.set_cpu_pressure("high", 0.0)
    view = h.broker.snapshot.view("normal", True, 0.0)
    assert (view.pressure, view.cpu_pressure, view.draining) == ("ok", "high", True)
    assert (view.llm.workers, view.llm.slots, view.llm.free) == (1, 1, 1)
    assert view.rules.workers == 0 and view.of("rules") is view.rules
