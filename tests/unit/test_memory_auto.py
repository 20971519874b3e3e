"""``workers.memory_max = "auto"``: the capacity plan's per-worker memory.max (and, with
``memory_high = ""``, its memory.high) in config validation, ``limits_for``, ``check_fits``,
``edgenode capacity`` (text and --json) and the status view."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from broker.errors import ConfigError
from node.capacity.gguf import ModelMeta
from node.capacity.plan import Plan, check_fits, config_plan
from node.capacity.worker_limits import describe, is_auto, memory_high_bytes, memory_max_bytes
from node.cli.capacity import capacity
from node.cli.status_view import render_status
from node.config import WorkersSection, from_dict, load_config, validate
from node.sandbox.cgroups import limits_for
from node.sandbox.driver import Limits

MiB, GiB = 1 << 20, 1 << 30
#: A plan by hand: 100 MiB per worker, so memory.max ~110 MiB and memory.high ~105 MiB.
PLAN = Plan(budget=8 * GiB, reserve=GiB, weights=0, kv_per_seq=100 * MiB, workers=2)


def workers(**values: Any) -> WorkersSection:
    """A validated [workers] section."""
    return validate(from_dict({"workers": values})).workers


def test_the_default_stays_1g() -> None:
    assert WorkersSection().memory_max == "1G" and not is_auto(WorkersSection())


@pytest.mark.parametrize("text", ["auto", "AUTO", " Auto "])
def test_auto_is_accepted_in_any_case(text: str) -> None:
    assert is_auto(workers(memory_max=text))


@pytest.mark.parametrize("high", ["", "max", "90M", 50 * MiB])
def test_auto_takes_any_memory_high_until_the_plan_is_known(high: str | int) -> None:
    w = workers(memory_max="auto", memory_high=high)
    assert w.memory_high == high


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"memory_max": "automatic"}, r'workers\.memory_max: .*a size, "max" or "auto"'),
        ({"memory_max": "auto", "memory_high": "lots"}, r"workers\.memory_high: .*\"max\""),
        ({"memory_max": "auto", "memory_high": "auto"}, r"workers\.memory_high"),
    ],
)
def test_bad_values_are_named(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        workers(**values)


def test_auto_reads_the_plan() -> None:
    w = workers(memory_max="auto")
    assert 110 * MiB <= PLAN.memory_max < 110 * MiB + 8192  # page-rounded
    assert 105 * MiB <= PLAN.memory_high < PLAN.memory_max
    assert memory_max_bytes(w, PLAN) == PLAN.memory_max
    assert memory_high_bytes(w, PLAN) == PLAN.memory_high  # not 90 % of memory.max
    assert memory_high_bytes(workers(memory_max="auto", memory_high="max"), PLAN) is None
    assert memory_high_bytes(workers(memory_max="auto", memory_high="100M"), PLAN) == 100 * MiB


def test_a_size_ignores_the_plan() -> None:
    w = workers(memory_max="512M")
    assert memory_max_bytes(w, PLAN) == 512 * MiB
    assert memory_high_bytes(w, PLAN) == 512 * MiB * 9 // 10


def test_auto_without_a_plan_is_a_config_error() -> None:
    w = workers(memory_max="auto")
    with pytest.raises(ConfigError, match="no plan"):
        memory_max_bytes(w)
    with pytest.raises(ConfigError, match="no plan"):
        memory_high_bytes(w)


def test_limits_for_with_auto_gives_the_plans_limits() -> None:
    w = workers(memory_max="auto", cpus=[1])
    assert limits_for(w, cpus=(1,), plan=PLAN) == Limits(
        memory_max=PLAN.memory_max, memory_high=PLAN.memory_high, cpus=(1,), nice=10
    )
    with pytest.raises(ConfigError, match="no plan"):
        limits_for(w, cpus=(1,))


def config(**workers_values: Any) -> Any:
    return from_dict(
        {
            "workers": {"engine": "test", **workers_values},
            "model": {"path": "/nonexistent.gguf"},
            "capacity": {"memory_budget": "8G", "reserve": "1G", "runtime_overhead": "88M"},
        }
    )


def test_check_fits_returns_the_plan_that_auto_reads() -> None:
    cfg = config(memory_max="auto")
    plan = check_fits(cfg)
    assert plan.per_worker == 88 * MiB  # the test engine: runtime only
    assert limits_for(cfg.workers, plan=plan).memory_max == plan.memory_max
    assert describe(cfg.workers, plan) == {
        "setting": "auto",
        "memory_max": plan.memory_max,
        "memory_high": plan.memory_high,
    }


def test_check_fits_refuses_a_memory_high_above_the_plans_memory_max() -> None:
    with pytest.raises(ConfigError, match=r"memory_high 200 MiB is above the 96\.8 MiB"):
        check_fits(config(memory_max="auto", memory_high="200M"))


def test_start_and_capacity_compute_the_same_limits() -> None:
    # check_fits (what start uses) and config_plan (what `edgenode capacity` prints).
    cfg = config(memory_max="auto", count=3)
    started, (printed, _) = check_fits(cfg), config_plan(cfg)
    assert describe(cfg.workers, started) == describe(cfg.workers, printed)


def run_cli(tmp_path: Path, toml: str, *args: str) -> Any:
    path = tmp_path / "edgenode.toml"
    path.write_text(toml)
    return CliRunner().invoke(capacity, list(args), obj={"config": str(path)})


TEST_ENGINE = '[workers]\nengine = "test"\nmemory_max = "{}"\n[capacity]\nmemory_budget = "8G"\n'


def test_cli_shows_the_limits_start_applies(tmp_path: Path) -> None:
    auto = run_cli(tmp_path, TEST_ENGINE.format("auto"))
    assert auto.exit_code == 0, auto.output
    assert (
        "workers     memory.max = 96.8 MiB, memory.high = 92.4 MiB per worker at start "
        '(workers.memory_max = "auto": the plan\'s limits)'
    ) in auto.output
    sized = run_cli(tmp_path, TEST_ENGINE.format("1G")).output
    assert "memory.max = 1 GiB, memory.high = 921.6 MiB per worker at start" in sized
    unlimited = run_cli(tmp_path, TEST_ENGINE.format("max")).output
    assert "no memory.max, no memory.high per worker at start" in unlimited


def test_cli_json_has_the_worker_limits(tmp_path: Path) -> None:
    data = json.loads(run_cli(tmp_path, TEST_ENGINE.format("auto"), "--json").output)
    assert data["worker_limits"] == {
        "setting": "auto",
        "memory_max": data["memory_max"],
        "memory_high": data["memory_high"],
    }


def test_status_shows_what_the_workers_got() -> None:
    status: dict[str, Any] = {
        "queue_depth": 0,
        "queue_bound": 8,
        "in_flight": 0,
        "credit": 2,
        "capacity": {
            "per_worker": 258 * MiB,  # the default 4-slot worker (grammar 8.3 MiB)
            "grammar": 8 * MiB,
            "memory_max": 382_943_232,
            "total": GiB,
            "budget": 8 * GiB,
            "worker_limits": {"setting": "auto", "memory_max": 382_943_232, "memory_high": 1},
        },
    }
    line = next(x for x in render_status(status).splitlines() if x.startswith("capacity"))
    assert "258 MiB per worker, 8 MiB of it for a json_schema" in line
    assert 'workers get memory.max 365.2 MiB (workers.memory_max = "auto")' in line
    status["capacity"]["worker_limits"] = {"setting": "max", "memory_max": None}
    line = next(x for x in render_status(status).splitlines() if x.startswith("capacity"))
    assert 'workers get memory.max none (workers.memory_max = "max")' in line


@pytest.mark.usefixtures("many_cores")  # 2 workers x 2 threads: 4 cores, not the host's
def test_start_and_capacity_agree_on_auto_slots_and_their_limits(
    tmp_path: Path, gemma: ModelMeta
) -> None:
    # workers.slots = "auto" and memory_max = "auto": start (check_fits) and
    # `edgenode capacity` resolve the same slots, so the limits they give agree.
    toml = (
        '[workers]\ncount = 2\nslots = "auto"\nthreads = 2\nmemory_max = "auto"\n'
        '[capacity]\nmemory_budget = "2000M"\nreserve = "1G"\nruntime_overhead = "88M"\n'
        "[model]\nflash_attn = false\n"  # the arithmetic below: plain attention's 32 MiB scratch
    )
    (tmp_path / "edgenode.toml").write_text(toml)
    started = check_fits(load_config(str(tmp_path / "edgenode.toml")))
    data = json.loads(run_cli(tmp_path, toml, "--json").output)
    # 2000M - 1G - 235.2 MiB = 740.8 MiB for 2 workers of (42 MiB x S + 116.3 MiB) x 1.1
    # (4 MiB of runtime per slot beyond the first, 2 MiB of grammar per slot): 5 slots
    # (359 MiB each) fit, 6 (405.2 MiB) do not; the cap would allow 8.
    assert started.slots == data["slots"] == 5
    assert data["worker_limits"]["memory_max"] == started.memory_max == data["memory_max"]
    grammar = 512 * 704 + 5 * 2 * MiB  # node.capacity.plan.grammar_allowance
    assert started.per_worker == 5 * 36 * MiB + (120 + 4 * 4) * MiB + grammar
